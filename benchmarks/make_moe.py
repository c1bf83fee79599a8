"""A Qwen3-MoE-shaped, gpt-oss-shaped or DeepSeek-V3-shaped mixture-of-experts model with random weights, for
benchmarks (speed does not depend on the values), and the GGUF writer for petrel's MoE families.

    python benchmarks/make_moe.py --out ~/petrel-peers/models/moe                  # the default shapes, below
    python benchmarks/make_moe.py --out DIR --gguf-type q4_k --no-bf16              # experts in Q4_K blocks
    python benchmarks/make_moe.py --out /tmp/tiny --layers 2 --hidden 64 --heads 4 --kv-heads 2 --head-dim 16 \\
        --experts 8 --top-k 2 --moe-intermediate 32                                 # the same builder, tiny
    python benchmarks/make_moe.py --family gpt-oss --out DIR                        # gpt-oss-shaped, MXFP4 experts
    python benchmarks/make_moe.py --family deepseek-v3 --out ~/petrel-peers/models/deepseek   # DeepSeek-V3's shape
    python benchmarks/make_moe.py --family deepseek-v3 --kv-report                  # KV bytes a token, nothing built

Writes, under --out:
  fp32/               a Hugging Face directory (config.json, model.safetensors in float32 with one tensor per
                      expert, as the published Qwen3-MoE checkpoints are, tokenizer files)
  bf16/               the same weights rounded to bfloat16 (config dtype bfloat16)
  moe-<type>.gguf     the weights as llama.cpp's converter lays out a qwen3moe (`--gguf-type f32|f16|bf16|q8_0`:
                      the matrices and expert stacks in that type, by the gguf package's quantizer; q4_k: expert
                      stacks and matrices of 256-multiple widths in Q4_K blocks, by quantize_q4_k here, the
                      others in Q8_0), the router and norms float32 as the converter keeps them

--family gpt-oss (defaults: gpt-oss-20b's shapes scaled down the same way: 12 layers, hidden 1024, 16 query heads and
4 KV heads of 64, layers sliding (window 128) and full in turn, 32 experts of 1024 with the top 4 routed, learned
sink logits, biases: 1.34 B parameters, 0.23 B read per token) writes its fp32/ directory as the published
checkpoints are, experts in MXFP4 (*_blocks, *_scales; the model's float experts replaced by what those blocks hold,
so fp32/ and the GGUF are the same model), and moe-mxfp4.gguf as llama.cpp's converter lays out a gpt-oss (experts
MXFP4 with gate and up apart, their biases, attn_sinks, post_attention_norm; the other matrices float32).

The default shapes are Qwen3-30B-A3B's scaled down to fit this machine (24 layers, hidden 1024, 16 query heads and
4 KV heads of 64, 64 experts of 256 with the top 8 routed, per-head q/k norms, untied head), with the default
model's vocabulary (SmolLM2's 49,152 ids, its tokenizer and chat template) so that a benchmark's prompts tokenize:
1.37 B parameters in all, 0.27 B of them read per token (8 of 64 experts, attention, the head).

--family deepseek-v3 builds DeepSeek-V3's architecture (transformers' DeepseekV3ForCausalLM) scaled down the same
way: 12 layers of hidden 1024, the first dense (intermediate 2816), 16 heads of multi-head latent attention with
DeepSeek-V3's own latent (kv_lora_rank 512, qk_rope_head_dim 64: 576 cached values a token and layer), its 128 / 64
/ 128 head dimensions and a q_lora_rank of 384, 64 routed experts of 512 in 8 groups (top 8 within the best 4
groups, sigmoid scores, routed_scaling_factor 2.5) and one shared expert, YaRN rotary (factor 8 over 4,096
positions): 1.31 B parameters, 0.29 B read per token. --kv-report prints the KV bytes a token of the latent cache
against the same model with every head's key and value cached, for these shapes and for DeepSeek-V3's own.

write_gguf writes any of petrel's MoE families as llama.cpp's convert_hf_to_gguf.py does: qwen3moe and qwen2moe
(q/k/v biases, ffn_*_shexp, ffn_gate_inp_shexp, expert_shared_feed_forward_length), and Mixtral as a "llama" with
experts (q and k rows permuted to llama.cpp's rotary layout); each layer's experts as 3-D stacks
ffn_{gate,up,down}_exps [experts, rows, columns], the router ffn_gate_inp, metadata expert_count,
expert_used_count, expert_feed_forward_length (tests/test_moe_gguf.py writes its tiny models with it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the dense builder beside this file
from make_llama_1b import copy_tokenizer_metadata, permute_for_llamacpp  # noqa: E402  (its GGUF writer's helpers)

GGUF_TYPES = {  # --gguf-type -> the file type llama.cpp records
    "f32": "ALL_F32",
    "f16": "MOSTLY_F16",
    "bf16": "MOSTLY_BF16",
    "q8_0": "MOSTLY_Q8_0",
    "q4_k": "MOSTLY_Q4_K_M",
    "mxfp4": "MOSTLY_MXFP4_MOE",  # experts MXFP4 (gpt-oss), the rest float32
}
GGUF_ARCH = {
    "Qwen3MoeForCausalLM": "qwen3moe",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "MixtralForCausalLM": "llama",
    "GptOssForCausalLM": "gpt-oss",
    "DeepseekV2ForCausalLM": "deepseek2",
    "DeepseekV3ForCausalLM": "deepseek2",
}
GGUF_NAMES = {  # Hugging Face name inside model.layers.N. (Mixtral's block_sparse_moe is mlp here) -> llama.cpp's
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",  # a dense layer's MLP
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.experts.gate_proj": "ffn_gate_exps",
    "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.router": "ffn_gate_inp",  # gpt-oss's router (with a bias)
    "self_attn.sinks": "attn_sinks",
    # DeepSeek: multi-head latent attention's projections (kv_b_proj is split into attn_k_b and attn_v_b, or kept as
    # attn_kv_b in the older layout) and the shared experts
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
GPT_OSS_NAMES = {**GGUF_NAMES, "post_attention_layernorm": "post_attention_norm"}
FLOAT32_KEPT = ("ffn_gate_inp", "ffn_gate_inp_shexp")  # routers: the converter keeps them float32


# per family: the default shapes (the arguments left unset; see the module's docstring) and GGUF type
FAMILY_DEFAULTS = {
    "qwen3-moe": dict(layers=24, hidden=1024, heads=16, experts=64, top_k=8, moe_intermediate=256, gguf_type="f32"),
    "gpt-oss": dict(layers=12, hidden=1024, heads=16, experts=32, top_k=4, moe_intermediate=1024, gguf_type="mxfp4"),
    "deepseek-v3": dict(layers=12, hidden=1024, heads=16, experts=64, top_k=8, moe_intermediate=512, gguf_type="f32"),
}
# DeepSeek-V3's own shape (its published config), for --kv-report
DEEPSEEK_V3 = dict(layers=61, heads=128, kv_lora_rank=512, rope=64, nope=128, v=128)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="output directory (created)")
    p.add_argument("--family", default="qwen3-moe", choices=[*FAMILY_DEFAULTS])
    p.add_argument("--kv-report", action="store_true", help="deepseek-v3: print KV bytes a token (latent vs expanded)")
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--experts", type=int)
    p.add_argument("--top-k", type=int)
    p.add_argument("--moe-intermediate", type=int)
    p.add_argument("--window", type=int, default=128, help="gpt-oss: the sliding layers' window (default 128)")
    p.add_argument("--kv-lora-rank", type=int, default=512, help="deepseek-v3: the latent's width (default 512)")
    p.add_argument("--q-lora-rank", type=int, default=384, help="deepseek-v3: the queries' latent (default 384)")
    p.add_argument("--context", type=int, default=32768, help="max_position_embeddings (default 32768)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--std", type=float, default=0.02, help="std of the random weights (default 0.02)")
    p.add_argument("--gguf-type", choices=[*GGUF_TYPES], help="default f32 (gpt-oss: mxfp4)")
    p.add_argument("--no-bf16", action="store_true", help="skip the bf16 directory")
    p.add_argument("--no-gguf", action="store_true", help="skip the GGUF")
    args = p.parse_args(argv)
    for key, value in FAMILY_DEFAULTS[args.family].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.family == "deepseek-v3":
        args.kv_heads = args.heads
    if args.heads % args.kv_heads or args.head_dim % 2 or not 1 <= args.top_k <= args.experts:
        p.error("--heads must split into --kv-heads groups, --head-dim be even, --top-k be 1..--experts")
    if args.out is None and not args.kv_report:
        p.error("--out is required (or --kv-report)")
    return args


def deepseek_config(args, vocab_size: int, special: dict):
    """DeepSeek-V3's architecture at the arguments' scale (the module's docstring)."""
    from transformers import DeepseekV3Config

    groups = 8 if args.experts % 8 == 0 and args.experts >= 16 else 1  # groups of two experts at least
    return DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4 // 64 * 64,  # DeepSeek-V3's dense ratio (18432 / 7168), rounded
        moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        n_routed_experts=args.experts,
        num_experts_per_tok=args.top_k,
        n_shared_experts=1,
        n_group=groups,
        topk_group=max(1, groups // 2),
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        max_position_embeddings=args.context,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": args.context / 4096,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=args.std,
        **special,
    )


def kv_report(args) -> list[str]:
    """KV-cache bytes a token (every layer, float32 and bfloat16) of the latent cache against every head's key and
    value cached: the arguments' DeepSeek-V3-shaped model and DeepSeek-V3 itself."""
    lines = []
    shapes = [
        (
            "this model",
            dict(layers=args.layers, heads=args.heads, kv_lora_rank=args.kv_lora_rank, rope=64, nope=128, v=128),
        ),
        ("DeepSeek-V3", DEEPSEEK_V3),
    ]
    for name, s in shapes:
        latent = s["layers"] * (s["kv_lora_rank"] + s["rope"])
        expanded = s["layers"] * s["heads"] * (s["nope"] + s["rope"] + s["v"])
        lines.append(
            f"{name}: KV bytes a token, latent {latent * 4:,} (float32) / {latent * 2:,} (bfloat16); "
            f"expanded heads {expanded * 4:,} / {expanded * 2:,}: {expanded / latent:.1f}x"
        )
    return lines


def build_model(args, tokenizer):
    if args.family == "gpt-oss":
        return build_gpt_oss(args, tokenizer)
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    special = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    if args.family == "deepseek-v3":
        from transformers import DeepseekV3ForCausalLM

        torch.manual_seed(args.seed)
        return DeepseekV3ForCausalLM(deepseek_config(args, len(tokenizer), special)).float().eval()

    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.moe_intermediate * args.top_k,  # a dense layer's (none here; Qwen3-30B-A3B's ratio)
        moe_intermediate_size=args.moe_intermediate,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.context,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
        initializer_range=args.std,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(args.seed)
    return Qwen3MoeForCausalLM(config).float().eval()  # transformers' init: normal(0, initializer_range)


def build_gpt_oss(args, tokenizer):
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.moe_intermediate,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        sliding_window=args.window,
        max_position_embeddings=args.context,
        rope_parameters={  # gpt-oss's YaRN, over an original context scaled as the window is
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": max(args.context // 32, 1),
            "rope_theta": 150000.0,
        },
        rms_norm_eps=1e-5,
        initializer_range=args.std,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(args.seed)
    model = GptOssForCausalLM(config).float().eval()
    with torch.no_grad():  # transformers zeroes the experts' biases: random ones, so that they matter
        for layer in model.model.layers:
            for bias in (layer.mlp.experts.gate_up_proj_bias, layer.mlp.experts.down_proj_bias):
                bias.normal_(0.0, args.std)
    return model


def mxfp4(stack: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [..., cols] (cols a multiple of 32) as GGUF MXFP4 blocks [..., cols / 32 * 17] uint8 (the gguf
    package's quantizer: per 32 values an E8M0 exponent byte, then 16 bytes of E2M1 codes, elements j and 16 + j in
    byte j), and the float32 values those blocks hold."""
    import gguf
    from gguf.quants import dequantize, quantize

    blocks = quantize(np.ascontiguousarray(stack, dtype=np.float32), gguf.GGMLQuantizationType.MXFP4)
    values = dequantize(blocks, gguf.GGMLQuantizationType.MXFP4).reshape(stack.shape)
    return blocks, np.asarray(values, dtype=np.float32)


def checkpoint_pairs(codes: np.ndarray) -> np.ndarray:
    """MXFP4 codes [..., 16] as GGUF pairs them (elements j, 16 + j in byte j) -> as the published checkpoints do
    (elements 2j, 2j + 1 in byte j, the first in the low nibble)."""
    elements = np.concatenate([codes & 0x0F, codes >> 4], axis=-1)  # [..., 32] in order
    return (elements[..., 0::2] | (elements[..., 1::2] << 4)).astype(np.uint8)


def gpt_oss_to_mxfp4(model) -> dict:
    """Each layer's experts of a transformers gpt-oss rounded to MXFP4 in place (the model then holds exactly what the
    blocks hold) and returned as the published checkpoints store them: {name: tensor} with gate_up_proj_blocks
    [E, 2I, H/32, 16] and _scales [E, 2I, H/32] (rows interleaved gate/up, as gate_up_proj's columns), down_proj's
    [E, H, I/32, 16] and [E, H, I/32], for every other tensor its own."""
    import torch

    out = {}
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if not name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
                out[name] = tensor.detach().clone().contiguous()
                continue
            rows = tensor.detach().float().transpose(1, 2).contiguous().numpy()  # [E, out, in]
            blocks, values = mxfp4(rows)
            blocks = blocks.reshape(*rows.shape[:2], rows.shape[2] // 32, 17)
            out[f"{name}_blocks"] = torch.from_numpy(checkpoint_pairs(blocks[..., 1:]))
            out[f"{name}_scales"] = torch.from_numpy(np.ascontiguousarray(blocks[..., 0]))
            model.get_parameter(name).copy_(torch.from_numpy(values).transpose(1, 2))
    return out


def save_gpt_oss_mxfp4(model, path: str) -> None:
    """model (its experts rounded to MXFP4 in place) saved as a published gpt-oss checkpoint: config.json with
    quantization_config quant_method mxfp4, model.safetensors with the experts' blocks and scales, the rest float32."""
    from safetensors.torch import save_file

    tensors = gpt_oss_to_mxfp4(model)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = {**model.config.to_dict(), "architectures": ["GptOssForCausalLM"]}
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def quantize_q4_k(data: np.ndarray) -> np.ndarray:
    """float32 [..., cols] (cols a multiple of 256) as GGUF Q4_K blocks [..., cols / 256 * 144] uint8: per 256 values
    a float16 scale d and min scale dmin, 8 sub-blocks of 32 each with a 6-bit scale and min (w = d sc q - dmin m,
    q 4 bits; ggml's get_scale_min_k4 packing of the 12 scale bytes), the codes of sub-blocks 2c and 2c + 1 in the
    low and high nibbles of 32 bytes. A plain min/max fit (llama.cpp's quantizer searches its scales further)."""
    shape = data.shape
    x = np.asarray(data, dtype=np.float32).reshape(-1, 8, 32)
    lo, hi = np.minimum(x.min(-1), 0.0), np.maximum(x.max(-1), 0.0)
    scale, mins = (hi - lo) / 15.0, -lo
    d = (scale.max(-1) / 63.0).astype(np.float16)
    dmin = (mins.max(-1) / 63.0).astype(np.float16)

    def six_bits(values, step):
        step = step.astype(np.float32)[:, None]
        return np.where(step > 0, np.rint(values / np.where(step > 0, step, 1)), 0).clip(0, 63).astype(np.uint8)

    sc, mn = six_bits(scale, d), six_bits(mins, dmin)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    offset = (dmin.astype(np.float32)[:, None] * mn)[..., None]
    q = np.where(step > 0, np.rint((x + offset) / np.where(step > 0, step, 1)), 0).clip(0, 15).astype(np.uint8)
    n = x.shape[0]
    scales = np.empty((n, 12), dtype=np.uint8)
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    codes = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), scales, codes], 1)
    return blocks.reshape(*shape[:-1], shape[-1] // 256 * 144)


def gguf_tensors(model, mla_legacy: bool = False):
    """(llama.cpp name, float32 array) of a transformers MoE model as the converter writes it: each layer's experts
    stacked [E, rows, cols] (gate and up apart), Mixtral's q/k rows permuted; gpt-oss's experts transposed from x @ W
    to rows, their interleaved gate and up rows (and biases) apart; DeepSeek's kv_b_proj split per head into attn_k_b
    [heads, rank, nope] (transposed) and attn_v_b [heads, v, rank] (mla_legacy: kept whole as attn_kv_b), its router's
    score-correction bias as exp_probs_b."""
    cfg = model.config
    arch = GGUF_ARCH[type(model).__name__]
    names = GPT_OSS_NAMES if arch == "gpt-oss" else GGUF_NAMES
    tied = cfg.tie_word_embeddings
    for name, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy()
        if name == "lm_head.weight":
            if not tied:
                yield "output.weight", data
            continue
        if name == "model.embed_tokens.weight":
            yield "token_embd.weight", data
            continue
        if name == "model.norm.weight":
            yield "output_norm.weight", data
            continue
        _, _, layer, *rest = name.split(".")
        kind, suffix = ".".join(rest[:-1]), rest[-1]
        if arch == "gpt-oss" and kind == "mlp.experts":  # [E, H, 2I] and [E, I, H] as x @ W multiplies them
            if suffix == "gate_up_proj":
                rows = data.transpose(0, 2, 1)
                yield f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(rows[:, 0::2])
                yield f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(rows[:, 1::2])
            elif suffix == "gate_up_proj_bias":
                yield f"blk.{layer}.ffn_gate_exps.bias", np.ascontiguousarray(data[:, 0::2])
                yield f"blk.{layer}.ffn_up_exps.bias", np.ascontiguousarray(data[:, 1::2])
            elif suffix == "down_proj":
                yield f"blk.{layer}.ffn_down_exps.weight", np.ascontiguousarray(data.transpose(0, 2, 1))
            else:
                yield f"blk.{layer}.ffn_down_exps.bias", data
            continue
        if kind == "self_attn" and suffix == "sinks":
            yield f"blk.{layer}.attn_sinks.weight", data
            continue
        if suffix == "gate_up_proj":  # transformers 5 holds each layer's experts fused: [E, 2I, H]
            inter = data.shape[1] // 2
            yield f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(data[:, :inter])
            yield f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(data[:, inter:])
            continue
        if suffix == "down_proj":
            yield f"blk.{layer}.ffn_down_exps.weight", data
            continue
        if suffix == "e_score_correction_bias":
            yield f"blk.{layer}.exp_probs_b.bias", data
            continue
        if kind == "self_attn.kv_b_proj" and not mla_legacy:
            nope, v_dim = cfg.qk_nope_head_dim, cfg.v_head_dim
            kv_b = data.reshape(cfg.num_attention_heads, nope + v_dim, -1)
            yield f"blk.{layer}.attn_k_b.weight", np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1))
            yield f"blk.{layer}.attn_v_b.weight", np.ascontiguousarray(kv_b[:, nope:])
            continue
        if arch == "llama" and kind == "self_attn.q_proj":
            data = permute_for_llamacpp(data, cfg.num_attention_heads)
        elif arch == "llama" and kind == "self_attn.k_proj":
            data = permute_for_llamacpp(data, cfg.num_key_value_heads)
        yield f"blk.{layer}.{names[kind]}.{suffix}", data


