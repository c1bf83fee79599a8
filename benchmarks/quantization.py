"""Quantized weights vs the dequantized path: W1 and W2 for quantization none / int8 / gguf in one run.

    python benchmarks/quantization.py                      # W1 256 tokens x 2 runs, W2 trimmed (see --w2-*)
    python benchmarks/quantization.py --modes none,gguf --w1-tokens 64 --w2-requests 8

Each mode runs in a child process of its own, so its resident memory is its own: weight MB (parameters and
quantized codes and scales, tied tensors once) and the process RSS after loading and after the workloads.
W1 is petrel bench's W1 (chat prompt, greedy, exactly N tokens, decode tok/s between first and last token);
W2 is petrel bench's W2 prompts (numpy default_rng(0)), trimmed by default to keep the run short on a shared
machine: --w2-requests prompts of at most --w2-max-prompt-len tokens, --w2-tokens new tokens each.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def child(args) -> dict:
    from petrel import bench
    from petrel.model.quantization import weight_bytes

    runner_args = argparse.Namespace(
        dtype=args.dtype,
        model=args.model,
        max_num_seqs=None,
        max_num_batched_tokens=None,
        kv_cache_memory=args.kv_cache_memory,
        num_threads=args.num_threads,
        block_size=None,
        no_prefix_caching=False,
        quantization=args.child,
    )
    runner = bench.PetrelRunner(runner_args)
    model = runner.llm.engine.core.runner.model
    result = {
        "mode": args.child,
        "load_s": runner.load_s,
        "weight_mb": weight_bytes(model) / 2**20,
        "rss_loaded_mb": rss_mb(),
    }
    prompt = bench.w1_prompt_ids(runner.tokenizer)
    runner.warmup(prompt)
    sizes = bench.Sizes(w1_new_tokens=args.w1_tokens, w1_runs=args.w1_runs)
    w1 = bench.run_w1(runner, prompt, sizes)
    result.update(
        w1_decode_tok_s=w1["decode_tok_s"], w1_ttft_s=w1["ttft_s"], w1_ids=w1["_output_ids"], w1_problems=w1["problems"]
    )
    prompts = bench.make_w2_prompts(args.w2_requests, args.w2_max_prompt_len)
    w2 = bench.run_batch(runner, prompts, args.w2_tokens, "w2")
    result.update(
        w2_output_tok_s=w2["output_tok_s"],
        w2_total_tok_s=w2["total_tok_s"],
        w2_wall_s=w2["wall_s"],
        w2_problems=w2["problems"],
        rss_end_mb=rss_mb(),
    )
    runner.close()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="none,int8,gguf")
    ap.add_argument("--model", default=None, help="a .gguf file (default: petrel's default model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--kv-cache-memory", type=int, default=512 * 2**20)
    ap.add_argument("--w1-tokens", type=int, default=256)
    ap.add_argument("--w1-runs", type=int, default=2)
    ap.add_argument("--w2-requests", type=int, default=32)
    ap.add_argument("--w2-max-prompt-len", type=int, default=256)
    ap.add_argument("--w2-tokens", type=int, default=64)
    ap.add_argument("--out", default=None, help="also write the results as JSON")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    results = []
    argv = sys.argv[1:]  # every option but --modes (as "--modes X" or "--modes=X") goes to the children
    passthrough = [
        a for i, a in enumerate(argv) if not a.startswith("--modes") and (i == 0 or argv[i - 1] != "--modes")
    ]
    for mode in args.modes.split(","):
        print(f"[quantization bench] {mode} ...", file=sys.stderr, flush=True)
        done = subprocess.run(
            [sys.executable, __file__, *passthrough, "--child", mode], check=True, stdout=subprocess.PIPE, text=True
        )
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    ref = results[0]
    print(
        f"\n{time.strftime('%Y-%m-%d')}, threads {args.num_threads}, dtype {args.dtype}; W1 {args.w1_tokens} tokens "
        f"x {args.w1_runs} runs (median); W2 {args.w2_requests} prompts <= {args.w2_max_prompt_len} tokens "
        f"x {args.w2_tokens} new\n"
    )
    print(
        "| quantization | weight MB | RSS loaded MB | RSS end MB | load s | W1 decode tok/s | W1 TTFT ms "
        f"| W2 output tok/s | W2 total tok/s | W1 tokens equal to {ref['mode']} |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        same = sum(a == b for a, b in zip(r["w1_ids"], ref["w1_ids"]))
        problems = "; ".join(r["w1_problems"] + r["w2_problems"])
        print(
            f"| {r['mode']} | {r['weight_mb']:.0f} | {r['rss_loaded_mb']:.0f} | {r['rss_end_mb']:.0f} | "
            f"{r['load_s']:.1f} | {r['w1_decode_tok_s']:.1f} | {1000 * r['w1_ttft_s']:.0f} | "
            f"{r['w2_output_tok_s']:.1f} | {r['w2_total_tok_s']:.1f} | {same}/{len(ref['w1_ids'])} |"
            + (f" problems: {problems}" if problems else "")
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
