"""A Llama-3.2-1B-shaped model with random weights, for benchmarks (speed does not depend on the values).

    python benchmarks/make_llama_1b.py --out ~/petrel-peers/models/llama-1b           # the published 1B shapes
    python benchmarks/make_llama_1b.py --out /tmp/tiny --layers 2 --hidden 64 --heads 4 --kv-heads 2 \
        --intermediate 128                                                             # the same builder, tiny

Writes, under --out:
  fp32/                 a Hugging Face directory (config.json, model.safetensors in float32, tokenizer files)
  bf16/                 the same weights rounded to bfloat16 (config dtype bfloat16)
  llama-1b-f32.gguf     the fp32 weights as llama.cpp's converter lays them out (`--gguf-type f16|bf16` for others,
                        or q8_0|q4_0|q4_1: the matrices in GGUF blocks, by the gguf package's own quantizer)

The shapes are Llama-3.2-1B's (transformers' LlamaConfig: hidden 2048, 16 layers, 32 heads, 8 KV heads,
intermediate 8192, tied embeddings, rope theta 500000 with llama3 rope scaling, factor 32 over 8192 original
positions, context 131072) with ONE stated difference: the vocabulary is the default model's (SmolLM2's 49,152
ids, its tokenizer and chat template), not Llama 3's 128,256, because a benchmark needs a tokenizer that covers
every id the model can produce. The embedding and head are therefore 49152 x 2048 (100.7 M parameters) instead of
128256 x 2048 (262.7 M): 1.07 B parameters in all instead of 1.24 B. Weights are drawn from a normal distribution
of std --std (seeded), so logits stay small and greedy decoding is deterministic.

The GGUF is written with the `gguf` package as llama.cpp's convert_hf_to_gguf.py writes a Llama: architecture
"llama" and its metadata keys, tensor names token_embd / blk.N.attn_q ... / output_norm (no output.weight: tied),
q and k rows permuted to llama.cpp's rotary layout, the llama3 scaling as a rope_freqs.weight tensor of per-frequency
divisors, and the tokenizer metadata copied from the default model's GGUF.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

ROPE_THETA = 500000.0
GGUF_TYPES = {  # --gguf-type -> the file type llama.cpp records
    "f32": "ALL_F32",
    "f16": "MOSTLY_F16",
    "bf16": "MOSTLY_BF16",
    "q8_0": "MOSTLY_Q8_0",
    "q4_0": "MOSTLY_Q4_0",
    "q4_1": "MOSTLY_Q4_1",
}
GGUF_NAMES = {  # Hugging Face name (inside model.layers.N.) -> llama.cpp's
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--context", type=int, default=131072, help="max_position_embeddings (default 131072)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--std", type=float, default=0.02, help="std of the random weights (default 0.02)")
    p.add_argument("--gguf-type", default="f32", choices=[*GGUF_TYPES], help="the GGUF's 2-D tensors")
    p.add_argument("--no-bf16", action="store_true", help="skip the bf16 directory")
    p.add_argument("--no-gguf", action="store_true", help="skip the GGUF")
    args = p.parse_args(argv)
    if args.hidden % args.heads or args.heads % args.kv_heads or (args.hidden // args.heads) % 2:
        p.error("--hidden must split into --heads heads of even size, and --heads into --kv-heads groups")
    return args


def llama3_rope_scaling(context: int) -> dict:
    """Llama 3.2's rope scaling; the original context is the smaller of 8192 and half the model's."""
    return {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": min(8192, context // 2),
    }


def rope_freq_divisors(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """llama.cpp's rope_freqs tensor for llama3 scaling: per frequency, what the unscaled frequency is divided by
    (1 for short wavelengths, `factor` for long ones, a smooth blend between)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def build_model(args, tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=args.context,
        rms_norm_eps=1e-5,
        rope_theta=ROPE_THETA,
        rope_scaling=llama3_rope_scaling(args.context),
        tie_word_embeddings=True,
        initializer_range=args.std,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).float().eval()  # transformers' init: normal(0, initializer_range), norms at 1
    return model


def save_hf(model, tokenizer, path: str, dtype) -> None:
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


def copy_tokenizer_metadata(writer, source_gguf: str) -> None:
    """Every tokenizer.* key of the default model's GGUF (vocabulary, merges, special ids, chat template)."""
    import gguf

    reader = gguf.GGUFReader(source_gguf)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)


def permute_for_llamacpp(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Hugging Face's rotate-half q/k rows to llama.cpp's interleaved pairs (the inverse of petrel's unpermute)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path: str, source_gguf: str, gguf_type: str) -> None:
    """The model as llama.cpp's converter writes a Llama (see the module's docstring)."""
    import gguf
    from gguf.quants import quantize

    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    qtype = gguf.GGMLQuantizationType[gguf_type.upper()]
    file_type = gguf.LlamaFileType[GGUF_TYPES[gguf_type]]
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("llama-3.2-1b-shaped (random weights)")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(ROPE_THETA)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(file_type)
    copy_tokenizer_metadata(w, source_gguf)

    def add(name: str, tensor) -> None:
        data = tensor.detach().float().numpy()
        if data.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)  # the writer reads the shape off the bytes
        else:  # norms and rope_freqs stay float32, as llama.cpp's converter keeps 1-D tensors
            w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))

    import torch

    divisors = rope_freq_divisors(head_dim, ROPE_THETA, llama3_rope_scaling(cfg.max_position_embeddings))
    add("rope_freqs.weight", torch.from_numpy(divisors))
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        if name == "model.embed_tokens.weight":
            add("token_embd.weight", tensor)
        elif name == "model.norm.weight":
            add("output_norm.weight", tensor)
        else:
            _, _, layer, *rest = name.split(".")
            kind = ".".join(rest[:-1])
            data = tensor
            if kind == "self_attn.q_proj":
                data = torch.from_numpy(permute_for_llamacpp(tensor.float().numpy(), cfg.num_attention_heads))
            elif kind == "self_attn.k_proj":
                data = torch.from_numpy(permute_for_llamacpp(tensor.float().numpy(), cfg.num_key_value_heads))
            add(f"blk.{layer}.{GGUF_NAMES[kind]}.{rest[-1]}", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from petrel.model.loader import resolve_model
    from petrel.model.tokenizer import load_tokenizer

    t0 = time.perf_counter()
    source = resolve_model(None)
    tokenizer = load_tokenizer(source)
    model = build_model(args, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"built {n_params / 1e9:.3f} B parameters (vocab {len(tokenizer)}) in {time.perf_counter() - t0:.0f} s")
    os.makedirs(args.out, exist_ok=True)
    if not args.no_gguf:  # before the bf16 copy rounds the weights
        path = os.path.join(args.out, f"llama-1b-{args.gguf_type}.gguf")
        write_gguf(model, path, source.path, args.gguf_type)
        print(f"wrote {path}")
    save_hf(model, tokenizer, os.path.join(args.out, "fp32"), torch.float32)
    print(f"wrote {os.path.join(args.out, 'fp32')}")
    if not args.no_bf16:
        save_hf(model, tokenizer, os.path.join(args.out, "bf16"), torch.bfloat16)
        print(f"wrote {os.path.join(args.out, 'bf16')}")
    with open(os.path.join(args.out, "README.json"), "w") as f:
        json.dump({"built_by": "benchmarks/make_llama_1b.py", "args": vars(args), "parameters": n_params}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