def write_gguf(
    model, path: str, gguf_type: str = "f32", source_gguf: str | None = None, mla_legacy: bool = False
) -> None:
    """A transformers Mixtral, Qwen2-MoE, Qwen3-MoE or DeepSeek-V2 / V3 model as llama.cpp's converter writes it
    (the module's docstring); source_gguf: a GGUF whose tokenizer metadata is copied (None: a placeholder
    vocabulary of the model's size, enough to load the weights); mla_legacy: DeepSeek's attention in the older
    layout (attn_kv_b, the heads' own key and value lengths)."""
    import gguf

    cfg = model.config
    arch = GGUF_ARCH[type(model).__name__]
    if arch == "deepseek2":
        w = gguf.GGUFWriter(path, arch)
        deepseek_metadata(w, cfg, mla_legacy)
        return _finish_gguf(w, model, gguf_type, source_gguf, mla_legacy)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"{arch}-shaped (random weights)")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    w.add_expert_count(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch == "gpt-oss":
        w.add_expert_feed_forward_length(cfg.intermediate_size)
    elif arch != "llama":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch == "gpt-oss":
        rope = cfg.rope_parameters
        w.add_sliding_window(cfg.sliding_window)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    return _finish_gguf(w, model, gguf_type, source_gguf)


def deepseek_metadata(w, cfg, mla_legacy: bool = False) -> None:
    """llama.cpp's deepseek2 keys of a DeepSeek-V2 / V3 config: MLA written as one KV head of kv_lora_rank + rope
    (key_length_mla / value_length_mla the heads' own), or, mla_legacy, with the heads' key and value lengths."""
    import gguf

    rope, nope, v_dim, rank = cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    w.add_name("deepseek2-shaped (random weights)")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(rank)
    if mla_legacy:
        w.add_head_count_kv(cfg.num_attention_heads)
        w.add_key_length(nope + rope)
        w.add_value_length(v_dim)
    else:
        w.add_head_count_kv(1)
        w.add_key_length(rank + rope)
        w.add_value_length(rank)
        w.add_key_length_mla(nope + rope)
        w.add_value_length_mla(v_dim)
    w.add_rope_dimension_count(rope)
    params = cfg.rope_parameters
    w.add_rope_freq_base(float(params["rope_theta"]))
    if params.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(params["factor"])
        w.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(float(params.get("beta_fast", 32)))
        w.add_rope_scaling_yarn_beta_slow(float(params.get("beta_slow", 1)))
        if params.get("mscale_all_dim"):
            w.add_rope_scaling_yarn_log_mul(0.1 * params["mscale_all_dim"])
    v3 = type(cfg).__name__ == "DeepseekV3Config"
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        w.add_expert_weights_norm(True)
    scoring = getattr(cfg, "scoring_func", None) or ("sigmoid" if v3 else "softmax")
    w.add_expert_gating_func(gguf.ExpertGatingFuncType[scoring.upper()])
    if cfg.n_group:
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)


