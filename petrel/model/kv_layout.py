"""What one layer's paged KV cache holds per token: the cache kind, sized once from the model's config.

Two kinds:
  "kv"      a key and a value per KV head: [2 (key, value), num_blocks, block_size, kv_heads, head_dim] (every
            family with ordinary attention heads; tensor-parallel ranks hold their share of the KV heads);
  "latent"  multi-head latent attention (DeepSeek-V2 / V3, petrel/model/mla.py): per token the compressed latent
            (kv_lora_rank) and the rotary key (qk_rope_head_dim) once for all heads, side by side in one row:
            [1, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]. Prompt steps decompress keys and
            values from it; decode steps read it as it is.
Every cache tensor is [planes, num_blocks, block_size, heads, width], so what moves blocks and slots (block copies,
the prefix cache's blocks in the KV tiers, a disaggregated prompt's export) indexes dimension 1 and carries the
planes along without knowing the kind; the tiers' block format names the kind (petrel/kv_tiers/block_codec.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from petrel.model.parallel import SINGLE, TensorParallel, local_kv_heads, max_local_kv_heads


@dataclass(frozen=True)
class KVLayout:
    kind: str  # "kv" or "latent"
    planes: int  # 2 (keys, values) or 1 (the latent row)
    heads: int  # KV heads of this rank (1 for the latent)
    width: int  # values a head holds per token and plane

    @property
    def values_per_token(self) -> int:
        """Values one layer's cache holds per token."""
        return self.planes * self.heads * self.width

    def bytes_per_token(self, num_layers: int, dtype: torch.dtype) -> int:
        return num_layers * self.values_per_token * torch.empty((), dtype=dtype).element_size()

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (self.planes, num_blocks, block_size, self.heads, self.width)


def kv_layout_of(cfg, tp: TensorParallel = SINGLE, widest: bool = False) -> KVLayout:
    """The cache layout of a model (ModelConfig) on this rank; widest: on the rank holding the most KV heads (what
    sizes a block on every rank)."""
    if cfg.kv_lora_rank:
        return KVLayout("latent", 1, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    heads = (
        max_local_kv_heads(cfg.num_key_value_heads, tp.size) if widest else local_kv_heads(cfg.num_key_value_heads, tp)
    )
    return KVLayout("kv", 2, heads, cfg.head_dim)


def expanded_kv_values_per_token(cfg) -> int:
    """Values one layer would cache per token with every head's key and value kept (what MLA's latent replaces):
    heads x (qk head dim + v head dim); the layout's own count for ordinary attention."""
    if cfg.kv_lora_rank:
        return cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    return kv_layout_of(cfg).values_per_token
