"""The Executor's KV cache events (TensorRT-LLM's KVCacheEventManager, from Executor.get_kv_cache_event_manager()
when KvCacheConfig.event_buffer_max_size > 0): what the prefix cache stored and removed, for a cache-aware router.

They are the events the gRPC worker streams (petrel/grpc/kv_events.py): the block manager's sink calls, in the
engine loop, for the global-attention group's blocks. A block's hash is its chain hash's first 8 bytes as a signed
big-endian int64 (the gRPC worker's rule too); its tokens are UniqueTokens of its token ids (token_extra_id 0: the
extra ids of virtual tokens are in the chain hash, not in the events); its priority is its retention priority when
it was stored. A run of stored blocks each
chained on the one before becomes one KVCacheStoredData, as TensorRT-LLM sends it. A prefix-cache reset becomes one
KVCacheRemovedData of every block stored and not yet removed.

The queue holds at most event_buffer_max_size events (each stored block counts one); when it is full the oldest
are dropped. A KVCacheCreatedData with the cache's size (blocks of the KV cache, and of the host tier when there is
one) comes first."""

from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field


def block_hash_int64(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big", signed=True)


@dataclass(frozen=True)
class UniqueToken:
    token_id: int
    token_extra_id: int = 0


@dataclass(frozen=True)
class KVCacheCreatedData:
    num_blocks_per_cache_level: list[int]


@dataclass(frozen=True)
class KVCacheStoredBlockData:
    block_hash: int
    tokens: list[UniqueToken]
    lora_id: int | None = None
    cache_level: int = 0
    priority: int = 35


@dataclass(frozen=True)
class KVCacheStoredData:
    parent_hash: int | None
    blocks: list[KVCacheStoredBlockData] = field(default_factory=list)


@dataclass(frozen=True)
class KVCacheRemovedData:
    block_hashes: list[int]


@dataclass(frozen=True)
class KVCacheEvent:
    event_id: int
    data: KVCacheCreatedData | KVCacheStoredData | KVCacheRemovedData
    window_size: int


class KVCacheEventManager:
    def __init__(self, max_events: int, window_size: int, created: list[int]):
        self.window_size = window_size
        self._ids = itertools.count()
        self._raw: collections.deque = collections.deque(maxlen=max_events)  # (id, raw event, priority)
        self._live: set[bytes] = set()  # stored and not removed (engine loop only)
        self._cond = threading.Condition()
        self._put(("created", created), None)
        self.priority_of = lambda digest: 35  # set by the Executor: a stored block's retention priority

    def sink(self, event: tuple) -> None:
        """The block manager's kv_event_sink (engine loop): ("stored", hash, parent, tokens), ("removed", hash) or
        ("cleared",); a run of removals of one reset comes as one event."""
        kind = event[0]
        if kind == "stored":
            self._live.add(event[1])
            self._put(event, self.priority_of(event[1]))
        elif kind == "removed":
            self._live.discard(event[1])
            self._put(event, None)
        else:
            gone, self._live = sorted(self._live), set()
            if gone:
                self._put(("removed_all", gone), None)

    def _put(self, event: tuple, priority) -> None:
        with self._cond:
            self._raw.append((next(self._ids), event, priority))
            self._cond.notify_all()

    def get_latest_events(self, timeout_ms: float | None = None) -> list[KVCacheEvent]:
        """The events since the last call, oldest first; waits up to timeout_ms for the first (None: no wait)."""
        deadline = time.monotonic() + (timeout_ms or 0) / 1000.0
        with self._cond:
            while not self._raw:
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._cond.wait(left)
            raw, self._raw = list(self._raw), collections.deque(maxlen=self._raw.maxlen)
        return self._convert(raw)

    def _convert(self, raw: list) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        last_stored = None  # (digest, its event's blocks): a stored block chained on it joins that event
        for event_id, event, priority in raw:
            kind = event[0]
            if kind == "stored":
                _, digest, parent, tokens = event
                unique = [UniqueToken(t) for t in tokens]
                block = KVCacheStoredBlockData(block_hash_int64(digest), unique, None, 0, priority)
                if last_stored is not None and parent == last_stored[0]:
                    blocks = last_stored[1]
                    blocks.append(block)
                else:
                    blocks = [block]
                    stored = KVCacheStoredData(None if parent is None else block_hash_int64(parent), blocks)
                    out.append(KVCacheEvent(event_id, stored, self.window_size))
                last_stored = (digest, blocks)
                continue
            last_stored = None
            data: KVCacheCreatedData | KVCacheRemovedData
            if kind == "created":
                data = KVCacheCreatedData(list(event[1]))
            elif kind == "removed":
                data = KVCacheRemovedData([block_hash_int64(event[1])])
            else:
                data = KVCacheRemovedData([block_hash_int64(h) for h in event[1]])
            out.append(KVCacheEvent(event_id, data, self.window_size))
        return out


def attach_kv_events(core, max_events: int) -> KVCacheEventManager:
    """A manager fed by the core's block manager (call in the engine loop: Executor does, through engine.call)."""
    bm = core.block_manager
    created = [bm.num_blocks]
    if core.config.kv_host_tier_bytes:
        per_block = sum(t[:, 0].numel() * t.element_size() for t in core.runner.cache_tensors)
        created.append(core.config.kv_host_tier_bytes // per_block)
    manager = KVCacheEventManager(max_events, bm.windows[0] or core.max_model_len, created)
    manager.priority_of = lambda digest: bm.block_priority.get(bm.hash_to_block.get(digest), 35)
    bm.kv_event_sink = manager.sink
    return manager
