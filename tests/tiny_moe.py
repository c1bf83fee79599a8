"""Tiny random-weight mixture-of-experts models built with transformers' own classes (Mixtral, Qwen2-MoE, Qwen3-MoE),
saved as safetensors in either expert layout and loaded through petrel's loader (shared by the MoE tests)."""

from __future__ import annotations

import torch
import transformers
from tiny_llama import VOCAB, Tiny, redraw_weights

from petrel.model.loader import load_model, resolve_model

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)

# family id -> (transformers config class, model class, config overrides)
MOE_FAMILIES = {
    # 4 experts of 32, top 2 renormalised (Mixtral always renormalises)
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    ),
    # 8 experts of 32, top 2 not renormalised, a gated shared expert of 48; layer 1 of 3 dense (mlp_only_layers)
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
        ),
    ),
    # 8 experts of 32, top 3 renormalised (norm_topk_prob), q/k norms, head_dim 32 wider than hidden / heads
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, head_dim=32, norm_topk_prob=True),
    ),
}
FAMILY_IDS = list(MOE_FAMILIES)


def build_from(families: dict, common: dict, name: str, seed: int, overrides: dict) -> torch.nn.Module:
    """transformers' model of family `name` (families: id -> (config class, model class, config overrides)) with
    eager attention and redrawn random weights, its head 4x wider (logits ~4x redraw_weights' N(0, 1): no near-ties
    among greedy choices)."""
    config_cls, model_cls, family = families[name]
    config = getattr(transformers, config_cls)(**{**common, **family, **overrides})
    config._attn_implementation = "eager"  # a reference independent of petrel's SDPA calls
    torch.manual_seed(seed)
    hf = getattr(transformers, model_cls)(config)
    redraw_weights(hf, seed)
    with torch.no_grad():
        hf.lm_head.weight.mul_(4.0)
    return hf


def build_hf(name: str, seed: int = 0, **overrides) -> torch.nn.Module:
    return build_from(MOE_FAMILIES, COMMON, name, seed, overrides).float().eval()


def layouts_factory(tmp_path_factory, build_hf):
    """build(name, fused=False, seed=1) -> Tiny of build_hf(name, seed): saved with one tensor per expert (the
    published layout) or, fused, as transformers 5 holds them (gate_up_proj [E, 2I, H] and down_proj [E, H, I] per
    layer), and loaded by petrel; each kept for the module."""
    cache: dict = {}

    def build(name: str, fused: bool = False, seed: int = 1) -> Tiny:
        key = (name, fused, seed)
        if key not in cache:
            other = (name, not fused, seed)
            hf = cache[other].hf if other in cache else build_hf(name, seed)
            path = tmp_path_factory.mktemp(f"{name}-{'fused' if fused else 'experts'}")
            hf.save_pretrained(path, safe_serialization=True, save_original_format=not fused)
            model, cfg = load_model(resolve_model(str(path)), torch.float32, "cpu")
            cache[key] = Tiny(hf, model, cfg, str(path))
        return cache[key]

    return build


def moe_factory(tmp_path_factory):
    """The MoE families' models in either expert layout: layouts_factory over build_hf."""
    return layouts_factory(tmp_path_factory, build_hf)
