"""Which layers share a block table: the KV groups of a model whose layers have different windows. No torch here.

A model whose layers all see the same positions (every layer global, or every layer with the same window) has one
group: one block table per sequence, one block id = one block of every layer's cache, as always.

A model that mixes windows (Gemma 3: five local layers of window 512 per global one) splits its layers into groups
of layers with the same window, each group with its own block table per sequence. A sliding group's table gives
back the blocks behind its window (BlockManager.free_behind_window) while a global group keeps them all, so a long
sequence holds about window / block_size blocks in each sliding group instead of one per block of context.

All groups draw block ids from one shared pool, so the ids must cost the same memory whatever group holds them:
every group has the same number of layers, `layers_per_block` (the size of the smallest window kind; a kind whose
layer count is not a multiple of it has a last group padded with unused cache slots). The cache is then
`layers_per_block` tensors of [2, num_blocks, ...]: the i-th layer of any group reads and writes tensor i at its
group's block ids. Gemma 3 270M (3 global, 15 local layers) gets 1 global group and 5 local groups of 3 layers; a
block id costs 3 layers' KV instead of 18, so the same memory holds 6x the block ids, and a sequence of L tokens
takes L / block_size of them in the global group plus about 5 x window / block_size in the local ones.

Why not one group for all local layers? Its block ids would have to cost as much as 15 layers while the global
group's need 3: with one pool either the global ids waste 12 layers of memory each or the pools are split ahead of
time, which strands memory on whichever side the workload needs less.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from petrel.config import EngineConfig
    from petrel.model.config import ModelConfig


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]  # per group: its layers' sliding window (None: global)
    layers: tuple[tuple[int, ...], ...]  # per group: its layers, in model order
    layers_per_block: int  # cache tensors; a block id holds this many layers' KV
    sink_tokens: int = 0  # the first positions a windowed group keeps (attention sinks: attention_windows.py)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def group_of(self, layer: int) -> int:
        return next(g for g, layers in enumerate(self.layers) if layer in layers)

    def slot_of(self, layer: int) -> int:
        """Which of the layers_per_block cache tensors this layer uses (its place in its group)."""
        return self.layers[self.group_of(layer)].index(layer)


def single_group(num_layers: int, window: int | None, sink_tokens: int = 0) -> KVGroups:
    """Every layer in one table (no window, a uniform window, or a model whose mixed windows are not split)."""
    return KVGroups((window,), (tuple(range(num_layers)),), num_layers, sink_tokens if window is not None else 0)


def split_by_window(windows: list[int | None], num_layers: int, sink_tokens: int = 0) -> KVGroups:
    """The groups of a model with per-layer windows (empty: no window anywhere): global layers first."""
    if not windows or len(set(windows)) == 1:
        return single_group(num_layers, windows[0] if windows else None, sink_tokens)
    kinds: dict[int | None, list[int]] = {}
    for kind in sorted(set(windows), key=lambda w: (w is not None, w or 0)):  # global first, then by window
        kinds[kind] = [layer for layer, w in enumerate(windows) if w == kind]
    size = min(len(layers) for layers in kinds.values())
    group_windows, group_layers = [], []
    for kind, layers in kinds.items():
        for i in range(0, len(layers), size):
            group_windows.append(kind)
            group_layers.append(tuple(layers[i : i + size]))
    return KVGroups(tuple(group_windows), tuple(group_layers), size, sink_tokens)


def kv_groups_for(config: EngineConfig, model_config: ModelConfig) -> tuple[KVGroups, str | None]:
    """How an engine (EngineConfig) lays out a model's KV (ModelConfig), and a line saying so for the log. Every
    tensor-parallel rank calls this with the same arguments, so all ranks index their caches alike."""
    layers, windows = model_config.num_hidden_layers, model_config.sliding_windows
    if not any(w is not None for w in windows):
        return single_group(layers, None), None
    spec = config.speculative_config  # a SpeculativeConfig once EngineConfig is made (never the dict it may take)
    if spec is not None and not isinstance(spec, dict) and spec.method == "draft_model":
        # the draft model reads the same block tables, from its own (lagging) position, maybe without a window
        return single_group(layers, None), (
            "sliding-window layers, but a draft model shares the block tables: every KV block is kept"
        )
    sinks = model_config.attention_sinks
    kept = f", but for the attention sinks' blocks (the first {sinks} positions)" if sinks else ""
    window = model_config.uniform_sliding_window
    if window is not None:
        return single_group(
            layers, window, sinks
        ), f"sliding window {window} on every layer: KV blocks behind it are given back{kept}"
    groups = split_by_window(windows, layers, sinks)
    return groups, (
        f"sliding-window layers mixed with global ones: {groups.num_groups} KV groups of "
        f"{groups.layers_per_block} layers (windows {list(groups.windows)}); the sliding groups give "
        f"back blocks behind their window{kept}"
    )
