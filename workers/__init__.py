"""Ready-made ManagedModel classes: a no-op echo for benchmarks and offline text-embedding models."""
