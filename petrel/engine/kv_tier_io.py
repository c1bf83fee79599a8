"""The engine's side of the lower KV tiers (petrel/kv_tiers): the block manager decides, this moves the rows.

Right after scheduling, before anything writes the KV cache this step (imported KV, drafts, the forward pass):
1. the cached blocks the block manager evicted for reuse (pending_evictions) are copied out of the runner's cache
   tensors and stored in the tiers (their rows are still intact: only the runner writes the cache, and it has not
   run yet);
2. the blocks computed since the last step (pending_publishes, only with a shared store) are copied out and handed
   to the store (its puts are asynchronous);
3. the blocks allocated for tier hits (pending_loads, checked when the prefix was matched) get their KV written.
The engine thread reads host memory only. A waiting request whose prompt chain goes on past the KV cache into a slow
tier (disk, the shared store) is held back by the scheduler (fetch_pending) while the fetch worker
(petrel/kv_tiers/fetch_worker.py) reads those blocks into host memory; the batch runs on without it. Once the
fetch is done, or past kv_tier_fetch_timeout, it is admitted and its lookup finds what was read (a block not read
is recomputed). A request with a dkv_cache_hint has its fetch, of the hinted blocks of its own chain, started when
it arrives (prefetch_hint). The seconds it was held back and the blocks and bytes read for it are its
kv_fetch (KVFetchStats, in its perf metrics).
Copies out (evictions, publishes) still run on the engine thread: a host-tier put is a memcpy and a CRC-32, but one
that spills to the disk tier writes a file per block.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from petrel.engine.sequence import Sequence, SequenceStatus
from petrel.kv_tiers.block_codec import BlockLayout, dtype_name, model_fingerprint
from petrel.kv_tiers.chain import TierChain, build_tiers, tier_key
from petrel.kv_tiers.dkv_hint import plan_hinted_fetch
from petrel.kv_tiers.fetch_worker import Fetch, FetchWorker
from petrel.kv_tiers.redis_store import store_from_config
from petrel.model.kv_layout import kv_layout_of
from petrel.outputs import KVFetchStats


def build_tier_io(config, runner, model, model_config, block_manager) -> KVTierIO | None:
    """The tiers EngineConfig asks for, wired to the block manager (None when none is asked for)."""
    if not config.kv_host_tier_bytes and not config.kv_disk_tier_path and not config.kv_store_url:
        return None
    cache = runner.cache_tensors[0]
    fingerprint = model_fingerprint(model, model_config, config.quantization)
    layout = BlockLayout(
        fingerprint=fingerprint,
        dtype=dtype_name(cache.dtype),
        num_layers=len(runner.cache_tensors),
        block_size=cache.shape[2],
        kv_heads=cache.shape[3],
        head_dim=cache.shape[4],
        kind=kv_layout_of(model_config).kind,
    )
    disk_bytes = config.kv_disk_tier_bytes
    # one namespace per model in the shared store: chain hashes carry no model, and two models must not overwrite
    # each other's blocks (the codec's check would refuse them anyway)
    shared = store_from_config(config, namespace=f"petrel:kv:{fingerprint[:16]}")
    tiers = build_tiers(layout, config.kv_host_tier_bytes, config.kv_disk_tier_path, disk_bytes, shared)
    io = KVTierIO(runner, tiers, block_manager, config.kv_tier_fetch_timeout)
    block_manager.offload_min_priority = config.secondary_offload_min_priority
    block_manager.tier_fetch = lambda group, block_hash, tokens: tiers.fetch(group, block_hash, tokens, slow=False)
    block_manager.publish_computed = shared is not None
    return io


@dataclass(eq=False)
class _Held:
    """A waiting sequence's fetch, and since when the scheduler has held the sequence back for it."""

    fetch: Fetch
    since: float | None = None
    released: bool = False


