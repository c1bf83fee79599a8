"""The lower tiers in order (host memory, then disk), and the store instances share: a block evicted from the KV cache
goes into the first local tier; the first's least recently used spill into the next; every block an engine computes
is published to the shared store (when there is one). A lookup tries the local tiers, then the shared store, and
checks the blob it gets (petrel/kv_tiers/block_codec.py) before the engine uses it. A blob that fails the check is
counted and skipped: the block is recomputed, never used."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import torch

from petrel.kv_tiers.base import BlockStore
from petrel.kv_tiers.block_codec import BlockCodecError, BlockLayout, decode_block, encode_block
from petrel.kv_tiers.disk import DiskTier
from petrel.kv_tiers.host import HostTier

logger = logging.getLogger("petrel")
MAX_PREFETCHED = 1024  # hinted blobs held ahead of their lookup, at most (the oldest go first)


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
        self.prefetched: OrderedDict[bytes, bytes] = OrderedDict()  # hinted blobs fetched ahead of their lookup
        self.published_blocks = 0  # computed blocks handed to the shared store
        self.hint_prefetched_blocks = 0
        self.hint_ignored_hashes = 0  # hinted hashes outside the request's own chain
        self.stored_blocks = 0  # blocks put into the first tier
        self.fetched_blocks = 0  # blocks found, checked and handed to the engine (which may not take them all)
        self.rejected_blocks = 0  # blobs found but refused by the check (another model, corrupted, truncated)
        self.failed_puts = 0  # a tier's put or get that raised (a store that went away): counted, logged, skipped
        self.failed_gets = 0
        self.fetch_seconds = 0.0  # time spent finding, reading and checking blocks

    def store(self, group: int, block_hash: bytes, tokens, kv: torch.Tensor) -> None:
        """Keep one evicted block's KV ([layers, 2, block_size, kv_heads, head_dim]) in the first local tier."""
        if self.tiers and self._put(self.tiers[0], group, block_hash, tokens, kv):
            self.stored_blocks += 1

    def publish(self, group: int, block_hash: bytes, tokens, kv: torch.Tensor) -> None:
        """Hand one computed block's KV to the shared store (its put is asynchronous and bounded)."""
        if self.shared is not None and self._put(self.shared, group, block_hash, tokens, kv):
            self.published_blocks += 1

    def _put(self, tier: BlockStore, group: int, block_hash: bytes, tokens, kv: torch.Tensor) -> bool:
        key = tier_key(group, block_hash)
        try:
            tier.put(key, encode_block(self.layout, key, group, tokens, kv))
        except Exception as exc:  # noqa: BLE001 - a store that fails loses a block, never a step
            self.failed_puts += 1
            logger.warning("KV %s tier: storing block %s failed: %s", tier.name, key.hex()[:16], exc)
            return False
        return True

    def prefetch(self, keys: list[bytes], num_ignored: int = 0) -> None:
        """Fetch these blocks' blobs from the shared store in one round trip, ahead of their lookup (a
        dkv_cache_hint names them); each is checked when looked up, like any other blob."""
        self.hint_ignored_hashes += num_ignored
        keys = [k for k in keys if k not in self.prefetched][:MAX_PREFETCHED]
        if self.shared is None or not keys:
            return
        t0 = time.perf_counter()
        try:
            get_many = getattr(self.shared, "get_many", None)
            blobs = get_many(keys) if get_many is not None else [self.shared.get(k) for k in keys]
        except Exception as exc:  # noqa: BLE001 - a store that fails is a miss
            self.failed_gets += 1
            logger.warning("KV %s tier: prefetching %d hinted blocks failed: %s", self.shared.name, len(keys), exc)
            return
        finally:
            self.fetch_seconds += time.perf_counter() - t0
        for key, blob in zip(keys, blobs):
            if blob is not None:
                self.prefetched[key] = blob
                self.hint_prefetched_blocks += 1
        while len(self.prefetched) > MAX_PREFETCHED:  # the oldest never looked up (a request gone, a memory hit)
            self.prefetched.popitem(last=False)

    def _copies(self, key: bytes):
        """(tier name, blob or None) of each place that may hold the key, in lookup order: the local tiers, then a
        blob prefetched for a hint, else the shared store."""
        for tier in self.tiers:
            yield tier.name, lambda tier=tier: tier.get(key)
        if key in self.prefetched:
            blob = self.prefetched.pop(key)
            yield "store", lambda: blob
        elif self.shared is not None:
            yield self.shared.name, lambda: self.shared.get(key)

    def fetch(self, group: int, block_hash: bytes, tokens) -> torch.Tensor | None:
        """The block's checked KV from the first tier that holds a good copy, or None (recompute it)."""
        t0 = time.perf_counter()
        key = tier_key(group, block_hash)
        try:
            for name, get in self._copies(key):
                try:
                    blob = get()
                except Exception as exc:  # noqa: BLE001 - a tier that fails is a miss: the block is recomputed
                    self.failed_gets += 1
                    logger.warning("KV %s tier: reading block %s failed: %s", name, key.hex()[:16], exc)
                    continue
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
            self.fetch_seconds += time.perf_counter() - t0

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
