"""`petrel bench`: petrel and Hugging Face transformers in this process, side by side, on W1, W2 and W4.

    petrel bench                       # W1 + W2, petrel and transformers, float32
    petrel bench --workloads w1,w2,w4 --out results.json
    petrel bench --quick --engines petrel   # a smoke test (seconds, not minutes)
    petrel bench latency | throughput | prefix [options]     # W1 / W2 / W4 alone
    petrel bench --engines petrel --workloads w6 [--quick]   # W6, long contexts (petrel only)

The workloads are those of petrel/bench/workloads.py. W1: TTFT and decode tok/s = (n - 1) / (t_last - t_first)
from timestamps taken as each token streams in. W2: all 64 prompts submitted at once (transformers: left-padded,
length-sorted batches of --hf-batch-size); wall time, output tok/s, (prompt + output) tok/s. W4: submitted at once;
wall time and prompt tokens served from petrel's prefix cache (RequestOutput.num_cached_tokens); transformers has
no prefix cache and runs the same prompts as batches of --hf-batch-size. W6 (petrel only): the plan of
workloads.w6_plan for this model and KV budget (stated in the result), its batch submitted at once and streamed,
then its long request; TTFT per request, decode tok/s and the decode's achieved KV read bandwidth
(report.w6_metrics) next to this machine's measured memory read bandwidth.

Every figure is checked: a request that did not produce exactly the requested number of tokens makes its
workload's figure invalid ("valid": false, with the problem named), and no ratio is formed from it.

Output: one JSON object per line on stdout for each (engine, workload), then one per ratio
(petrel / transformers); progress goes to stderr. --out FILE writes everything as one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from dataclasses import asdict, replace

from petrel.bench.report import count_problems, log, matching_prefix, median, ratio, summary, w6_metrics
from petrel.bench.runners import HFRunner, PetrelRunner
from petrel.bench.workloads import (
    DTYPE_BYTES,
    FULL,
    QUICK,
    W1_REFERENCE_IDS,
    Sizes,
    W6Plan,
    kv_bytes_per_token,
    make_w2_prompts,
    make_w4_prompts,
    make_w6_prompts,
    w1_prompt_ids,
    w6_plan,
)
from petrel.cli_options import parallel_arguments, parse_choices

WORKLOADS = ("w1", "w2", "w4", "w6")
ENGINES = ("petrel", "hf")
ENGINE_LABELS = {"petrel": "petrel", "hf": "hf-transformers"}
SUBCOMMANDS = {"latency": "w1", "throughput": "w2", "prefix": "w4"}


# ---------------------------------------------------------------------------------------------- one workload


def run_w1(runner, prompt_ids: list[int], sizes: Sizes) -> dict:
    """W1 `sizes.w1_runs` times on one engine: the median figures, each run's, and whether every run counts."""
    n = sizes.w1_new_tokens
    runs, problems, output_ids = [], [], []
    for r in range(sizes.w1_runs):
        m, ids = runner.w1(prompt_ids, n, r)
        runs.append(m)
        output_ids = ids
        counts = [m["new_tokens"], len(ids)]
        if any(c != n for c in counts):
            problems.append(f"run {r}: {m['new_tokens']} tokens streamed, {len(ids)} returned, expected {n}")
        log(
            f"  {runner.name} w1 run {r}: TTFT {1000 * (m['ttft_s'] or float('nan')):.1f} ms, "
            f"decode {m['decode_tok_s'] or float('nan'):.2f} tok/s, {m['new_tokens']} tokens"
        )
    return {
        "prompt_tokens": len(prompt_ids),
        "new_tokens": n,
        "num_runs": len(runs),
        "ttft_s": median(r["ttft_s"] for r in runs),
        "decode_tok_s": median(r["decode_tok_s"] for r in runs),
        "total_s": median(r["total_s"] for r in runs),
        "runs": runs,
        "output_ids_first32": output_ids[:32],
        "_output_ids": output_ids,
        "problems": problems,
    }