class KVTierIO:
    def __init__(self, runner, tiers: TierChain, block_manager, fetch_timeout_s: float):
        self.runner = runner
        self.tiers = tiers
        self.block_manager = block_manager
        self.worker = FetchWorker(tiers.read_slow, fetch_timeout_s)
        self.held: dict[Sequence, _Held] = {}  # waiting sequences with a fetch (until admitted or finished)
        self.fetch_timeouts = 0  # fetches a sequence stopped waiting for at their deadline
        self.store_seconds = 0.0  # copying evicted blocks out and storing them
        self.step_loaded = 0  # this step's blocks written from the tiers, and stored into them
        self.step_stored = 0
        self.loaded_blocks = 0  # blocks written from the tiers into the KV cache, since start

    def drain(self, block_manager) -> None:
        """Move this schedule's evicted blocks down and its tier hits in (see the module's doc)."""
        for seq in [s for s in self.held if s.status is not SequenceStatus.WAITING]:  # admitted, or finished
            self.forget(seq)
        evictions, block_manager.pending_evictions = block_manager.pending_evictions, []
        priorities, block_manager.evicted_priorities = block_manager.evicted_priorities, {}
        loads, block_manager.pending_loads = block_manager.pending_loads, {}
        publishes, block_manager.pending_publishes = block_manager.pending_publishes, []
        self.step_loaded, self.step_stored = len(loads), len(evictions)
        self.loaded_blocks += len(loads)
        if evictions or publishes:
            t0 = time.perf_counter()
            self._copy_out(
                evictions,
                lambda group, h, tokens, kv: self.tiers.store(group, h, tokens, kv, priorities.get((group, h))),
            )
            self._copy_out(publishes, self.tiers.publish)
            self.store_seconds += time.perf_counter() - t0
        if loads:
            t0 = time.perf_counter()
            try:
                self._load(loads)
            except BaseException:
                block_manager.forget_contents(list(loads))  # never leave a block published without its KV
                raise
            finally:
                self.tiers.add_fetch_time(time.perf_counter() - t0)

    def _copy_out(self, blocks: list[tuple[int, int, bytes, tuple]], keep) -> None:
        """keep(group, hash, tokens, KV) for each listed (block, group, hash, tokens), its rows copied out."""
        if not blocks:
            return
        caches = self.runner.cache_tensors
        index = torch.tensor([block for block, *_ in blocks], dtype=torch.long, device=caches[0].device)
        rows = torch.stack([cache[:, index] for cache in caches]).cpu()  # [layers, planes, n, block_size, heads, dim]
        for j, (_, group, block_hash, tokens) in enumerate(blocks):
            keep(group, block_hash, tokens, rows[:, :, j])

    def prefetch_hint(self, block_manager, seq, request) -> None:
        """Start fetching the hinted blocks of the request's own hash chain from the shared store as it arrives; a
        hinted hash outside the chain is ignored and counted (a hint is never trusted)."""
        if not (request.kv_hint_keys or request.kv_hint_tokens):
            return
        chain = block_manager.prompt_block_hashes(seq)
        hinted_blocks = request.kv_hint_tokens // block_manager.block_size
        keys, ignored = plan_hinted_fetch(chain, request.kv_hint_keys, hinted_blocks)
        self.tiers.hint_ignored_hashes += ignored
        if keys and self.tiers.shared is not None and (fetch := self.worker.submit(keys, hinted=True)) is not None:
            self.held[seq] = _Held(fetch)

    def fetch_pending(self, seq: Sequence) -> bool:
        """Whether the scheduler must hold the waiting sequence back while its blocks are read from a slow tier
        (the fetch starts here, once per wait); False once it is done or past its deadline."""
        held = self.held.get(seq)
        if held is None:
            pairs = self.block_manager.blocks_past_memory(seq)
            keys = self.tiers.slow_keys([tier_key(group, block_hash) for group, block_hash in pairs])
            fetch = self.worker.submit(keys) if keys else None
            if fetch is None:
                return False
            held = self.held[seq] = _Held(fetch)
        if held.released:
            return False
        now = time.monotonic()
        if not held.fetch.settled(now):
            held.since = held.since if held.since is not None else now
            return True
        held.released = True
        if not held.fetch.done.is_set():
            self.fetch_timeouts += 1
        so_far, fetch = seq.request.kv_fetch or KVFetchStats(), held.fetch
        waited = now - held.since if held.since is not None else 0.0
        seq.request.kv_fetch = KVFetchStats(
            so_far.seconds + waited, so_far.blocks + fetch.blocks, so_far.bytes + fetch.bytes
        )
        return False

    def wait_for_fetches(self, timeout: float) -> None:
        """Nothing to run but sequences held back for their fetches: give the worker up to timeout seconds."""
        pending = [h.fetch for h in self.held.values() if not h.released and not h.fetch.done.is_set()]
        if pending:
            pending[0].done.wait(max(0.0, min(timeout, pending[0].deadline - time.monotonic())))

    def forget(self, seq: Sequence) -> None:
        """The sequence was admitted or finished (aborted, maybe): its fetch is cancelled, what is still staged for
        it dropped."""
        held = self.held.pop(seq, None)
        if held is not None:
            self.tiers.cancel(held.fetch)

    def _load(self, loads: dict[int, torch.Tensor]) -> None:
        caches = self.runner.cache_tensors
        index = torch.tensor(list(loads), dtype=torch.long, device=caches[0].device)
        kv = torch.stack(list(loads.values())).to(caches[0].device)  # [n, layers, planes, block_size, heads, dim]
        for layer, cache in enumerate(caches):
            cache[:, index] = kv[:, layer].transpose(0, 1).to(cache.dtype)

    def stats(self) -> dict[str, dict]:
        out = self.tiers.stats()
        out["all"]["loaded_blocks"] = self.loaded_blocks
        out["all"]["store_seconds"] = self.store_seconds
        out["all"]["fetches"] = self.worker.submitted
        out["all"]["fetch_timeouts"] = self.fetch_timeouts
        out["all"]["fetches_refused"] = self.worker.refused
        return out

    def close(self) -> None:
        self.worker.close()
        self.tiers.close()
