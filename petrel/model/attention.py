"""Paged attention over a block-structured KV cache, in portable PyTorch (CPU or any device).

A step's tokens arrive as one flat batch. Decode tokens (one query per sequence) come first and are
attended together in one batched call; prefill chunks follow, one call per sequence. Every sequence
reads its keys and values through its block table, so prefix-cache hits, chunked prefill and
recomputation after preemption are all the same code path.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    start: int            # first row of this chunk in the flat batch
    num_tokens: int       # query tokens in this chunk
    context_len: int      # tokens in the KV cache after this step (cached prefix + this chunk)
    block_table: torch.Tensor  # [num_blocks_of_this_seq] int64
    mask: torch.Tensor | None  # [num_tokens, context_len] bool, None when the chunk is the whole context


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [num_tokens] int64: flat cache slot that receives each new K/V
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int64
    decode_mask: torch.Tensor | None = None          # [num_decodes, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillChunk] = field(default_factory=list)


def new_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """One layer's cache: [2 (key, value), num_blocks, block_size, kv_heads, head_dim]."""
    return torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, heads, d]; k, v: [T, kv_heads, d] for this step's tokens. Returns [T, heads, d]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    block_size = key_cache.shape[1]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)

    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if nd:
        group = num_heads // num_kv_heads
        # Queries of one KV head's group attend as a short "sequence" against that head: no repeat of K/V.
        qd = q[:nd].view(nd, num_kv_heads, group, head_dim)
        tables = meta.decode_block_tables
        kd = key_cache[tables].view(nd, -1, num_kv_heads, head_dim).transpose(1, 2)
        vd = value_cache[tables].view(nd, -1, num_kv_heads, head_dim).transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        out[:nd] = od.reshape(nd, num_heads, head_dim)
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        if chunk.mask is None:  # the whole context is in this step: use the fresh K/V directly
            kp, vp = k[rows], v[rows]
        else:
            kp = key_cache[chunk.block_table].view(-1, num_kv_heads, head_dim)[:chunk.context_len]
            vp = value_cache[chunk.block_table].view(-1, num_kv_heads, head_dim)[:chunk.context_len]
        op = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1).unsqueeze(0), kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
            attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=scale, enable_gqa=True)
        out[rows] = op.squeeze(0).transpose(0, 1)
    return out