def run_batch(runner, prompts: list[list[int]], n: int, tag: str) -> dict:
    """W2 or W4 (`tag`) on one engine: every prompt at once, `n` new tokens each; throughput and cache figures."""
    res = runner.batch(prompts, n, tag)
    prompt_tokens = sum(len(p) for p in prompts)
    out_tokens = sum(res["counts"])
    wall = res["wall_s"]
    result = {
        "num_requests": len(prompts),
        "new_tokens": n,
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "expected_output_tokens": n * len(prompts),
        "wall_s": wall,
        "output_tok_s": out_tokens / wall,
        "total_tok_s": (prompt_tokens + out_tokens) / wall,
        "problems": count_problems(res["counts"], n),
    }
    if "padded_prompt_tokens" in res:
        result["padded_prompt_tokens"] = res["padded_prompt_tokens"]
    result["cached_prompt_tokens"] = sum(res["cached"])
    if tag == "w4":
        result["cached_per_request_min"] = min(res["cached"])
        result["cached_per_request_max"] = max(res["cached"])
    log(
        f"  {runner.name} {tag}: wall {wall:.2f}s, {result['output_tok_s']:.1f} output tok/s, "
        f"{result['total_tok_s']:.1f} total tok/s, cached prompt tokens {result['cached_prompt_tokens']}"
    )
    return result


def plan_w6(model_config, args, sizes: Sizes) -> W6Plan:
    """W6's plan for this model (its vocabulary, context and KV bytes per token of --dtype's cache) and petrel's KV
    budget (--kv-cache-memory, else EngineConfig's default on CPU)."""
    from petrel.config import CPU_KV_CACHE_MEMORY, EngineConfig

    defaults = EngineConfig.__dataclass_fields__
    budget = args.kv_cache_memory or CPU_KV_CACHE_MEMORY
    block = args.block_size or defaults["block_size"].default
    kv = kv_bytes_per_token(
        model_config.num_hidden_layers,
        model_config.num_key_value_heads,
        model_config.head_dim,
        DTYPE_BYTES.get(EngineConfig(dtype=args.dtype).kv_cache_dtype, 4),  # the cache's dtype
    )
    return w6_plan(model_config.vocab_size, model_config.max_position_embeddings, budget, kv, sizes, block)


def run_w6(runner, plan: W6Plan, mem_gb_s: float | None) -> dict:
    """W6 on petrel: the batch submitted at once and streamed, then the long request alone."""
    batch, long = make_w6_prompts(plan)
    body = {"plan": asdict(plan), "memory_read_gb_s": mem_gb_s, "problems": []}
    for key, prompts in (("batch", batch), ("long", [long])):
        m = w6_metrics(runner.streams(prompts, plan.new_tokens, f"w6-{key}"), plan.kv_bytes_per_token)
        body["problems"] += [f"{key}: {p}" for p in count_problems(m["new_tokens"], plan.new_tokens)]
        if mem_gb_s and m["kv_read_gb_s"]:
            m["kv_read_share_of_memory_bw"] = m["kv_read_gb_s"] / mem_gb_s
        body[key] = m
        ttft = ", ".join(f"{t:.2f}" for t in m["ttft_s"] if t is not None)
        log(
            f"  {runner.name} w6 {key}: {len(prompts)} x {len(prompts[0])} prompt tokens, TTFT {ttft} s, decode "
            f"{m['decode_tok_s'] or float('nan'):.2f} tok/s, KV read {m['kv_read_gb_s'] or float('nan'):.2f} GB/s"
        )
    return body


# ---------------------------------------------------------------------------------------------- the run


def _git_commit() -> str | None:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        return (commit + ("-dirty" if dirty else "")) or None
    except Exception:  # noqa: BLE001 - not a git checkout
        return None


def _ratios(workloads: list[str], by_key: dict) -> list[dict]:
    """petrel / transformers for each workload: decode tok/s for W1, output tok/s for W2 and W4."""
    ratios = []
    for workload in workloads:
        a, b = by_key.get(("petrel", workload)), by_key.get(("hf", workload))
        if workload == "w1":
            extra = {
                "ttft_s_ratio": (a["ttft_s"] / b["ttft_s"]) if a["ttft_s"] and b["ttft_s"] else None,
                "greedy_matching_prefix_tokens": matching_prefix(a["_output_ids"], b["_output_ids"]),
            }
            ratios.append(ratio("w1", "decode_tok_s", a, b, extra))
        else:
            extra = {
                "total_tok_s_ratio": a["total_tok_s"] / b["total_tok_s"],
                "wall_s_ratio": a["wall_s"] / b["wall_s"],
            }
            ratios.append(ratio(workload, "output_tok_s", a, b, extra))
    return ratios