def _finish_gguf(w, model, gguf_type: str, source_gguf: str | None, mla_legacy: bool = False) -> None:
    """The file type, the tokenizer, the tensors (in gguf_type where their widths allow), and the file written."""
    import gguf
    from gguf.quants import quantize

    cfg = model.config
    w.add_file_type(gguf.LlamaFileType[GGUF_TYPES[gguf_type]])
    if source_gguf is not None:
        copy_tokenizer_metadata(w, source_gguf)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
        w.add_bos_token_id(cfg.bos_token_id if cfg.bos_token_id is not None else 1)
        w.add_eos_token_id(cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else 2)
    for name, data in gguf_tensors(model, mla_legacy):
        kept = data.ndim < 2 or name.split(".")[-2] in FLOAT32_KEPT or name.endswith(".bias") or data.shape[-1] % 32
        if (
            gguf_type == "mxfp4"
            and name.split(".")[-2] in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
            and not kept
        ):
            w.add_tensor(name, mxfp4(data)[0], raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        elif kept or gguf_type in ("f32", "mxfp4"):
            w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        elif gguf_type == "q4_k" and data.shape[-1] % 256 == 0:
            w.add_tensor(name, quantize_q4_k(data), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
        else:
            qtype = gguf.GGMLQuantizationType["Q8_0" if gguf_type == "q4_k" else gguf_type.upper()]
            w.add_tensor(name, quantize(np.ascontiguousarray(data), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def add_published_router_keys(path: str) -> None:
    """config.json gains the router keys DeepSeek-V3's published config.json spells out (topk_method "noaux_tc",
    scoring_func "sigmoid"), which transformers' DeepseekV3Config implies and leaves out of what it saves; vLLM
    builds the router's score-correction bias only where topk_method says noaux_tc."""
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    config.setdefault("topk_method", "noaux_tc")
    config.setdefault("scoring_func", "sigmoid")
    with open(file, "w") as f:
        json.dump(config, f, indent=2)


def active_parameters(model) -> int:
    """Parameters a token reads: everything but the experts it is not routed to (and the embedding table, of which
    it reads a row)."""
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    count = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or cfg.n_routed_experts
    unused = experts * (1 - cfg.num_experts_per_tok / count)
    return int(total - unused - model.model.embed_tokens.weight.numel())


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.family == "deepseek-v3":
        print("\n".join(kv_report(args)))
        if args.kv_report:
            return 0
    import torch

    from petrel.model.loader import resolve_model
    from petrel.model.tokenizer import load_tokenizer

    t0 = time.perf_counter()
    source = resolve_model(None)
    tokenizer = load_tokenizer(source)
    model = build_model(args, tokenizer)
    n_params, active = sum(p.numel() for p in model.parameters()), active_parameters(model)
    print(
        f"built {n_params / 1e9:.3f} B parameters, {active / 1e9:.3f} B read per token (vocab {len(tokenizer)}) "
        f"in {time.perf_counter() - t0:.0f} s"
    )
    os.makedirs(args.out, exist_ok=True)
    if not args.no_gguf:  # before the bf16 copy rounds the weights
        stem = "deepseek" if args.family == "deepseek-v3" else "moe"
        path = os.path.join(args.out, f"{stem}-{args.gguf_type}.gguf")
        write_gguf(model, path, args.gguf_type, source.path)
        print(f"wrote {path}")
    if args.family == "gpt-oss":  # the published layout: experts in MXFP4 (the GGUF above holds the same blocks)
        save_gpt_oss_mxfp4(model, os.path.join(args.out, "fp32"))
        tokenizer.save_pretrained(os.path.join(args.out, "fp32"))
        print(f"wrote {os.path.join(args.out, 'fp32')}")
    for sub, dtype in (("fp32", torch.float32), *(() if args.no_bf16 else (("bf16", torch.bfloat16),))):
        if args.family == "gpt-oss":
            break
        model.to(dtype).save_pretrained(os.path.join(args.out, sub), safe_serialization=True)
        tokenizer.save_pretrained(os.path.join(args.out, sub))
        if args.family == "deepseek-v3":
            add_published_router_keys(os.path.join(args.out, sub))
        print(f"wrote {os.path.join(args.out, sub)}")
    with open(os.path.join(args.out, "README.json"), "w") as f:
        info = {"built_by": "benchmarks/make_moe.py", "args": vars(args), "parameters": n_params, "active": active}
        json.dump(info, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
