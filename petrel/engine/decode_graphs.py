"""CUDA graphs for decode steps: the model's decode forward and LM head captured once per batch size, replayed.

A decode step of a small model on a GPU is mostly kernel launches (a few hundred per step); a CUDA graph issues
them all as one. A graph replays fixed shapes at fixed addresses, so each captured batch size owns static input
buffers (token ids, positions, cache slots, context lengths, block tables [size, max_blocks]): a step copies its
rows into the buffers of the smallest captured size that holds it, replays, and takes its rows' logits.

Padded rows must touch no sequence's KV: each writes its key and value to a scratch slot (the first of a cache
block the block manager never hands out, `scratch_block`) and attends to that one key (context length 1, block
table [scratch_block, 0, ...]). That is harmless for every attention path (the CPU kernels, PyTorch's, Triton's),
so the padding runs the same on CPU, where the class runs eager (no capture: `capture=False`) for the tests.

Only the columns of the block tables the step uses are copied; later columns keep earlier steps' block ids, which
lie beyond every row's context length and are never read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from petrel.model.attention import AttentionMetadata, DecodeGroup

logger = logging.getLogger("petrel")

HEAD_ROWS = 4  # token ids, positions, slots, context lengths: one [4, size] block, copied in one transfer


def default_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (and max_num_seqs itself): little padding, few graphs."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def batch_sizes_of(config) -> list[int]:
    """The decode batch sizes an EngineConfig asks to capture (none with enforce_eager)."""
    if config.enforce_eager:
        return []
    return sorted(set(config.cuda_graph_batch_sizes or default_batch_sizes(config.max_num_seqs)))


def graphs_supported(device: torch.device) -> bool:
    """Whether decode attention on `device` can run inside a graph: the Triton kernels (petrel.model.triton_attention)
    read each row's context length on the device; PyTorch's decode path reads it on the host."""
    try:
        from petrel.model import triton_attention
    except ImportError:
        return False
    return device.type == "cuda" and triton_attention.available(device)


@dataclass
class _Slot:
    """One captured batch size: its static inputs (views of one buffer), and on CUDA its graph and output."""

    size: int
    head: torch.Tensor  # [4, size]: token ids, positions, slots, context lengths
    block_tables: torch.Tensor  # [size, max_blocks]
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # [size, vocab], written by each replay


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        batch_sizes: list[int],
        max_blocks: int,
        scratch_block: int,
        capture: bool,
    ):
        """kv_caches: the layers' caches (one KV group); max_blocks: the widest block table a sequence has;
        scratch_block: a cache block no sequence uses (padded rows write there); capture: CUDA graphs (else eager)."""
        self.model, self.kv_caches = model, kv_caches
        self.max_blocks, self.scratch_block = max_blocks, scratch_block
        self.block_size = kv_caches[0].shape[2]
        device = kv_caches[0].device
        self.slots = [self._new_slot(size, device) for size in sorted(set(batch_sizes))]
        if capture:
            pool = torch.cuda.graph_pool_handle()
            for slot in reversed(self.slots):  # largest first: the smaller graphs reuse its memory
                self._capture(slot, pool)

    @property
    def max_batch_size(self) -> int:
        return self.slots[-1].size

    def _new_slot(self, size: int, device: torch.device) -> _Slot:
        buffer = torch.zeros(HEAD_ROWS * size + size * self.max_blocks, dtype=torch.long, device=device)
        slot = _Slot(size, buffer[: HEAD_ROWS * size].view(HEAD_ROWS, size), buffer[HEAD_ROWS * size :].view(size, -1))
        slot.head[2] = self.scratch_block * self.block_size  # all rows padding until a step fills them
        slot.head[3] = 1
        slot.block_tables[:, 0] = self.scratch_block
        return slot

    def _forward(self, slot: _Slot, context_lens: list[int]) -> torch.Tensor:
        ids, positions, slots, lens = slot.head
        width = self.max_blocks * self.block_size
        mask = torch.arange(width, device=lens.device).unsqueeze(0) < lens.unsqueeze(1)
        group = DecodeGroup(0, slot.size, slot.block_tables, mask, context_lens, lens)
        meta = AttentionMetadata(slot_mapping=slots, decode_groups=[group])
        return self.model.compute_logits(self.model(ids, positions, self.kv_caches, meta))

    @torch.inference_mode()
    def _capture(self, slot: _Slot, pool) -> None:
        """Warm up (Triton compiles its kernels) on a side stream, then capture the padded forward."""
        lens = [1] * slot.size
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(slot, lens)
        torch.cuda.current_stream().wait_stream(stream)
        slot.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(slot.graph, pool=pool):
            slot.logits = self._forward(slot, lens)

    def fits(self, num_rows: int, width: int) -> bool:
        """Whether a step of num_rows decodes whose widest block table has `width` blocks can replay."""
        return num_rows <= self.max_batch_size and width <= self.max_blocks

    @torch.inference_mode()
    def run(
        self,
        token_ids: list[int],
        positions: list[int],
        slots: list[int],
        block_tables: list[list[int]],
        context_lens: list[int],
    ) -> torch.Tensor:
        """Logits [rows, vocab] (float32) of one decode token per row; `fits` must hold. Each row's new key and
        value go to its slot; it attends to its first context_len cached positions through its block table."""
        rows = len(token_ids)
        slot = next(s for s in self.slots if s.size >= rows)
        pad = slot.size - rows
        scratch = self.scratch_block
        context_lens = context_lens + [1] * pad
        head = [token_ids + [0] * pad, positions + [0] * pad, slots + [scratch * self.block_size] * pad, context_lens]
        slot.head.copy_(torch.tensor(head), non_blocking=True)
        width = max(len(t) for t in block_tables)
        tables = [t + [0] * (width - len(t)) for t in block_tables] + [[scratch] + [0] * (width - 1)] * pad
        slot.block_tables[:, :width].copy_(torch.tensor(tables), non_blocking=True)
        if slot.graph is None:
            return self._forward(slot, context_lens)[:rows]
        slot.graph.replay()
        return slot.logits[:rows].clone()  # the next replay overwrites the output


def capture_decode_graphs(model, kv_caches, batch_sizes, max_blocks, scratch_block) -> DecodeGraphs | None:
    """DecodeGraphs captured on CUDA, or None (with a warning) when capture fails: decode steps then run eager."""
    try:
        return DecodeGraphs(model, kv_caches, batch_sizes, max_blocks, scratch_block, capture=True)
    except RuntimeError as exc:
        logger.warning("decode steps run without CUDA graphs: capturing them failed (%s)", exc)
        return None
