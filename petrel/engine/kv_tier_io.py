"""The engine's side of the lower KV tiers (petrel/kv_tiers): the block manager decides, this moves the rows.

Right after scheduling, before anything writes the KV cache this step (imported KV, drafts, the forward pass):
1. the cached blocks the block manager evicted for reuse (pending_evictions) are copied out of the runner's cache
   tensors and stored in the tiers (their rows are still intact: only the runner writes the cache, and it has not
   run yet);
2. the blocks computed since the last step (pending_publishes, only with a shared store) are copied out and handed
   to the store (its puts are asynchronous);
3. the blocks allocated for tier hits (pending_loads, checked when the prefix was matched) get their KV written.
A request with a dkv_cache_hint has the hinted blocks of its own chain fetched from the shared store in one round
trip when it arrives (prefetch_hint), so its admission finds them ready.
All of it runs on the engine thread: a first slice, bounded by the blocks one schedule moves (a host-tier copy is a
memcpy and a CRC-32; a disk-tier read or write is one file per block).
"""

from __future__ import annotations

import time

import torch

from petrel.kv_tiers.block_codec import BlockLayout, dtype_name, model_fingerprint
from petrel.kv_tiers.chain import TierChain, build_tiers
from petrel.kv_tiers.dkv_hint import plan_hinted_fetch
from petrel.kv_tiers.redis_store import store_from_config


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
    )
    disk_bytes = config.kv_disk_tier_bytes
    # one namespace per model in the shared store: chain hashes carry no model, and two models must not overwrite
    # each other's blocks (the codec's check would refuse them anyway)
    shared = store_from_config(config, namespace=f"petrel:kv:{fingerprint[:16]}")
    tiers = build_tiers(layout, config.kv_host_tier_bytes, config.kv_disk_tier_path, disk_bytes, shared)
    io = KVTierIO(runner, tiers)
    block_manager.tier_fetch = tiers.fetch
    block_manager.publish_computed = shared is not None
    return io


class KVTierIO:
    def __init__(self, runner, tiers: TierChain):
        self.runner = runner
        self.tiers = tiers
        self.store_seconds = 0.0  # copying evicted blocks out and storing them
        self.step_loaded = 0  # this step's blocks written from the tiers, and stored into them
        self.step_stored = 0
        self.loaded_blocks = 0  # blocks written from the tiers into the KV cache, since start

    def drain(self, block_manager) -> None:
        """Move this schedule's evicted blocks down and its tier hits in (see the module's doc)."""
        evictions, block_manager.pending_evictions = block_manager.pending_evictions, []
        loads, block_manager.pending_loads = block_manager.pending_loads, {}
        publishes, block_manager.pending_publishes = block_manager.pending_publishes, []
        self.step_loaded, self.step_stored = len(loads), len(evictions)
        self.loaded_blocks += len(loads)
        if evictions or publishes:
            t0 = time.perf_counter()
            self._copy_out(evictions, self.tiers.store)
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
                self.tiers.fetch_seconds += time.perf_counter() - t0

    def _copy_out(self, blocks: list[tuple[int, int, bytes, tuple]], keep) -> None:
        """keep(group, hash, tokens, KV) for each listed (block, group, hash, tokens), its rows copied out."""
        if not blocks:
            return
        caches = self.runner.cache_tensors
        index = torch.tensor([block for block, *_ in blocks], dtype=torch.long, device=caches[0].device)
        rows = torch.stack([cache[:, index] for cache in caches]).cpu()  # [layers, 2, n, block_size, heads, dim]
        for j, (_, group, block_hash, tokens) in enumerate(blocks):
            keep(group, block_hash, tokens, rows[:, :, j])

    def prefetch_hint(self, block_manager, seq, request) -> None:
        """Fetch the hinted blocks of the request's own hash chain from the shared store ahead of its admission; a
        hinted hash outside the chain is ignored and counted (a hint is never trusted)."""
        if not (request.kv_hint_keys or request.kv_hint_tokens):
            return
        chain = block_manager.prompt_block_hashes(seq)
        hinted_blocks = request.kv_hint_tokens // block_manager.block_size
        keys, ignored = plan_hinted_fetch(chain, request.kv_hint_keys, hinted_blocks)
        self.tiers.prefetch(keys, ignored)

    def _load(self, loads: dict[int, torch.Tensor]) -> None:
        caches = self.runner.cache_tensors
        index = torch.tensor(list(loads), dtype=torch.long, device=caches[0].device)
        kv = torch.stack(list(loads.values())).to(caches[0].device)  # [n, layers, 2, block_size, heads, dim]
        for layer, cache in enumerate(caches):
            cache[:, index] = kv[:, layer].transpose(0, 1).to(cache.dtype)

    def stats(self) -> dict[str, dict]:
        out = self.tiers.stats()
        out["all"]["loaded_blocks"] = self.loaded_blocks
        out["all"]["store_seconds"] = self.store_seconds
        return out

    def close(self) -> None:
        self.tiers.close()
