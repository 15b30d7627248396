"""Benchmarks that decide design choices by measurement (`python -m cluster.bench.<name>`)."""
