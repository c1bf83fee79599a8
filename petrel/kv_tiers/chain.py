"""The lower tiers in order (host memory, then disk), and the store instances share: a block evicted from the KV cache
goes into the first local tier; the first's least recently used spill into the next; every block an engine computes
is published to the shared store (when there is one). A lookup tries host memory (the host tier, then the staging
area), then the slow tiers (disk, the shared store), and checks the blob it gets (petrel/kv_tiers/block_codec.py)
before the engine uses it. A blob that fails the check is counted and skipped: the block is recomputed, never used.

The engine reads the slow tiers only through read_slow, on the fetch worker's thread (fetch_worker.py): the blobs
it finds wait in the staging area (bounded, the oldest dropped first) for the request's lookup, which then reads
host memory alone (fetch(..., slow=False))."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import torch

from petrel.kv_tiers.base import BlockStore
from petrel.kv_tiers.block_codec import BlockCodecError, BlockLayout, decode_block, encode_block
from petrel.kv_tiers.disk import DiskTier
from petrel.kv_tiers.fetch_worker import Fetch
from petrel.kv_tiers.host import HostTier

logger = logging.getLogger("petrel")
MAX_STAGED_BYTES = 1 << 30  # blobs read ahead of their lookup, at most (the oldest go first)


def tier_key(group: int, block_hash: bytes) -> bytes:
    """A block's key in the tiers: its chain hash (KV group 0, the only group of most models), or the hash and
    the group (a model with several KV groups has a block per group for the same tokens)."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "big")


