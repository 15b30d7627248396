"""Design-decision benchmarks, run from a checkout: `python -m benchmarks.NAME`. Not installed."""
