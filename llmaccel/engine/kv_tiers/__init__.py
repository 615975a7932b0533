"""The KV cache's tiers below the RAM pool: a directory of block files (disk.py) and what moves blocks between it
and the pool (offload.py). Replicas sharing the directory share the tier."""
