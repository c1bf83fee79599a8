"""Paged attention over a block-structured KV cache, in portable PyTorch (CPU or any device); on x86-64 CPUs in
float32, decode rows go to petrel's C kernel instead (dense_kernels.decode_attention: blocks read in place), and
on CUDA with Triton installed the whole step goes to petrel/model/triton_attention (PETREL_TRITON=0: not).

A step's tokens arrive as one flat batch. Decode tokens (one query per sequence) come first, sorted by
context length and attended in a few batched calls (groups of similar lengths, so little padding is read);
prefill chunks follow, one call per sequence. Every sequence reads its keys and values through its block
table, so prefix-cache hits, chunked prefill and recomputation after preemption are all the same code path.

Sliding-window attention (Mistral, Phi-3, some Qwen layers): with a window W, the query at position p sees only
the keys at positions p-W+1 .. p. Decode groups and cached prefill chunks skip the leading blocks that no query
of the call can see and mask the rest of the span; a one-shot prefill masks its fresh K/V. When every layer has
the same window, the block manager gives back a running sequence's blocks wholly behind it (free_behind_window)
and the runner points their block-table entries at block 0: a cached prefill chunk never gathers them (they lie
before its first visible block), and a decode group reads them only masked (zero weight) when another row of the
group keeps those columns. With mixed layers (Gemma 3: local and global) each group of layers with one window has
its own block tables (petrel/engine/kv_groups.py) and its own metadata (the model gets one per layer): a sliding
group's tables give back blocks as a uniform window's do, the global group's keep them all.

A chunk may be a tree of speculative drafts (lookahead decoding): its tokens sit at consecutive cache slots but not
at consecutive positions, and each sees the context and its own ancestors only. Its explicit mask (and, under a
window, its positions) take the PyTorch path: the C kernel leaves the chunk to it, and a CUDA step holding one runs
whole in PyTorch instead of Triton.

Attention sinks (StreamingLLM; petrel/engine/attention_windows.py): a windowed layer with S sinks also sees the
first S positions, so the query at p sees keys 0 .. S-1 and p-W+1 .. p. The block manager keeps the sink blocks
and gives back those between them and the window (their table entries point at block 0, as behind a window). The
kernels know windows only: a layer with sinks runs the portable path, reading the sink blocks and the window's.

Sink logits (gpt-oss; not the sinks above): each query head has a learned logit that joins its softmax as one more
score with no value, and is dropped from the output, so the weights of the keys are exp(s_j) / (sum_k exp(s_k) +
exp(sink)) and sum to less than 1. Every path here takes them (sink_logits [heads], float32): the C kernels and the
Triton kernels add exp(sink - max) to the softmax's sum once its running max is known, the PyTorch path computes
the softmax with the extra column. They go with windows and with StreamingLLM's sinks alike.
"""

from __future__ import annotations

import itertools
import math
import mmap
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from petrel.model import dense_kernels, triton_attention


@dataclass
class PrefillChunk:
    start: int  # first row of this chunk in the flat batch
    num_tokens: int  # query tokens in this chunk
    context_len: int  # tokens in the KV cache after this step (cached prefix + this chunk)
    block_table: torch.Tensor  # [num_blocks_of_this_seq] int64
    mask: torch.Tensor | None  # [num_tokens, context_len] bool, None when the chunk is the whole context
    # a draft tree (speculative decoding, petrel/engine/draft_tree.py): its queries' and keys' positions ([num_tokens],
    # [context_len]); its mask is not causal (each draft sees its own ancestors), so only the torch path serves it
    tree_positions: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def first_pos(self) -> int:
        """The position of the chunk's first token (the cached prefix before it)."""
        return self.context_len - self.num_tokens


@dataclass
class DecodeGroup:
    """Decode rows [start, end) of the flat batch, of similar context lengths, attended in one call."""

    start: int
    end: int
    block_tables: torch.Tensor  # [rows, max_blocks] int64, padded with block 0
    mask: torch.Tensor  # [rows, max_blocks * block_size] bool: True where a key is in context
    context_lens: list[int]  # per row: tokens in the KV cache, this step's included
    context_lens_t: torch.Tensor  # the same on the device, int64


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot that receives each new K/V
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    kernel_inputs: dict = field(default_factory=dict)  # what a kernel derives from the above once a step, by name


def per_layer(meta: AttentionMetadata | list[AttentionMetadata]):
    """Each layer's metadata: a model with several KV groups gets a list, one per layer (each layer's group's);
    otherwise every layer shares the one."""
    return meta if isinstance(meta, list) else itertools.repeat(meta)