class TierChain:
    def __init__(self, tiers: list[BlockStore], layout: BlockLayout, shared: BlockStore | None = None):
        """tiers: the local ones, in order (evicted blocks enter the first); shared: the store instances share."""
        if not tiers and shared is None:
            raise ValueError("a tier chain needs at least one tier")
        self.tiers = tiers
        self.shared = shared
        self.layout = layout
        self.memory = [tier for tier in tiers if isinstance(tier, HostTier)]  # read on the engine thread
        self.slow = [tier for tier in tiers if not isinstance(tier, HostTier)]  # read by the fetch worker
        self.staged: OrderedDict[bytes, bytes] = OrderedDict()  # blobs read from a slow tier, ahead of their lookup
        self.staged_bytes = 0
        self._lock = threading.Lock()  # the staging area and the counters the fetch worker adds to
        self.published_blocks = 0  # computed blocks handed to the shared store
        self.hint_prefetched_blocks = 0
        self.hint_ignored_hashes = 0  # hinted hashes outside the request's own chain
        self.stored_blocks = 0  # blocks put into the first tier
        self.fetched_blocks = 0  # blocks found, checked and handed to the engine (which may not take them all)
        self.rejected_blocks = 0  # blobs found but refused by the check (another model, corrupted, truncated)
        self.failed_puts = 0  # a tier's put or get that raised (a store that went away): counted, logged, skipped
        self.failed_gets = 0
        self.fetch_seconds = 0.0  # time spent finding, reading and checking blocks (either thread)

    def store(self, group: int, block_hash: bytes, tokens, kv: torch.Tensor, priority: int | None = None) -> None:
        """Keep one evicted block's KV ([layers, 2, block_size, kv_heads, head_dim]) in the first local tier; the host
        tier drops its lowest retention priority first when full (None: the default priority)."""
        if self.tiers and self._put(self.tiers[0], group, block_hash, tokens, kv, priority):
            self.stored_blocks += 1

    def publish(self, group: int, block_hash: bytes, tokens, kv: torch.Tensor) -> None:
        """Hand one computed block's KV to the shared store (its put is asynchronous and bounded)."""
        if self.shared is not None and self._put(self.shared, group, block_hash, tokens, kv):
            self.published_blocks += 1

    def _put(
        self, tier: BlockStore, group: int, block_hash: bytes, tokens, kv: torch.Tensor, priority: int | None = None
    ) -> bool:
        key = tier_key(group, block_hash)
        try:
            blob = encode_block(self.layout, key, group, tokens, kv)
            if priority is not None and isinstance(tier, HostTier):
                tier.put(key, blob, priority)
            else:
                tier.put(key, blob)
        except Exception as exc:  # noqa: BLE001 - a store that fails loses a block, never a step
            self.failed_puts += 1
            logger.warning("KV %s tier: storing block %s failed: %s", tier.name, key.hex()[:16], exc)
            return False
        return True

    def slow_keys(self, keys: list[bytes]) -> list[bytes]:
        """What a fetch should read of these keys (a prompt's blocks past the KV cache, in chain order): the keys
        from the first one host memory lacks on, when a slow tier may hold that one (the shared store always may:
        asking it is the fetch's round trip); [] when the lookup needs no slow tier."""
        for i, key in enumerate(keys):
            if self._in_memory(key):
                continue
            if self.shared is not None or any(tier.contains(key) for tier in self.slow):
                return keys[i:]
            return []
        return []

    def read_slow(self, fetch: Fetch) -> None:
        """Read the fetch's blocks that host memory lacks from the slow tiers into the staging area, in chain order
        up to the first one none holds: the local ones block by block, then the shared store in one round trip.
        Runs on the fetch worker's thread; a tier that fails is a miss. The blobs are checked at their lookup."""
        t0 = time.perf_counter()
        try:
            keys = [key for key in fetch.keys if not self._in_memory(key)]
            for i, key in enumerate(keys):
                blob = next((b for tier in self.slow if (b := self._reader(tier, key)()) is not None), None)
                if blob is None:
                    keys = keys[i:]
                    break
                if not self._stage(fetch, key, blob):
                    return
            else:
                keys = []
            if keys and self.shared is not None:
                for key, blob in zip(keys, self._get_many(keys)):
                    if blob is None or not self._stage(fetch, key, blob):
                        break
        finally:
            self.add_fetch_time(time.perf_counter() - t0)

    def _get_many(self, keys: list[bytes]) -> list[bytes | None]:
        try:
            get_many = getattr(self.shared, "get_many", None)
            return get_many(keys) if get_many is not None else [self.shared.get(k) for k in keys]
        except Exception as exc:  # noqa: BLE001 - a store that fails is a miss
            with self._lock:
                self.failed_gets += 1
            logger.warning("KV %s tier: reading %d blocks failed: %s", self.shared.name, len(keys), exc)
            return [None] * len(keys)

    def _stage(self, fetch: Fetch, key: bytes, blob: bytes) -> bool:
        """Keep a blob read for the fetch until its lookup; False (nothing kept) once the fetch is cancelled."""
        with self._lock:
            if fetch.cancelled:
                return False
            self._unstage(key)
            self.staged[key] = blob
            self.staged_bytes += len(blob)
            while self.staged_bytes > MAX_STAGED_BYTES:
                self._unstage(next(iter(self.staged)))
            fetch.staged.append(key)
            fetch.blocks += 1
            fetch.bytes += len(blob)
            if fetch.hinted:
                self.hint_prefetched_blocks += 1
            return True

    def cancel(self, fetch: Fetch) -> None:
        """The fetch's request went away: nothing more is staged for it, and what was staged for it is dropped."""
        with self._lock:
            fetch.cancelled = True
            for key in fetch.staged:
                self._unstage(key)

    def _unstage(self, key: bytes) -> bytes | None:
        blob = self.staged.pop(key, None)
        if blob is not None:
            self.staged_bytes -= len(blob)
        return blob

    def _in_memory(self, key: bytes) -> bool:
        with self._lock:
            if key in self.staged:
                return True
        return any(tier.contains(key) for tier in self.memory)

    def add_fetch_time(self, seconds: float) -> None:
        with self._lock:
            self.fetch_seconds += seconds

    def _reader(self, tier: BlockStore, key: bytes):
        def get() -> bytes | None:
            try:
                return tier.get(key)
            except Exception as exc:  # noqa: BLE001 - a tier that fails is a miss: the block is recomputed
                with self._lock:
                    self.failed_gets += 1
                logger.warning("KV %s tier: reading block %s failed: %s", tier.name, key.hex()[:16], exc)
                return None

        return get

    def _copies(self, key: bytes, slow: bool):
        """(tier name, get) of each place that may hold the key, in lookup order: the local tiers (slow=False: the
        host tier alone), a blob staged by a fetch (taken out of the staging area), then (slow) the shared store."""
        for tier in self.tiers if slow else self.memory:
            yield tier.name, self._reader(tier, key)
        with self._lock:
            blob = self._unstage(key)
        if blob is not None:
            yield "staged", lambda: blob
        if slow and self.shared is not None:
            yield self.shared.name, self._reader(self.shared, key)

    def fetch(self, group: int, block_hash: bytes, tokens, slow: bool = True) -> torch.Tensor | None:
        """The block's checked KV from the first place that holds a good copy, or None (recompute it). slow=False:
        host memory only (the engine's lookup: the slow tiers are read by the fetch worker)."""
        t0 = time.perf_counter()
        key = tier_key(group, block_hash)
        try:
            for name, get in self._copies(key, slow):
                blob = get()
                if blob is None:
                    continue
                try:
                    kv = decode_block(self.layout, blob, key, group, tokens)
                except BlockCodecError as exc:
                    self.rejected_blocks += 1
                    logger.warning("KV %s tier: block %s refused, recomputing it: %s", name, key.hex()[:16], exc)
                    continue
                self.fetched_blocks += 1
                return kv
            return None
        finally:
            self.add_fetch_time(time.perf_counter() - t0)

    def stats(self) -> dict[str, dict]:
        """Counters since start: each tier's (hits, misses, puts, bytes_in, bytes_out, dropped, errors) and the
        chain's own ("all": stored, fetched, rejected blocks and fetch_seconds)."""
        out: dict[str, dict] = {tier.name: tier.stats() for tier in self.tiers}
        if self.shared is not None:
            out[self.shared.name] = self.shared.stats()
        out["all"] = {
            "stored_blocks": self.stored_blocks,
            "published_blocks": self.published_blocks,
            "hint_prefetched_blocks": self.hint_prefetched_blocks,
            "hint_ignored_hashes": self.hint_ignored_hashes,
            "fetched_blocks": self.fetched_blocks,
            "rejected_blocks": self.rejected_blocks,
            "failed_puts": self.failed_puts,
            "failed_gets": self.failed_gets,
            "fetch_seconds": self.fetch_seconds,
        }
        return out

    def close(self) -> None:
        for tier in [*self.tiers, *([self.shared] if self.shared is not None else [])]:
            close = getattr(tier, "close", None)
            if close is not None:
                close()


def build_tiers(
    layout: BlockLayout,
    host_bytes: int | None,
    disk_path: str | None,
    disk_bytes: int | None,
    shared: BlockStore | None = None,
) -> TierChain | None:
    """The tiers an engine's options ask for (None: none): host memory, disk, or host memory spilling to disk; and
    the shared store (shared) if there is one."""
    disk = DiskTier(disk_path, disk_bytes) if disk_path else None
    tiers: list[BlockStore] = []
    if host_bytes:
        tiers.append(HostTier(host_bytes, spill=disk.put if disk is not None else None))
    if disk is not None:
        tiers.append(disk)
    return TierChain(tiers, layout, shared) if tiers or shared is not None else None
