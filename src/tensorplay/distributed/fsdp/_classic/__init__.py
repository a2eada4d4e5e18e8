"""The classic ``FullyShardedDataParallel``: flat parameters, sharding plans, hooks and state dicts."""
