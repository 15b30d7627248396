"""A Qwen3.5 shard: its layers, their caches and snapshots, the MTP head, loading and conversion."""
