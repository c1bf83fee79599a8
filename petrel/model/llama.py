"""Llama-family decoder over a flat token batch.

Llama 2/3, SmolLM2 and Mistral (sliding window included), and the families that differ from Llama only by a
config flag: Qwen2 / Qwen2.5 (bias on q, k, v), Qwen3 (RMS norm on each q and k head before rotary). Phi-3 is
Llama with q/k/v and gate/up stored fused in the checkpoint, as petrel holds them.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from petrel.model.attention import AttentionMetadata, paged_attention
from petrel.model.config import ModelConfig
from petrel.model.layers import Linear, RMSNorm, RotaryEmbedding, silu_and_mul


class LlamaAttention(nn.Module):
    norm_class = RMSNorm     # of the per-head q/k norms (cfg.qk_norm); Gemma's scales by 1 + weight

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.sliding_window = cfg.sliding_window(layer)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.attention_bias or cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        if cfg.qk_norm:
            self.q_norm = self.norm_class(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = self.norm_class(self.head_dim, cfg.rms_norm_eps)
        self.scale = (cfg.query_pre_attn_scalar or self.head_dim) ** -0.5

    def forward(self, x, cos_sin, kv_cache, meta: AttentionMetadata):
        qkv = self.qkv_proj(x)
        heads = self.num_heads
        # queries and keys side by side, as [T, heads + kv_heads, head_dim]: one rotary pass for both
        qk = qkv[:, :self.q_size + self.kv_size].view(-1, heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(-1, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            qk = torch.cat([self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])], dim=1)
        qk = RotaryEmbedding.rotate(qk, cos_sin)
        out = paged_attention(qk[:, :heads], qk[:, heads:], v, kv_cache, meta, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x, cos_sin, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (fused parameter fragment, shard index)
    fused_shards = {
        ".q_proj.": (".qkv_proj.", 0), ".k_proj.": (".qkv_proj.", 1), ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
    }

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, num_layers: int | None = None) -> torch.Tensor:
        """Flat batch in ([T] ids and positions), final hidden states out ([T, hidden]).

        num_layers: run only the first layers, then the final norm (early exit, for self-speculation)."""
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.model.rotary.for_positions(positions, x.dtype)
        for layer, kv_cache in zip(self.model.layers[:num_layers], kv_caches):
            x = layer(x, cos_sin, kv_cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the fused parameters; QuantizedWeights (a GGUF loaded
        with quantization 'gguf') are gathered by parameter and shard and put in place as quantized modules."""
        from petrel.model.quantization import QuantizedLoads, QuantizedWeight
        quantized = QuantizedLoads()
        params = dict(self.named_parameters())
        cfg = self.config
        shard_sizes = {".qkv_proj.": [cfg.num_attention_heads * cfg.head_dim] + [cfg.num_key_value_heads * cfg.head_dim] * 2,
                       ".gate_up_proj.": [cfg.intermediate_size] * 2}
        loaded = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            for piece, (fused, shard) in self.fused_shards.items():
                if piece in name:
                    target = name.replace(piece, fused)
                    sizes = shard_sizes[fused]
                    offset = sum(sizes[:shard])
                    if isinstance(tensor, QuantizedWeight):
                        if tensor.shape != (sizes[shard], params[target].shape[1]):
                            raise ValueError(f"weight {name!r} has shape {tensor.shape}, expected "
                                             f"{(sizes[shard], params[target].shape[1])}")
                        quantized.add(target, shard, len(sizes), offset, tensor)
                    else:
                        params[target].data[offset:offset + sizes[shard]].copy_(tensor)
                    loaded.add(f"{target}#{shard}")
                    break
            else:
                if name not in params:
                    raise ValueError(f"unexpected weight {name!r} in checkpoint for {cfg.architecture}")
                if params[name].shape != tensor.shape:
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}")
                if isinstance(tensor, QuantizedWeight):
                    quantized.add(name, 0, 1, 0, tensor)
                else:
                    params[name].data.copy_(tensor)
                fused = next((f for f in shard_sizes if f in name), None)   # stored fused already (Phi-3)
                loaded.update([f"{name}#{i}" for i in range(len(shard_sizes[fused]))] if fused else [name])
        expected = set()
        for pname in params:
            fused = next((f for f in shard_sizes if f in pname), None)
            if fused:
                expected.update(f"{pname}#{i}" for i in range(len(shard_sizes[fused])))
            elif not (pname == "lm_head.weight" and cfg.tie_word_embeddings):
                expected.add(pname)
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}{' ...' if len(missing) > 5 else ''}")
        quantized.install(self)
