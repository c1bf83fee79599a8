"""The KV cache's size, decided once at start-up: how the layers share block tables (the KV groups), how many
blocks the memory budget buys, and the longest sequence (max_model_len) the engine then serves."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from petrel.config import EngineConfig, kv_cache_budget
from petrel.engine.kv_groups import KVGroups, kv_groups_for
from petrel.engine.model_runner import num_kv_blocks
from petrel.model.config import ModelConfig

logger = logging.getLogger("petrel")


@dataclass(frozen=True)
class KVCapacity:
    kv_groups: KVGroups
    num_blocks: int
    max_model_len: int


def plan_kv_cache(config: EngineConfig, model_config: ModelConfig) -> KVCapacity:
    """ValueError when the budget holds fewer than 2 blocks or max_model_len passes the model's context; a
    max_model_len longer than the cache can hold is lowered to what it holds (with a warning)."""
    groups = kv_groups_of(config, model_config)
    bs = config.block_size
    num_blocks = num_kv_blocks(config, model_config, groups.layers_per_block)
    if num_blocks < 2:
        raise ValueError(f"kv_cache_memory={kv_cache_budget(config)} bytes holds fewer than 2 blocks of {bs} tokens")
    model_len = config.max_model_len or model_config.max_position_embeddings
    if model_len > model_config.max_position_embeddings:
        raise ValueError(
            f"max_model_len {model_len} exceeds the model's context length {model_config.max_position_embeddings}"
        )
    held = max_tokens_held(groups.windows, num_blocks, bs, config.max_num_batched_tokens, groups.sink_tokens)
    if held is not None and model_len > held:
        logger.warning("max_model_len %d lowered to %d: the KV cache holds no more", model_len, held)
        model_len = held
    return KVCapacity(groups, num_blocks, model_len)


def kv_groups_of(config: EngineConfig, model_config: ModelConfig) -> KVGroups:
    """How the layers share block tables (petrel/engine/kv_groups.py): one table, freeing behind a uniform
    window; or, with sliding-window layers mixed with global ones, one table per group of same-window layers."""
    groups, why = kv_groups_for(config, model_config)
    if why:
        logger.info(why)
    return groups


def max_tokens_held(
    windows, num_blocks: int, block_size: int, max_batched_tokens: int, sink_tokens: int = 0
) -> int | None:
    """The longest sequence a cache of num_blocks holds alone (None: any length), given each KV group's window.
    A sliding group holds about its window plus one step's tokens at most (and its attention sinks' blocks),
    whatever the sequence's length."""
    sinks = -(-sink_tokens // block_size)
    per_window = [None if w is None else -(-(w + max_batched_tokens) // block_size) + 2 + sinks for w in windows]
    if None not in per_window:
        return None if sum(per_window) <= num_blocks else num_blocks // len(windows) * block_size

    def blocks(n: int) -> int:  # what a sequence of n blocks holds over all groups
        return sum(n if cap is None else min(n, cap) for cap in per_window)

    lo, hi = 0, num_blocks  # the most blocks n with blocks(n) <= num_blocks (blocks(n) >= n)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if blocks(mid) <= num_blocks else (lo, mid - 1)
    return lo * block_size
