"""A prompt's K/V out of the paged cache, and into freshly allocated blocks: what disaggregated serving moves
between instances (petrel/disagg), read and written on the engine's side.

The transferred form is block-free: one tensor [layers, planes, tokens, heads, width] (planes 2, key and value, per
KV head; a latent cache's one row a token: petrel/model/kv_layout.py), so the two instances may use different block
sizes. Each layer's cache is [planes, num_blocks, block_size, heads, width]; viewed as [planes, num_blocks *
block_size, ...] a position's row is its slot.
A model with several KV groups (petrel/engine/kv_groups.py) passes one block table per layer (its group's).
"""

from __future__ import annotations

import torch

from petrel.engine.block_manager import num_freed_blocks


def _slots(block_table: list[int], start: int, num_tokens: int, block_size: int, device) -> torch.Tensor:
    return torch.tensor(
        [block_table[p // block_size] * block_size + p % block_size for p in range(start, num_tokens)],
        dtype=torch.long,
        device=device,
    )


def _first_held_position(block_table: list[int], num_tokens: int, block_size: int) -> int:
    """Positions before this one lie in blocks given back behind a sliding window (FREED entries)."""
    return min(num_freed_blocks(block_table) * block_size, num_tokens)


def _flat(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(cache.shape[0], -1, *cache.shape[3:])


def _layer_tables(kv_caches: list[torch.Tensor], block_table) -> list[list[int]]:
    """One table for every layer, or already one per layer (a list of tables)."""
    if block_table and isinstance(block_table[0], list):
        return block_table
    return [block_table] * len(kv_caches)


def gather_prompt_kv(kv_caches: list[torch.Tensor], block_table, num_tokens: int) -> torch.Tensor:
    """The K/V of positions 0..num_tokens-1, copied out to the CPU: [layers, planes, tokens, heads, width].
    block_table: the table of every layer, or one table per layer.

    Positions in blocks given back behind a sliding window come out as zeros (the engine keeps a context-only
    prompt whole, so an export normally has none)."""
    block_size = kv_caches[0].shape[2]
    tables = _layer_tables(kv_caches, block_table)
    firsts = [_first_held_position(table, num_tokens, block_size) for table in tables]
    slots = {}  # the slots of each distinct table, computed once
    for table, first in zip(tables, firsts):
        if id(table) not in slots:
            slots[id(table)] = _slots(table, first, num_tokens, block_size, kv_caches[0].device)
    if not any(firsts):
        return torch.stack([_flat(cache)[:, slots[id(t)]] for cache, t in zip(kv_caches, tables)]).cpu()
    planes = kv_caches[0].shape[0]
    kv = torch.zeros(len(kv_caches), planes, num_tokens, *kv_caches[0].shape[3:], dtype=kv_caches[0].dtype)
    for layer, (cache, table, first) in enumerate(zip(kv_caches, tables, firsts)):
        kv[layer, :, first:] = _flat(cache)[:, slots[id(table)]].cpu()
    return kv


def scatter_prompt_kv(kv_caches: list[torch.Tensor], block_table, kv: torch.Tensor) -> None:
    """Write gather_prompt_kv's tensor into the blocks of block_table (positions 0..tokens-1): the table of every
    layer, or one table per layer."""
    cache = kv_caches[0]
    if (
        kv.dim() != 5
        or kv.shape[0] != len(kv_caches)
        or kv.shape[1] != cache.shape[0]
        or kv.shape[3:] != cache.shape[3:]
    ):
        raise ValueError(
            f"the transferred KV has shape {list(kv.shape)}, which does not fit this model's cache "
            f"({len(kv_caches)} layers x {cache.shape[0]} planes x {list(cache.shape[3:])})"
        )
    block_size = kv_caches[0].shape[2]
    for cache, table, layer in zip(kv_caches, _layer_tables(kv_caches, block_table), kv):
        first = _first_held_position(table, kv.shape[2], block_size)  # 0 for freshly allocated blocks
        slots = _slots(table, first, kv.shape[2], block_size, cache.device)
        _flat(cache)[:, slots] = layer[:, first:].to(device=cache.device, dtype=cache.dtype)


def write_imported_kv(runner, seq) -> None:
    """Before a generation-only sequence's first step: the prompt KV it brought (fetched by the front) into its
    new blocks, through each layer's table (runner.layer_tables); the request lets go of the tensor."""
    scatter_prompt_kv(runner.kv_caches, runner.layer_tables(seq.block_tables), seq.request.imported_kv)
    seq.request.imported_kv = None
