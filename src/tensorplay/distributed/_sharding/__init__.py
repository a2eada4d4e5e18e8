"""Sharding core shared by ZeRO, fully_shard and the classic FSDP: pure layout math, plans, storage, placement."""
