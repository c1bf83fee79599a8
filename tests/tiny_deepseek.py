"""Tiny random-weight DeepSeek-V2 / V3 models built with transformers' own classes, saved as safetensors and loaded
through petrel's loader (shared by the DeepSeek tests)."""

from __future__ import annotations

import torch
from tiny_llama import VOCAB
from tiny_moe import build_from, layouts_factory

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,  # transformers' eager attention repeats kv heads by heads // this
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
)
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "rope_theta": 10000.0,
}

# family id -> (transformers config class, model class, config overrides)
DEEPSEEK_FAMILIES = {
    # V2-Lite's shape: queries in one projection, softmax greedy top-2 unscaled, 2 shared experts, plain rotary
    "deepseek_v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(q_lora_rank=None, topk_method="greedy", n_shared_experts=2),
    ),
    # V2's: a query latent, softmax top-2 within the best of 2 groups (each scored by its best expert), weights
    # times 2, YaRN with mscale = mscale_all_dim = 0.707
    "deepseek_v2_grouped": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            q_lora_rank=32,
            topk_method="group_limited_greedy",
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.0,
            n_shared_experts=1,
            rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
        ),
    ),
    # V3's: sigmoid scores with a correction bias for choosing, top-2 within the 2 best of 4 groups (each scored by
    # its best two), renormalised, times 2.5; YaRN with mscale = mscale_all_dim = 1 (the softmax scale's mscale^2)
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            q_lora_rank=32,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            n_shared_experts=1,
            rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
        ),
    ),
}
FAMILY_IDS = list(DEEPSEEK_FAMILIES)


def build_hf(name: str, seed: int = 0, **overrides) -> torch.nn.Module:
    hf = build_from(DEEPSEEK_FAMILIES, COMMON, name, seed, overrides)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for buffer_name, buffer in hf.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):  # large enough to change which experts win
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=g))
    return hf.float().eval()


def deepseek_factory(tmp_path_factory):
    """The DeepSeek families' models in either expert layout: layouts_factory over build_hf."""
    return layouts_factory(tmp_path_factory, build_hf)
