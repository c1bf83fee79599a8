"""KV blocks beyond one instance's KV memory, keyed by their prefix-cache chain hash: blocks evicted from the paged
KV cache kept in host memory and on disk and brought back instead of recomputed (chain.py, host.py, disk.py; the
slow ones read off the engine thread by fetch_worker.py), the store instances share (redis_store.py), the one block
format (block_codec.py) and dkv_cache_hint (dkv_hint.py).
Nothing is imported here: the request side (dkv_hint) stays free of torch."""
