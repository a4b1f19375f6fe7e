"""The package version, read by setup.cfg."""
VERSION = "0.1.0"
