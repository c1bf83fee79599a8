"""Gemma 3 text decoder (transformers' Gemma3ForCausalLM, model_type gemma3_text) over a flat token batch.

Differences from Llama: RMS norms scale by (1 + weight), in float32; embeddings are multiplied by sqrt(hidden_size);
four norms per layer (the attention output and the MLP output are normed before their residual adds); q and k
are normed per head before rotary; the MLP is GeGLU (tanh-approximated gelu); attention scale is
query_pre_attn_scalar ** -0.5; sliding-window layers are interleaved with global ones and use their own rotary
base (rope_local_base_freq) while global layers use rope_theta (with its scaling); optional final logit
soft-capping. Weights load as Llama's do (q/k/v and gate/up fused).
"""

from __future__ import annotations

import torch
from torch import nn

from petrel.model.attention import AttentionMetadata, per_layer
from petrel.model.config import ModelConfig
from petrel.model.layers import RotaryEmbedding
from petrel.model.llama import LlamaAttention, LlamaForCausalLM
from petrel.model.parallel import (
    SINGLE,
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
)


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), computed in float32 and cast back (the weight is stored as an offset from 1)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.rms_norm(x.float(), self.weight.shape, 1.0 + self.weight.float(), self.eps)
        return out.to(x.dtype)


class Gemma3Attention(LlamaAttention):
    """Llama's attention with Gemma's q/k norms (cfg.qk_norm is set for Gemma 3) and its query_pre_attn_scalar."""

    norm_class = GemmaRMSNorm


class Gemma3MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear.even(cfg.hidden_size, [cfg.intermediate_size] * 2, tp, bias=False)
        self.down_proj = RowParallelLinear.even(cfg.intermediate_size, cfg.hidden_size, tp, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel = SINGLE):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.self_attn = Gemma3Attention(cfg, layer, tp)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.mlp = Gemma3MLP(cfg, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.is_local = self.self_attn.sliding_window is not None  # sliding layers use the local rotary table

    def forward(self, x, cos_sin, kv_cache, meta):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        local_theta = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
        self.rotary_local = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, local_theta, None)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i, tp) for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Same parameter names as petrel's Llama (fused qkv_proj and gate_up_proj), so Llama's load_weights serves."""

    supports_prompt_tuning = False  # its forward (scaled embeddings) takes no input_embeds

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        nn.Module.__init__(self)
        self.config = cfg
        self.model = Gemma3Model(cfg, tp)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.embed_scale = cfg.hidden_size**0.5

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # scaled in the embedding dtype, as transformers does
        global_cs = self.model.rotary.for_positions(positions, x.dtype)
        local_cs = self.model.rotary_local.for_positions(positions, x.dtype)
        for layer, kv_cache, layer_meta in zip(self.model.layers[:num_layers], kv_caches, per_layer(meta)):
            x = layer(x, local_cs if layer.is_local else global_cs, kv_cache, layer_meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
