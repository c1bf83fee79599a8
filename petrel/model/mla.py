"""Multi-head latent attention (DeepSeek-V2 / V3) over a latent paged KV cache.

Per token the layer computes
  queries  q = W_q x (or W_qb norm(W_qa x) through a q_lora_rank latent): per head a qk_nope_head_dim part and a
           qk_rope_head_dim part, the latter rotated;
  latent   c = norm(W_kv_a x)[:kv_lora_rank] and the rotary key k_pe = rotate(W_kv_a x)[kv_lora_rank:], one for all
           heads: the cache row [c, k_pe] (petrel/model/kv_layout.py's "latent" kind, kv_lora_rank +
           qk_rope_head_dim values a token instead of heads x 2 x head_dim);
  heads    keys k_h = [W_UK_h c, k_pe] and values v_h = W_UV_h c, where kv_b_proj's rows are W_UK and W_UV
           (w_uk [heads, nope, rank], w_uv [heads, v_head_dim, rank] here);
  output   o = W_o [softmax(q_h . k_h * scale) v_h for each head].
Two ways to the same numbers:
  prompt chunks  decompress: the chunk's context (its own rows, or the cached prefix's rows gathered by the block
                 table) through W_UK and W_UV into every head's keys and values, then ordinary causal attention (a
                 chunk of few queries, for which that costs more than absorbing: absorbed, as below);
  decode rows    absorb: q_h . W_UK_h c = (W_UK_h^T q_h) . c, so each head's query becomes a kv_lora_rank vector
                 [W_UK_h^T q_nope_h, q_pe_h] attending over the cache rows as they are (one KV head, keys the whole
                 row, values its latent part), and W_UV_h is applied to each head's weighted latent afterwards. A
                 decode step reads the latent cache once for all heads and never expands it.
The scale is (nope + rope)^-0.5, times YaRN's mscale^2 (petrel/model/yarn.py). Checkpoints store the rotary rows as
consecutive pairs; DeepseekForCausalLM de-interleaves them at load, so the rotation here is petrel's rotate-half.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from petrel.model import mla_kernels
from petrel.model.attention import AttentionMetadata
from petrel.model.layers import Linear, RMSNorm, RotaryEmbedding
from petrel.model.yarn import softmax_scale

LATENT_NORM_EPS = 1e-6  # DeepSeek's q_a_layernorm and kv_a_layernorm use the default eps, not rms_norm_eps


class LatentProjections(nn.Module):
    """kv_b_proj split by what it makes of the latent: w_uk [heads, nope, rank] (the keys' non-rotary part) and
    w_uv [heads, v_head_dim, rank] (the values). Plain parameters, not a linear layer: quantization leaves them
    dense, the decode path multiplies queries and outputs by them head by head."""

    def __init__(self, heads: int, nope: int, v_dim: int, rank: int):
        super().__init__()
        self.w_uk = nn.Parameter(torch.empty(heads, nope, rank), requires_grad=False)
        self.w_uv = nn.Parameter(torch.empty(heads, v_dim, rank), requires_grad=False)


class MLAttention(nn.Module):
    def __init__(self, cfg, layer: int):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        qk = self.nope + self.rope
        hidden, bias = cfg.hidden_size, cfg.attention_bias
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(hidden, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(cfg.q_lora_rank, self.num_heads * qk, bias=False)
        else:
            self.q_proj = Linear(hidden, self.num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = LatentProjections(self.num_heads, self.nope, self.v_dim, self.rank)
        self.o_proj = Linear(self.num_heads * self.v_dim, hidden, bias=bias)
        self.scale = softmax_scale(qk, cfg.rope_scaling)

    def forward(self, x: torch.Tensor, cos_sin, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        tokens, heads = x.shape[0], self.num_heads
        if hasattr(self, "q_a_proj"):
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(tokens, heads, self.nope + self.rope)
        compressed = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(compressed[:, : self.rank].contiguous())
        # every head's rotary query part and the one rotary key, rotated in one pass
        pe = RotaryEmbedding.rotate(torch.cat([q[:, :, self.nope :], compressed[:, None, self.rank :]], 1), cos_sin)
        rows = torch.cat([latent, pe[:, heads]], dim=-1)  # this step's cache rows [T, rank + rope]
        cache = kv_cache[0]  # [blocks, block_size, 1, rank + rope]
        cache.view(-1, rows.shape[1]).index_copy_(0, meta.slot_mapping, rows.to(cache.dtype))
        q_nope, q_pe = q[:, :, : self.nope], pe[:, :heads]
        out = torch.empty(tokens, heads, self.v_dim, dtype=x.dtype, device=x.device)
        for g in meta.decode_groups:
            out[g.start : g.end] = self._decode(q_nope[g.start : g.end], q_pe[g.start : g.end], cache, g)
        fresh = cache.dtype == x.dtype  # else attention reads the rounded rows back, as the cache holds them
        for chunk in meta.prefills:
            span = slice(chunk.start, chunk.start + chunk.num_tokens)
            if chunk.mask is None and chunk.tree_positions is None and fresh:  # the whole context is this chunk
                context, mask, causal = rows[span], None, True
            else:
                table = chunk.block_table
                context = cache[table].view(-1, rows.shape[1])[: chunk.context_len].to(x.dtype)
                mask, causal = chunk.mask, chunk.mask is None
            attend = self._absorbed if self.absorbs(chunk.num_tokens) else self._prefill
            out[span] = attend(q_nope[span], q_pe[span], context, mask, causal)
        return self.o_proj(out.view(tokens, heads * self.v_dim))

    def absorbs(self, queries: int) -> bool:
        """Whether a chunk of this many queries attends cheaper absorbed than decompressed: per context row and
        head, absorbed costs queries x (rank + rope + rank) multiply-adds, decompressed rank x (nope + v) to expand
        the row and queries x (nope + rope + v) to attend (DeepSeek-V3's shape: absorbed below 171 queries; a
        draft tree's few tokens, the rest of a prompt after a prefix-cache hit)."""
        width = self.rank + self.rope
        expanded = self.rank * (self.nope + self.v_dim) + queries * (self.nope + self.rope + self.v_dim)
        return queries * (width + self.rank) < expanded

    def _absorbed(self, q_nope, q_pe, context, mask, causal: bool) -> torch.Tensor:
        """A chunk's queries absorbed (as decode rows are) against its context's rows [L, rank + rope] as they are:
        every (query, head) pair a query row of one KV head, each with its query's mask. Returns [n, heads, v]."""
        query = self.absorb_queries(q_nope, q_pe)
        n, heads, width = query.shape
        if mask is None and causal:  # the chunk is the whole context: query i sees rows 0..i
            mask = torch.ones(n, context.shape[0], dtype=torch.bool, device=query.device).tril()
        rows = context.view(1, 1, -1, width)
        latent_out = F.scaled_dot_product_attention(
            query.view(1, 1, n * heads, width),
            rows,
            rows[..., : self.rank],
            attn_mask=None if mask is None else mask.repeat_interleave(heads, dim=0),
            scale=self.scale,
        )
        return self.expand_outputs(latent_out.view(n, heads, self.rank))

    def _prefill(self, q_nope, q_pe, context, mask, causal: bool) -> torch.Tensor:
        """A chunk's queries [n, heads, nope] / [n, heads, rope] against its context's rows [L, rank + rope],
        decompressed into every head's keys and values. Returns [n, heads, v_head_dim]."""
        length, heads = context.shape[0], self.num_heads
        latent, k_pe = context[:, : self.rank], context[:, self.rank :]
        w_uk, w_uv = self.kv_b_proj.w_uk, self.kv_b_proj.w_uv
        k_nope = (latent @ w_uk.reshape(-1, self.rank).t().to(latent.dtype)).view(length, heads, self.nope)
        values = (latent @ w_uv.reshape(-1, self.rank).t().to(latent.dtype)).view(length, heads, self.v_dim)
        keys = torch.cat([k_nope, k_pe[:, None].expand(length, heads, self.rope)], dim=-1)
        query = torch.cat([q_nope, q_pe], dim=-1)
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            scale=self.scale,
        )
        return out.squeeze(0).transpose(0, 1)

    def absorb_queries(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """[rows, heads, rank + rope]: each head's query in the latent's space (W_UK_h^T q_nope_h) beside its
        rotary part, what attends over cache rows as they are."""
        w_uk = self.kv_b_proj.w_uk.to(q_nope.dtype)
        absorbed = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [rows, heads, rank]
        return torch.cat([absorbed, q_pe], dim=-1)

    def expand_outputs(self, latent_out: torch.Tensor) -> torch.Tensor:
        """Each head's weighted latent [rows, heads, rank] through its W_UV: [rows, heads, v_head_dim]."""
        w_uv = self.kv_b_proj.w_uv.to(latent_out.dtype)
        return torch.bmm(latent_out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _decode(self, q_nope, q_pe, cache, g) -> torch.Tensor:
        """Decode rows: absorbed queries over the cache rows of each row's blocks, read as they are (one KV head:
        keys the whole row, values its latent part). Returns [rows, heads, v_head_dim]. On x86-64 CPUs in float32,
        mla_kernels' C kernel reads the blocks in place; else each row's blocks are gathered and its heads attend
        as the query rows of one head (no copy of the keys per head)."""
        query = self.absorb_queries(q_nope, q_pe)
        latent_out = mla_kernels.latent_decode_attention(
            query, cache, g.block_tables, g.context_lens_t, self.rank, self.scale
        )
        if latent_out is None:
            rows, heads, width = query.shape
            keys = cache.index_select(0, g.block_tables.reshape(-1)).to(query.dtype).view(rows, 1, -1, width)
            latent_out = F.scaled_dot_product_attention(
                query.unsqueeze(1),
                keys,
                keys[..., : self.rank],
                attn_mask=g.mask.view(rows, 1, 1, -1),
                scale=self.scale,
            ).squeeze(1)
        return self.expand_outputs(latent_out)
