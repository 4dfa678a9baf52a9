"""Benchmarks and load generators (run as modules: ``python -m loadtest.<name>``)."""
