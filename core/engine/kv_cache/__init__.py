"""Paged KV cache: block pool, prefix hashes, per-group managers, coordinators, KVCacheManager."""