def run(args) -> dict:
    """Run the benchmark for parsed options; returns the whole result document."""
    import torch
    import transformers

    from petrel.model.loader import load_model_config, resolve_model
    from petrel.model.tokenizer import load_tokenizer

    workloads = parse_choices(args.workloads, WORKLOADS, "workload")
    engines = parse_choices(args.engines, ENGINES, "engine")
    sizes = QUICK if args.quick else FULL
    if args.w1_runs is not None:
        sizes = replace(sizes, w1_runs=args.w1_runs)
    if args.w2_requests is not None:
        sizes = replace(sizes, w2_num_requests=args.w2_requests)

    source = resolve_model(args.model)
    tokenizer = load_tokenizer(source)
    w1_ids = w1_prompt_ids(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    prompts = {
        "w2": make_w2_prompts(sizes.w2_num_requests, sizes.w2_max_prompt_len),
        "w4": make_w4_prompts(sizes.w4_num_requests, sizes.w4_prefix_len, sizes.w4_suffix_len),
    }
    plan6 = mem_gb_s = None
    if "w6" in workloads:
        from petrel.bench.flops import memory_read_gbs

        plan6 = plan_w6(load_model_config(source), args, sizes)
        for note in plan6.notes:
            log(f"W6: {note}")
        mem_gb_s = args.mem_bandwidth or memory_read_gbs()

    doc = {
        "meta": {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "quick": bool(args.quick),
            "sizes": asdict(sizes),
            "dtype": args.dtype,
            "model": source.path,
            "model_kind": source.kind,
            "w1_prompt_tokens": len(w1_ids),
            "w1_prompt_matches_peers": w1_ids == W1_REFERENCE_IDS if args.model is None else None,
            "git_commit": _git_commit(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cpu_count": os.cpu_count(),
            "machine": platform.machine(),
            "engines": {},
        },
        "results": [],
        "ratios": [],
    }

    runners = {}
    try:
        for name in engines:
            log(f"loading {ENGINE_LABELS[name]} ...")
            runners[name] = PetrelRunner(args) if name == "petrel" else HFRunner(args, source.path, pad)
            info = runners[name].info()
            info["torch_threads"] = torch.get_num_threads()
            info["warmup_s"] = runners[name].warmup(w1_ids)
            doc["meta"]["engines"][name] = info
            log(f"{ENGINE_LABELS[name]}: loaded in {info['load_s']:.1f}s, warm-up {info['warmup_s']:.1f}s")

        by_key = {}
        for workload in workloads:
            for name in engines:  # engines alternate workload by workload, so drifting load hits both alike
                runner = runners[name]
                if workload == "w6" and name != "petrel":
                    log(f"{ENGINE_LABELS[name]} w6: left out (W6 runs on petrel only in this process)")
                    continue
                log(f"{ENGINE_LABELS[name]} {workload} ...")
                if workload == "w6":
                    body = run_w6(runner, plan6, mem_gb_s)
                elif workload == "w1":
                    body = run_w1(runner, w1_ids, sizes)
                elif workload == "w2":
                    body = run_batch(runner, prompts["w2"], sizes.w2_new_tokens, "w2")
                else:
                    body = run_batch(runner, prompts["w4"], sizes.w4_new_tokens, "w4")
                result = {
                    "engine": ENGINE_LABELS[name],
                    "workload": workload,
                    "dtype": args.dtype,
                    "quick": bool(args.quick),
                    "valid": not body["problems"],
                    **body,
                }
                if not result["valid"]:
                    log(f"{ENGINE_LABELS[name]} {workload}: FIGURE DOES NOT COUNT: {'; '.join(body['problems'])}")
                by_key[(name, workload)] = result
                doc["results"].append(result)
                print(json.dumps({k: v for k, v in result.items() if not k.startswith("_")}), flush=True)
    finally:
        for runner in runners.values():
            runner.close()

    if "petrel" in engines and "hf" in engines:
        doc["ratios"] = _ratios([w for w in workloads if w != "w6"], by_key)
        for r in doc["ratios"]:
            print(json.dumps(r), flush=True)
    for result in doc["results"]:
        result.pop("_output_ids", None)
    doc["all_valid"] = all(r["valid"] for r in doc["results"])
    return doc


# ---------------------------------------------------------------------------------------------- options


def byte_size(text: str) -> int:
    """Bytes, with an optional K/M/G suffix (powers of 1024): 2G, 512M, 2147483648."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
    number = text[:-1] if scale != 1 else text
    try:
        return int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use bytes or e.g. 512M, 2G)") from None


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--workloads",
        default="w1,w2",
        help="comma-separated, from w1,w2,w4,w6 (default: w1,w2); "
        "or a subcommand: latency (W1), throughput (W2), prefix (W4), serve (W3, its own options)",
    )
    parser.add_argument("--engines", default="petrel,hf", help="comma-separated, from petrel,hf (default: both)")
    parser.add_argument("--dtype", default="float32", help="model dtype for both engines (default: float32)")
    parser.add_argument(
        "--model", default=None, help="a .gguf file or Hugging Face directory (default: petrel's default GGUF)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a shrunken smoke test: W1 {QUICK.w1_new_tokens} tokens x {QUICK.w1_runs} run, "
        f"W2 {QUICK.w2_num_requests} prompts (<= {QUICK.w2_max_prompt_len} tokens) x "
        f"{QUICK.w2_new_tokens} new, W4 {QUICK.w4_num_requests} x ({QUICK.w4_prefix_len}+"
        f"{QUICK.w4_suffix_len}) x {QUICK.w4_new_tokens} new, W6 {QUICK.w6_num_requests} x "
        f"{QUICK.w6_prompt_len} + {QUICK.w6_new_tokens} new, long context <= {QUICK.w6_max_long_context}",
    )
    parser.add_argument(
        "--mem-bandwidth",
        type=float,
        default=None,
        metavar="GB/s",
        help="this machine's memory bandwidth for W6's KV-bandwidth share (default: measured: a torch sum, 512 MiB)",
    )
    parser.add_argument(
        "--w1-runs",
        type=int,
        default=None,
        help=f"timed W1 runs per engine, median reported (default: {FULL.w1_runs}, quick: 1)",
    )
    parser.add_argument(
        "--w2-requests", type=int, default=None, metavar="N", help="W2 with its first N prompts (default: all 64)"
    )
    parser.add_argument(
        "--json", "--out", dest="out", default=None, metavar="FILE.json", help="also write all results to this file"
    )
    group = parser.add_argument_group("petrel engine options")
    group.add_argument("--max-num-seqs", type=int, default=None)
    group.add_argument("--max-num-batched-tokens", type=int, default=None)
    group.add_argument("--kv-cache-memory", type=byte_size, default=None, help="bytes, or e.g. 2G, 512M")
    group.add_argument("--block-size", type=int, default=None)
    group.add_argument("--num-threads", type=int, default=None, help="torch threads (applies to both engines)")
    group.add_argument("--no-prefix-caching", action="store_true")
    group.add_argument(
        "--quantization",
        default=None,
        choices=["none", "int8", "gguf", "bf16"],
        help="petrel's weights kept quantized (see benchmarks/quantization.py for all three at once)",
    )
    parallel_arguments(group)
    group = parser.add_argument_group("transformers options")
    group.add_argument(
        "--hf-batch-size", type=int, default=16, help="batch size for W2/W4 (left-padded, length-sorted; default: 16)"
    )
    return parser


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    return add_arguments(
        argparse.ArgumentParser(
            prog=prog, description="Benchmark petrel against Hugging Face transformers (same process, same run)."
        )
    )


def main(argv: list[str]) -> int:
    """`petrel bench [latency|throughput|prefix] [options]`: 0 when every figure counts, 1 otherwise. The
    subcommands run W1 / W2 / W4 alone (the same as --workloads w1 / w2 / w4)."""
    argv = list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        name = argv.pop(0)
        args = build_parser(f"petrel bench {name}").parse_args(argv + ["--workloads", SUBCOMMANDS[name]])
        return run_parsed(args)
    return run_parsed(build_parser("petrel bench").parse_args(argv))


def run_parsed(args: argparse.Namespace) -> int:
    """For a CLI that parsed the options itself (a subparser filled by add_arguments): run, save, summarize."""
    doc = run(args)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        log(f"saved {args.out}")
    summary(doc)
    return 0 if doc["all_valid"] else 1
