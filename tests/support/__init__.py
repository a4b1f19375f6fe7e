"""Helpers shared by the test suite: models and process fixtures."""