def new_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    planes: int = 2,
) -> torch.Tensor:
    """One layer's cache: [2 (key, value), num_blocks, block_size, kv_heads, head_dim], all zeros (planes 1: a
    latent cache, petrel/model/kv_layout.py).

    On CPU the memory is an anonymous mapping: the OS hands out zero pages on first write, so the process holds
    only the blocks it has used (torch.zeros would touch the whole budget up front)."""
    shape = (planes, num_blocks, block_size, num_kv_heads, head_dim)
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)  # the tensor keeps the mapping


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    sinks: int = 0,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, heads, d]; k, v: [T, kv_heads, d] for this step's tokens. Returns [T, heads, d].

    sliding_window: when set, each query attends to its last `sliding_window` positions only (itself included);
    sinks: and to the sequence's first `sinks` positions too (with a window only). sink_logits: [heads], each
    head's learned logit in its softmax (see the module's docstring), or None.
    """
    if sinks and sliding_window is not None:
        return _attention_with_sinks(q, k, v, kv_cache, meta, scale, sliding_window, sinks, sink_logits)
    if triton_attention.serves(q.device) and not any(c.tree_positions is not None for c in meta.prefills):
        return triton_attention.paged_attention(q, k, v, kv_cache, meta, scale, sliding_window, sink_logits)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    # a cache of another dtype than q's (EngineConfig.kv_cache_dtype: bfloat16 beside float32 activations on the CPU)
    # holds the new keys and values rounded; attention reads them back widened
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v.to(value_cache.dtype))
    block_size = key_cache.shape[1]
    fresh_is_cached = key_cache.dtype == q.dtype  # else attention reads the rounded K/V back, as the kernels do

    out = torch.empty_like(q)
    for g in meta.decode_groups:
        fast = dense_kernels.decode_attention(
            q[g.start : g.end],
            key_cache,
            value_cache,
            g.block_tables,
            g.context_lens_t,
            scale,
            sliding_window,
            sink_logits,
        )
        if fast is not None:
            out[g.start : g.end] = fast
            continue
        tables, mask = g.block_tables, g.mask
        if sliding_window is not None and max(g.context_lens) > sliding_window:
            tables, mask = _windowed_decode_span(g, sliding_window, block_size)
        out[g.start : g.end] = _decode_attention(
            q[g.start : g.end], key_cache, value_cache, tables, mask, scale, sink_logits
        )
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        first_pos = chunk.first_pos
        fast = None
        if chunk.tree_positions is None:
            fast = dense_kernels.prefill_attention(
                q[rows], key_cache, value_cache, chunk.block_table, first_pos, scale, sliding_window, sink_logits
            )
        if fast is not None:
            out[rows] = fast
            continue
        if chunk.tree_positions is not None:  # a draft tree: its own mask, windowed by the drafts' positions
            kp, vp = _gather(key_cache, value_cache, chunk.block_table, chunk.context_len, q.dtype)
            mask, causal = chunk.mask, False
            if sliding_window is not None:
                q_pos, k_pos = chunk.tree_positions
                mask = mask & (k_pos.unsqueeze(0) > q_pos.unsqueeze(1) - sliding_window)
        elif sliding_window is not None and chunk.context_len > sliding_window:
            # Keys from the block holding the first visible position on; mask causal and window together.
            first_block = max(0, first_pos - sliding_window + 1) // block_size
            offset = first_block * block_size
            if chunk.mask is None and fresh_is_cached:  # first_pos == 0, offset == 0: the fresh K/V are all
                kp, vp = k[rows], v[rows]
            else:
                kp, vp = _gather(
                    key_cache, value_cache, chunk.block_table[first_block:], chunk.context_len - offset, q.dtype
                )
            q_pos = torch.arange(first_pos, chunk.context_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(offset, chunk.context_len, device=q.device).unsqueeze(0)
            mask, causal = (k_pos <= q_pos) & (k_pos > q_pos - sliding_window), False
        elif chunk.mask is None and fresh_is_cached:  # the whole context is in this step: the fresh K/V directly
            kp, vp, mask, causal = k[rows], v[rows], None, True
        else:
            kp, vp = _gather(key_cache, value_cache, chunk.block_table, chunk.context_len, q.dtype)
            mask, causal = chunk.mask, chunk.mask is None
        out[rows] = _attend_rows(q[rows], kp, vp, mask, causal, scale, sink_logits)
    return out


def _attend_rows(q, k, v, mask: torch.Tensor | None, causal: bool, scale: float, sink_logits: torch.Tensor | None):
    """One sequence's queries [n, heads, d] over its keys and values [L, kv_heads, d], as _sdpa attends:
    [n, heads, d]."""
    op = _sdpa(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        mask,
        causal,
        scale,
        sink_logits,
    )
    return op.squeeze(0).transpose(0, 1)


def _sdpa(q, k, v, mask: torch.Tensor | None, causal: bool, scale: float, sink_logits: torch.Tensor | None):
    """scaled_dot_product_attention of queries [B, heads, n, d] over keys and values [B, kv_heads, L, d] (query head
    h reads KV head h / (heads / kv_heads)), mask broadcast to [B, heads, n, L] (True: seen) or causal (the last n
    of the L positions). With sink_logits [heads], each head's logit joins its softmax as a column with no value
    (the softmax computed here in float32, its sink column then dropped)."""
    if sink_logits is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)).float() * scale
    if causal:
        n, length = scores.shape[-2:]
        mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sinks = sink_logits.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    weights = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
    return weights.to(v.dtype) @ v


def _attention_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int,
    sinks: int,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """paged_attention for a windowed layer with attention sinks: each query reads the sink blocks and the blocks
    from its window's first on, masked to keys < sinks or within the window (and causal); sink_logits as
    paged_attention's."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v.to(value_cache.dtype))
    block_size = key_cache.shape[1]
    sink_blocks = -(-sinks // block_size)
    device = q.device
    out = torch.empty_like(q)

    def columns(width: int, first_visible: int) -> torch.Tensor:
        """The block columns to read: the sink blocks, then from the one holding first_visible on."""
        first = max(sink_blocks, first_visible // block_size)
        return torch.cat([torch.arange(min(sink_blocks, width)), torch.arange(min(first, width), width)]).to(device)

    for g in meta.decode_groups:
        width = g.block_tables.shape[1]
        cols = columns(width, max(0, min(g.context_lens) - window))
        k_pos = (cols.unsqueeze(1) * block_size + torch.arange(block_size, device=device)).reshape(1, -1)
        lens = g.context_lens_t.unsqueeze(1)
        mask = (k_pos < lens) & ((k_pos < sinks) | (k_pos >= lens - window))
        out[g.start : g.end] = _decode_attention(
            q[g.start : g.end], key_cache, value_cache, g.block_tables[:, cols], mask, scale, sink_logits
        )
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        first_pos, length = chunk.first_pos, chunk.context_len
        width = -(-length // block_size)
        cols = columns(width, max(0, first_pos - window + 1))
        table = chunk.block_table[:width][cols]
        k_pos = (cols.unsqueeze(1) * block_size + torch.arange(block_size, device=device)).reshape(-1)
        kp, vp = _gather(key_cache, value_cache, table, table.shape[0] * block_size, q.dtype)
        keep = k_pos < length
        kp, vp, k_pos = kp[keep], vp[keep], k_pos[keep]
        q_pos = torch.arange(first_pos, length, device=device).unsqueeze(1)
        mask = (k_pos <= q_pos) & ((k_pos < sinks) | (k_pos > q_pos - window))
        out[rows] = _attend_rows(q[rows], kp, vp, mask, False, scale, sink_logits)
    return out


def _gather(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor, length: int, dtype: torch.dtype
):
    """The first `length` keys and values held by the blocks of `block_table`, as [length, kv_heads, d] of dtype."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    return (
        key_cache[block_table].view(-1, num_kv_heads, head_dim)[:length].to(dtype),
        value_cache[block_table].view(-1, num_kv_heads, head_dim)[:length].to(dtype),
    )


def _windowed_decode_span(g: DecodeGroup, window: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode group's block tables and mask restricted to a sliding window.

    The query of a row with context length L sits at position L-1 and sees keys L-W .. L-1. Block columns
    before the earliest such key of any row are dropped; what remains is masked per row.
    """
    first_block = max(0, min(g.context_lens) - window) // block_size
    offset = first_block * block_size
    k_pos = torch.arange(offset, g.block_tables.shape[1] * block_size, device=g.mask.device).unsqueeze(0)
    in_window = k_pos >= (g.context_lens_t - window).unsqueeze(1)
    return g.block_tables[:, first_block:], g.mask[:, offset:] & in_window


def _decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence against its paged context, in one fused attention call (sink_logits: see
    paged_attention).

    Each sequence's blocks are gathered whole (a copy of contiguous rows, no per-element indexing) into
    [num_seqs, context, kv_heads, head_dim] and handed to scaled_dot_product_attention as a strided
    [num_seqs, kv_heads, context, head_dim] view with the padding masked; `enable_gqa` lets each KV head
    serve its group of query heads without a repeat. On CPU the fused kernel is 2-3x faster than the two
    batched matmuls + softmax this replaced (block-diagonal queries over the KV heads), at 16-64 sequences.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    flat_tables = block_tables.reshape(-1)
    keys = key_cache.index_select(0, flat_tables).to(q.dtype).view(num_seqs, -1, num_kv_heads, head_dim)
    values = value_cache.index_select(0, flat_tables).to(q.dtype).view(num_seqs, -1, num_kv_heads, head_dim)
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)
    out = _sdpa(q.unsqueeze(2), keys, values, mask.view(num_seqs, 1, 1, -1), False, scale, sink_logits)
    return out.squeeze(2)
