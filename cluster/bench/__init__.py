"""`cluster bench`: the benchmark a user runs on their own cluster.

The command is `cluster.commands.bench`. `benchmark` runs its scenarios (`workload`) through
the HTTP API (`client`), `metrics` turns the requests into figures and `nodes` reads each
node's share of the work; `cluster_up` starts the cluster to measure (`--local N`, `--hosts
FILE`); `baselines` measures mlx-lm on the same prompts, in one process or as its own ring
pipeline (`ring_baseline`: here, `ring_hosts` and `ring_rank`: over the hosts of a cluster
file); `report` and `plots` write the results.
"""
