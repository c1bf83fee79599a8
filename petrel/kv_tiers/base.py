"""The one interface between a KV tier (or the shared store) and the engine: opaque blobs keyed by chain hash."""

from __future__ import annotations

from typing import Protocol


class BlockStore(Protocol):  # a lower tier, or the shared store: opaque blobs keyed by a block's chain hash
    name: str  # "host", "disk", "store"

    def get(self, key: bytes) -> bytes | None: ...  # None: absent (or unreachable)

    def put(self, key: bytes, blob: bytes) -> None: ...  # may drop (bounded); never raises for capacity

    def contains(self, key: bytes) -> bool: ...

    def stats(self) -> dict[str, int]: ...  # hits, misses, puts, bytes_in, bytes_out, dropped, errors
