"""Benchmarks.

`cluster bench`, the benchmark a user runs on their own cluster: `cli`, `benchmark`,
`workload`, `client`, `metrics`, `nodes`, `baselines`, `report`, `plots`, `cluster_up`.
The other modules are a developer's design-decision scripts (`python -m
cluster.bench.<name>`, each described in its docstring; `gpu_bench` is a package, a module a
phase); `ring_baseline` also serves `cluster bench --baseline ring`, over the hosts of a
cluster file through `ring_hosts` (here) and `ring_rank` (on each host).
"""
