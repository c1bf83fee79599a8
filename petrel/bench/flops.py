"""The arithmetic side of `petrel bench compare`: how fast this machine multiplies fp32 matrices (torch, 2 threads),
and how many multiply-adds W2 needs on the default model, so each engine's W2 wall time reads as a share of
the machine's peak."""

from __future__ import annotations

import time


def matmul_peak_gflops(threads: int = 2, n: int = 2048, repeats: int = 10) -> float:
    """The best of `repeats` n x n fp32 matmuls on `threads` torch threads, in GFLOP/s."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        for _ in range(3):
            a @ b
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t)
        return 2 * n**3 / best / 1e9
    finally:
        torch.set_num_threads(before)


def w2_matmul_flops(model: str | None = None, num_requests: int | None = None) -> float:
    """The multiply-adds W2 needs (x2) on `model` (default: the default model) with its first `num_requests` prompts
    (default: all 64): every prompt and output position through every linear layer, attention's two products over
    its context, and the LM head for the output tokens only (prompt positions need no logits)."""
    from petrel.bench.workloads import W2_NUM_REQUESTS, make_w2_prompts
    from petrel.model.config import ModelConfig
    from petrel.model.loader import load_model_config, resolve_model

    cfg: ModelConfig = load_model_config(resolve_model(model))
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    q = cfg.num_attention_heads * cfg.head_dim
    per_layer = h * q + 2 * h * kv + q * h + mlp_multiply_adds(cfg)
    new = 128
    total = 0.0
    for prompt in make_w2_prompts(num_requests or W2_NUM_REQUESTS):
        positions = len(prompt) + new - 1  # the last sampled token is never fed back
        contexts = positions * (positions + 1) / 2  # sum over positions of the context each attends to
        total += 2 * per_layer * cfg.num_hidden_layers * positions
        total += 2 * 2 * q * cfg.num_hidden_layers * contexts
        total += 2 * h * cfg.vocab_size * new
    return total


def mlp_multiply_adds(cfg) -> float:
    """A token's multiply-adds in one layer's MLP, averaged over the layers: a dense MLP's 3 h I; a mixture of
    experts' router and the experts it takes (top-k of moe_intermediate_size, and the shared expert with its gate)
    in its sparse layers."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    dense = 3 * h * cfg.intermediate_size
    if not cfg.num_experts:
        return dense
    sparse = h * cfg.num_experts + 3 * h * cfg.moe_intermediate_size * cfg.num_experts_per_tok
    if cfg.shared_expert_intermediate_size:
        sparse += 3 * h * cfg.shared_expert_intermediate_size + h
    return (len(cfg.dense_layers) * dense + (layers - len(cfg.dense_layers)) * sparse) / layers


def memory_read_gbs(mib: int = 512, repeats: int = 3) -> float:
    """This machine's memory read bandwidth as torch sees it (GB/s): the best of `repeats` sums over a float32
    tensor of `mib` MiB, far larger than any cache, with torch's threads."""
    import time

    import torch

    x = torch.ones(mib * 2**20 // 4)
    x.sum()  # touch every page first
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def decode_weight_bytes(model_dir: str, expert_share: float | None = None) -> int:
    """The bytes of weights one decode step reads from a Hugging Face directory's safetensors files: every tensor
    once, the routed experts' by expert_share (the share of them the step reads; default a token's,
    num_experts_per_tok of the routed count), the input embedding table by one row unless the head shares it. The
    memory bound of a decode step is this over the machine's read bandwidth (memory_read_gbs); the key-value cache
    read beside it is left out."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    root = Path(model_dir)
    cfg = json.loads((root / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    experts = next((cfg[k] for k in ("n_routed_experts", "num_local_experts", "num_experts") if cfg.get(k)), 0)
    picked = cfg.get("num_experts_per_tok", 0) / experts if experts else 1.0
    picked = picked if expert_share is None else expert_share
    total = 0.0
    for path in sorted(root.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                shape = sl.get_shape()
                nbytes = _dtype_bytes(sl.get_dtype())
                for d in shape:
                    nbytes *= d
                if ".experts." in name and "shared_expert" not in name:
                    nbytes *= picked
                elif "embed_tokens" in name and not cfg.get("tie_word_embeddings", False):
                    nbytes /= shape[0]
                total += nbytes
    return int(total)


def _dtype_bytes(name: str) -> float:
    return {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "U8": 1, "I8": 1}.get(name, 4)
