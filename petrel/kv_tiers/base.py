"""What a lower KV tier is to the engine: a store of opaque blobs keyed by a block's prefix-cache hash.

The key is the block's chain hash (BlockManager._extend_hashes: its root already holds the engine's hash seed, the
request's cache_salt, LoRA adapter, prompt-tuning table and image hashes), so two requests that must not share KV
never share a key. A blob is one block's KV in petrel/kv_tiers/block_codec.py's form: its header names the model,
dtype, layout, hash and tokens, and the reader checks all of them and the payload's checksum before using it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol, runtime_checkable


@runtime_checkable
class BlockStore(Protocol):
    """A lower tier, or the shared store: opaque blobs keyed by a block's chain hash."""

    name: str  # "host", "disk", "store" (metrics labels)

    def get(self, key: bytes) -> bytes | None:
        """The blob, or None: absent (or unreachable)."""

    def put(self, key: bytes, blob: bytes) -> None:
        """Keep the blob; may drop it (bounded); never raises for capacity."""

    def contains(self, key: bytes) -> bool: ...

    def stats(self) -> dict[str, int]:
        """hits, misses, puts, bytes_in, bytes_out, dropped, errors (since start)."""


@dataclass
class StoreStats:
    """The counters every store reports (stats())."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    bytes_in: int = 0  # bytes stored (put)
    bytes_out: int = 0  # bytes handed out (get hits)
    dropped: int = 0  # puts not kept (too large, or a write that failed)
    errors: int = 0  # I/O failures

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
