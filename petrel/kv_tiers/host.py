"""The host-memory tier: blobs in a bounded store, the next to go spilled to the next tier when full: the lowest
retention priority first (petrel/engine/kv_retention.py; blocks stored without one have the default), least
recently used first among equals."""

from __future__ import annotations

import threading
from collections.abc import Callable

from petrel.engine.eviction import EvictionQueue
from petrel.engine.kv_retention import DEFAULT_PRIORITY
from petrel.kv_tiers.base import StoreStats


class HostTier:
    name = "host"

    def __init__(self, capacity_bytes: int, spill: Callable[[bytes, bytes], None] | None = None):
        """capacity_bytes: the most blob bytes held; spill(key, blob): where the least recently used go when a put
        needs room (the next tier down), or None to drop them."""
        if not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ValueError(f"host tier capacity must be a positive number of bytes, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.spill = spill
        self._blobs: dict[bytes, bytes] = {}
        self._order: EvictionQueue[bytes] = EvictionQueue()  # the keys, the next to go first
        self._bytes = 0
        self._stats = StoreStats()
        self._lock = threading.Lock()  # the engine loop and a scrape may use it at once

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._blobs)

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            blob = self._blobs.get(key)
            if blob is None:
                self._stats.misses += 1
                return None
            self._order.touch(key)
            self._stats.hits += 1
            self._stats.bytes_out += len(blob)
            return blob

    def put(self, key: bytes, blob: bytes, priority: int = DEFAULT_PRIORITY) -> None:
        spilled = []
        with self._lock:
            self._stats.puts += 1
            if len(blob) > self.capacity_bytes:
                self._stats.dropped += 1
                return
            old = self._blobs.pop(key, None)
            if old is not None:
                self._order.pop(key)
                self._bytes -= len(old)
            while self._bytes + len(blob) > self.capacity_bytes:
                k, _ = self._order.popitem(last=False)
                b = self._blobs.pop(k)
                self._bytes -= len(b)
                spilled.append((k, b))
            self._blobs[key] = blob
            self._order.add(key, priority)
            self._bytes += len(blob)
            self._stats.bytes_in += len(blob)
        if self.spill is not None:
            for k, b in spilled:
                self.spill(k, b)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._blobs

    def stats(self) -> dict[str, int]:
        with self._lock:
            return self._stats.as_dict()
