"""A step of paged attention in Triton (attention.paged_attention hands it over on CUDA): this step's K/V written
into the cache, each decode group in one decode call, all prefill chunks in one varlen prefill call."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from petrel.model.triton_attention.decode import paged_decode_attention
from petrel.model.triton_attention.kv_write import write_kv
from petrel.model.triton_attention.prefill import paged_prefill_attention

if TYPE_CHECKING:
    from petrel.model.attention import AttentionMetadata


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """As attention.paged_attention: q [T, heads, d], k, v [T, kv_heads, d]; returns [T, heads, d]."""
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    write_kv(key_cache, value_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    for g in meta.decode_groups:
        out[g.start : g.end] = paged_decode_attention(
            q[g.start : g.end],
            key_cache,
            value_cache,
            g.block_tables,
            g.context_lens_t,
            scale,
            sliding_window,
            sink_logits=sink_logits,
        )
    if meta.prefills:
        if "triton_prefill" not in meta.kernel_inputs:
            meta.kernel_inputs["triton_prefill"] = _varlen_batch(meta)
        rows, tables, query_start_loc, context_lens, max_query_len = meta.kernel_inputs["triton_prefill"]
        out[rows] = paged_prefill_attention(
            q[rows],
            key_cache,
            value_cache,
            tables,
            query_start_loc,
            context_lens,
            scale,
            sliding_window,
            max_query_len,
            sink_logits,
        )
    return out


def _varlen_batch(meta: AttentionMetadata) -> tuple:
    """The prefill chunks (consecutive rows of the batch) as one varlen batch: (their rows, block tables padded with
    block 0, query_start_loc, context_lens, the longest chunk); built once a step, shared by the layers."""
    chunks = meta.prefills
    device = chunks[0].block_table.device
    first, end = chunks[0].start, chunks[-1].start + chunks[-1].num_tokens
    tables = torch.nn.utils.rnn.pad_sequence([c.block_table for c in chunks], batch_first=True)
    starts = [c.start - first for c in chunks] + [end - first]
    query_start_loc = torch.tensor(starts, dtype=torch.int64, device=device)
    context_lens = torch.tensor([c.context_len for c in chunks], dtype=torch.int64, device=device)
    return slice(first, end), tables, query_start_loc, context_lens, max(c.num_tokens for c in chunks)
