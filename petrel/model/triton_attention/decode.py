"""paged_decode_attention: one query token per sequence against its paged K/V, read in place through the block table.

A program takes one sequence, one KV head and one split of the context: the query heads that share the KV head
(GQA) are the rows of one tile, so each key is read once for all of them. It walks its split in tiles of keys with
an online softmax (running max and sum, float32). A long context with few sequences is cut into several splits
run side by side; each writes its unnormalized partial result with its max and sum, and a reduce kernel weighs
them together. With a sliding window W the row of context length L sees keys L-W .. L-1 only: the splits cover
that span, so keys behind the window are never read; rows of length 0 (padding) come out as zeros. Sink logits
(gpt-oss's: a learned logit per query head in its softmax, with no value) join the sum at the end: in the program's
normalization, or in the reduce kernel's when the context is split.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from petrel.model.triton_attention.checks import check_cache, check_index, check_queries

_MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more in the reduce than it saves
_MAX_SPLITS = 16
_BUSY_PROGRAMS = 256  # (sequence, KV head) programs that already fill a large GPU without splitting


@triton.jit
def _decode_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,  # [seqs, heads, HEAD_DIM], or with splits the partial sums [seqs, heads, NUM_SPLITS, HEAD_DIM] float32
    max_ptr,  # with splits: [seqs, heads, NUM_SPLITS] float32, each split's score max (log2 units)
    sum_ptr,  # with splits: the same, each split's sum of exponentials
    sinks_ptr,  # [heads] float32, each head's sink logit (read with HAS_SINKS only)
    scale_log2,  # the softmax scale times log2(e): scores in base 2
    window,
    split_len,  # keys per split, a multiple of BLOCK_N
    num_heads,
    stride_q_seq,
    stride_q_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table,
    block_size,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    SLIDING: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, BLOCK_D)
    row_ok, dim_ok = rows < GROUP, dims < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    length = tl.load(context_lens_ptr + seq).to(tl.int32)
    first = 0
    if SLIDING:
        first = tl.maximum(length - window, 0)
    lo = first // BLOCK_N * BLOCK_N + split * split_len
    hi = tl.minimum(lo + split_len, length)

    running_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        visible = (pos >= first) & (pos < length)  # every tile holds at least one visible key
        block = tl.load(block_tables_ptr + seq * stride_table + pos // block_size, mask=visible, other=0)
        slots = block.to(tl.int64) * stride_cache_block + (pos % block_size) * stride_cache_slot
        offsets = slots[:, None] + kv_head * stride_cache_head + dims[None, :]
        kv_mask = visible[:, None] & dim_ok[None, :]
        k = tl.load(key_cache_ptr + offsets, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        scores = tl.where(visible[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        p = tl.exp2(scores - new_max[:, None])
        correction = tl.exp2(running_max - new_max)
        running_sum = running_sum * correction + tl.sum(p, 1)
        v = tl.load(value_cache_ptr + offsets, mask=kv_mask, other=0.0)
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        running_max = new_max

    out_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        if HAS_SINKS:  # the sink's weight 2^(sink - max) joins the sum, the max moved to cover it
            sink = tl.load(sinks_ptr + heads, mask=row_ok, other=float("-inf")) * 1.4426950408889634
            top = tl.maximum(running_max, sink)
            top = tl.where(top > float("-inf"), top, 0.0)
            keys = tl.exp2(running_max - top)
            acc = acc * keys[:, None]
            running_sum = running_sum * keys + tl.exp2(sink - top)
        out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
        out_rows = seq * num_heads + heads
        tl.store(out_ptr + out_rows[:, None] * HEAD_DIM + dims[None, :], out.to(out_ptr.dtype.element_ty), out_mask)
    else:
        part = (seq * num_heads + heads) * NUM_SPLITS + split
        tl.store(max_ptr + part, running_max, mask=row_ok)
        tl.store(sum_ptr + part, running_sum, mask=row_ok)
        tl.store(out_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=out_mask)


@triton.jit
def _reduce_kernel(
    partial_ptr,
    max_ptr,
    sum_ptr,
    sinks_ptr,
    out_ptr,
    num_heads,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)  # seq * heads + head
    splits, dims = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    split_ok, dim_ok = splits < NUM_SPLITS, dims < HEAD_DIM
    parts = row * NUM_SPLITS + splits
    maxes = tl.load(max_ptr + parts, mask=split_ok, other=float("-inf"))
    sums = tl.load(sum_ptr + parts, mask=split_ok, other=0.0)
    top = tl.max(maxes, 0)
    sink = float("-inf")
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + row % num_heads) * 1.4426950408889634
        top = tl.maximum(top, sink)
    shift = tl.where(top > float("-inf"), top, 0.0)
    weights = tl.exp2(maxes - shift)  # an empty split (max -inf) weighs 0
    partial = tl.load(
        partial_ptr + parts[:, None] * HEAD_DIM + dims[None, :], mask=split_ok[:, None] & dim_ok[None, :], other=0.0
    )
    total = tl.sum(weights * sums, 0)
    if HAS_SINKS:
        total += tl.exp2(sink - shift)
    out = tl.sum(weights[:, None] * partial, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def paged_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [seqs, heads, head_dim] (the one query of each sequence, at position context_len - 1); key_cache,
    value_cache [num_blocks, block_size, kv_heads, head_dim]; block_tables [seqs, max_blocks] and context_lens
    [seqs] int32 or int64; sink_logits [heads] (any float dtype) or None. Returns [seqs, heads, head_dim] in q's
    dtype.

    num_splits: how many parts each context is cut into; by default as many as fill the GPU, given the table width
    (the longest context the tables can hold, known without reading context_lens back from the device)."""
    check_cache(key_cache, value_cache)
    check_queries(q, key_cache, "[seqs, heads, head_dim]")
    seqs, heads, head_dim = q.shape
    check_index(block_tables, "block_tables", (seqs, None), q.device)
    check_index(context_lens, "context_lens", (seqs,), q.device)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    sinks = _sinks(sink_logits, heads, q.device)
    out = torch.empty(seqs, heads, head_dim, dtype=q.dtype, device=q.device)
    if seqs == 0:
        return out
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = 64 if block_d <= 128 else 32
    span = block_tables.shape[1] * block_size  # the most keys a row can have
    if sliding_window is not None:
        span = min(span, sliding_window + block_n)  # the window, from the tile holding its first key
    if num_splits is None:
        num_splits = _default_splits(seqs * kv_heads, span)
    split_len = math.ceil(math.ceil(span / num_splits) / block_n) * block_n
    if num_splits > 1:
        partial = torch.empty(seqs, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        maxes = torch.empty(seqs, heads, num_splits, dtype=torch.float32, device=q.device)
        sums = torch.empty_like(maxes)
    else:
        partial, maxes, sums = out, out, out  # the kernel writes the result itself (maxes, sums unused)
    _decode_kernel[(seqs, kv_heads, num_splits)](
        q,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        partial,
        maxes,
        sums,
        sinks,
        scale * math.log2(math.e),
        sliding_window or 0,
        split_len,
        heads,
        q.stride(0),
        q.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        block_size,
        GROUP=heads // kv_heads,
        HEAD_DIM=head_dim,
        SLIDING=sliding_window is not None,
        HAS_SINKS=sink_logits is not None,
        NUM_SPLITS=num_splits,
        BLOCK_H=max(16, triton.next_power_of_2(heads // kv_heads)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        PRECISION="ieee" if q.dtype == torch.float32 else None,  # float32: no TF32 rounding
    )
    if num_splits > 1:
        _reduce_kernel[(seqs * heads,)](
            partial,
            maxes,
            sums,
            sinks,
            out,
            heads,
            HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits,
            HAS_SINKS=sink_logits is not None,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
        )
    return out


def _sinks(sink_logits: torch.Tensor | None, heads: int, device: torch.device) -> torch.Tensor:
    """The sink logits as the kernels read them (float32, contiguous), checked; a 1-element stand-in when None."""
    if sink_logits is None:
        return torch.zeros(1, dtype=torch.float32, device=device)
    if tuple(sink_logits.shape) != (heads,) or sink_logits.device != device:
        raise ValueError(f"sink_logits must be [{heads}] on {device}, got {tuple(sink_logits.shape)}")
    return sink_logits.to(torch.float32).contiguous()


def _default_splits(programs: int, span: int) -> int:
    """Splits per context: enough programs to fill the GPU, none shorter than _MIN_SPLIT_TOKENS."""
    if programs >= _BUSY_PROGRAMS:
        return 1
    return max(1, min(_MAX_SPLITS, span // _MIN_SPLIT_TOKENS, math.ceil(_BUSY_PROGRAMS / programs)))
