"""paged_prefill_attention: a batch of prompt chunks (varlen), each chunk's queries against its cached prefix and
itself, causal, with K/V read in place through the block table (after write_kv put the chunk's own there).

A chunk of n queries in a context of length L holds positions L-n .. L-1; a whole prompt is the case L == n.
A program takes one chunk, one query head and a tile of BLOCK_M queries, and walks the keys that tile can see in
tiles of BLOCK_N with an online softmax (float32). With a sliding window W the query at position p sees keys
p-W+1 .. p: the walk starts at the tile holding the first query's first visible key, and keys behind it are never
read, so blocks given back behind the window may hold anything. Sink logits (a learned logit per query head in its
softmax, with no value: gpt-oss's) join the sum at the end.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from petrel.model.triton_attention.checks import check_cache, check_index, check_queries
from petrel.model.triton_attention.decode import _sinks


@triton.jit
def _prefill_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    query_start_ptr,
    context_lens_ptr,
    out_ptr,
    sinks_ptr,  # [heads] float32, each head's sink logit (read with HAS_SINKS only)
    scale_log2,  # the softmax scale times log2(e): scores in base 2
    window,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table,
    block_size,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    SLIDING: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq, head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_ptr + seq + 1).to(tl.int32) - q_start
    if tile * BLOCK_M >= q_len:
        return
    length = tl.load(context_lens_ptr + seq).to(tl.int32)
    first_pos = length - q_len
    kv_head = head // GROUP
    offsets = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok, dim_ok = offsets < q_len, dims < HEAD_DIM
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q_rows = (q_start + offsets).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_q_token + head * stride_q_head + dims[None, :], mask=q_mask, other=0.0)
    q_pos = first_pos + tl.minimum(offsets, q_len - 1)  # rows past the chunk repeat its last query (not stored)
    hi = first_pos + tl.minimum(tile * BLOCK_M + BLOCK_M, q_len)  # one past the tile's last query
    first = 0  # the first key any query of the tile sees
    if SLIDING:
        first = tl.maximum(first_pos + tile * BLOCK_M - window + 1, 0)

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(first // BLOCK_N * BLOCK_N, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        readable = (pos >= first) & (pos < hi)
        block = tl.load(block_tables_ptr + seq * stride_table + pos // block_size, mask=readable, other=0)
        slots = block.to(tl.int64) * stride_cache_block + (pos % block_size) * stride_cache_slot
        kv_offsets = slots[:, None] + kv_head * stride_cache_head + dims[None, :]
        kv_mask = readable[:, None] & dim_ok[None, :]
        k = tl.load(key_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        visible = pos[None, :] <= q_pos[:, None]
        if SLIDING:
            visible &= pos[None, :] > q_pos[:, None] - window
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        shift = tl.where(new_max > float("-inf"), new_max, 0.0)  # a row that has seen no key yet
        p = tl.exp2(scores - shift[:, None])
        correction = tl.exp2(running_max - shift)
        running_sum = running_sum * correction + tl.sum(p, 1)
        v = tl.load(value_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        running_max = new_max

    if HAS_SINKS:  # the sink's weight 2^(sink - max) joins the sum, the max moved to cover it
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634
        top = tl.maximum(running_max, sink)
        keys = tl.exp2(running_max - top)
        acc = acc * keys[:, None]
        running_sum = running_sum * keys + tl.exp2(sink - top)
    out = acc / running_sum[:, None]  # each query sees at least itself
    out_offsets = q_rows[:, None] * stride_out_token + head * stride_out_head + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [tokens, heads, head_dim]: the chunks' queries back to back, chunk s in rows query_start_loc[s] ..
    query_start_loc[s+1]-1; key_cache, value_cache [num_blocks, block_size, kv_heads, head_dim]; block_tables
    [chunks, max_blocks], query_start_loc [chunks + 1] and context_lens [chunks] (tokens in the cache after this
    step, the chunk's own included) int32 or int64. Returns [tokens, heads, head_dim] in q's dtype; rows no chunk
    covers are left unwritten.

    max_query_len: the longest chunk, when the caller knows it (the grid is sized by it; default: all the rows).
    sink_logits: [heads], each head's logit joining its softmax, or None."""
    check_cache(key_cache, value_cache)
    check_queries(q, key_cache, "[tokens, heads, head_dim]")
    tokens, heads, head_dim = q.shape
    chunks = block_tables.shape[0] if block_tables.dim() == 2 else -1
    check_index(block_tables, "block_tables", (None, None), q.device)
    check_index(query_start_loc, "query_start_loc", (chunks + 1,), q.device)
    check_index(context_lens, "context_lens", (chunks,), q.device)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    sinks = _sinks(sink_logits, heads, q.device)
    out = torch.empty(tokens, heads, head_dim, dtype=q.dtype, device=q.device)
    if tokens == 0 or chunks == 0:
        return out
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m = 64 if block_d <= 128 else 32
    block_n = 64 if block_d <= 64 else 32
    tiles = math.ceil((max_query_len or tokens) / block_m)
    _prefill_kernel[(chunks, heads, tiles)](
        q,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        context_lens,
        out,
        sinks,
        scale * math.log2(math.e),
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        block_size,
        GROUP=heads // kv_heads,
        HEAD_DIM=head_dim,
        SLIDING=sliding_window is not None,
        HAS_SINKS=sink_logits is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        PRECISION="ieee" if q.dtype == torch.float32 else None,  # float32: no TF32 rounding
    )
    return out
