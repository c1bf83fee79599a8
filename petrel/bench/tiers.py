"""`petrel bench tiers`: W5 (petrel/bench/workloads.py), many shared prefixes through a KV cache that holds few
of them, with the KV tiers off, a host-memory tier, and host memory + disk. petrel only, in this process.

    petrel bench tiers                                 # W5 as defined: off, host, host+disk
    petrel bench tiers --quick                         # a smoke test (seconds)
    petrel bench tiers --tiers off,host --num-prefixes 16 --prefix-len 512 --out w5.json
    petrel bench tiers --tiers off,store --kv-store-url redis://127.0.0.1:6379/0   # a second instance's view

Each configuration gets a fresh engine (its KV cache sized to hold --cache-prefixes prefixes with their suffixes
and outputs), one warm-up request, then W5's requests in their random order, --concurrency at a time (a closed
loop: a request is sent when one ends). Reported per configuration: TTFT p50 / p99 (send to first streamed token),
wall time, output tok/s, requests/s, prompt tokens served from the cache or the tiers vs computed, and the tiers'
counters. Every request must produce exactly --new-tokens tokens, or the figure does not count.

'store': a first engine computes every prefix once and publishes it to the shared store (--kv-store-url), and is
shut down; then a second engine on the same store, with no local tiers, runs W5: what a second instance gains from
the first's work (compare with 'off', recomputation).

Tier sizes (unless given): 'host' holds every prefix's KV; 'host+disk' a host tier of a quarter of that over a
disk tier that holds all of it (in a temporary directory unless --disk-tier-path).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict, replace

from petrel.bench.report import count_problems, log, percentile
from petrel.bench.workloads import TOKEN_HIGH, W5_FULL, W5_QUICK, make_w5_prompts
from petrel.cli_options import byte_size, parse_choices

CONFIGS = ("off", "host", "host+disk", "store")


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--tiers", default="off,host,host+disk", help=f"comma-separated, from {','.join(CONFIGS)}")
    p.add_argument("--quick", action="store_true", help=f"a shrunken smoke test: {W5_QUICK}")
    p.add_argument("--model", default=None, help="a .gguf file or Hugging Face directory (default: petrel's default)")
    p.add_argument("--tokenizer", default=None, help="another tokenizer directory (default: the model's)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    g = p.add_argument_group("W5's scale (default: the workload's; --quick: the smoke test's)")
    for field, help_text in (
        ("num_prefixes", "distinct shared prefixes"),
        ("prefix_len", "tokens per prefix"),
        ("requests_per_prefix", "requests per prefix"),
        ("suffix_len", "tokens of each request's own suffix"),
        ("new_tokens", "tokens generated per request"),
        ("cache_prefixes", "prefixes the KV cache holds"),
        ("concurrency", "requests in flight at once"),
    ):
        g.add_argument("--" + field.replace("_", "-"), type=int, default=None, help=help_text)
    g = p.add_argument_group("tiers")
    g.add_argument("--host-tier-bytes", type=byte_size, default=None, help="the host tier's size (see above)")
    g.add_argument("--disk-tier-bytes", type=byte_size, default=None, help="the disk tier's size (see above)")
    g.add_argument("--disk-tier-path", default=None, help="the disk tier's directory (default: a temporary one)")
    g.add_argument("--kv-store-url", default=None, help="the shared store of the 'store' configuration (redis://...)")
    p.add_argument("--json", "--out", dest="out", default=None, metavar="FILE.json", help="also write the results")
    return p


def main(argv: list[str]) -> int:
    description = "W5: many shared prefixes through a small KV cache, with the KV tiers off / host / host+disk."
    args = add_arguments(argparse.ArgumentParser(prog="petrel bench tiers", description=description)).parse_args(argv)
    doc = run(args)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        log(f"saved {args.out}")
    for r in doc["results"]:
        ttft50, ttft99 = r["ttft_p50_s"], r["ttft_p99_s"]
        log(
            f"W5 {r['tiers']:>9}: TTFT p50 {1000 * ttft50:.0f} ms, p99 {1000 * ttft99:.0f} ms, "
            f"{r['output_tok_s']:.1f} output tok/s, prompt tokens computed {r['computed_prompt_tokens']}"
            + ("" if r["valid"] else " (DOES NOT COUNT)")
        )
    return 0 if doc["all_valid"] else 1


def _sizes(args):
    sizes = W5_QUICK if args.quick else W5_FULL
    given = {k: getattr(args, k) for k in asdict(sizes) if getattr(args, k, None) is not None}
    return replace(sizes, **given)


def run(args) -> dict:
    import torch

    from petrel.engine.model_runner import kv_bytes_per_block
    from petrel.model.loader import load_model_config, resolve_model

    sizes = _sizes(args)
    configs = parse_choices(args.tiers, CONFIGS, "tier configuration")
    requests = make_w5_prompts(sizes)
    source = resolve_model(args.model)
    from petrel.config import TORCH_DTYPES, EngineConfig

    block_size = args.block_size or EngineConfig.block_size
    model_config = load_model_config(source)
    if model_config.vocab_size < TOKEN_HIGH:  # a small test model: the ids folded into its vocabulary
        requests = [(i, [t % model_config.vocab_size for t in p]) for i, p in requests]
    per_token = kv_bytes_per_block(model_config, block_size, TORCH_DTYPES[args.dtype]) / block_size
    tokens_per_request = sizes.prefix_len + sizes.suffix_len + sizes.new_tokens
    kv_cache_memory = int(sizes.cache_prefixes * (tokens_per_request + block_size) * per_token)
    all_prefixes = int(sizes.num_prefixes * (sizes.prefix_len + 2 * block_size) * per_token * 1.05)  # + headers
    doc = {
        "meta": {
            "workload": "w5",
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "sizes": asdict(sizes),
            "model": source.path,
            "dtype": args.dtype,
            "block_size": block_size,
            "kv_cache_memory": kv_cache_memory,
            "torch": torch.__version__,
            "cpu_count": os.cpu_count(),
        },
        "results": [],
    }
    for config in configs:
        options = {"dtype": args.dtype, "block_size": block_size, "kv_cache_memory": kv_cache_memory}
        for key in ("tokenizer", "num_threads", "max_num_batched_tokens"):
            if getattr(args, key) is not None:
                options[key] = getattr(args, key)
        temp_dir = None
        if config == "host":
            options["kv_host_tier_bytes"] = args.host_tier_bytes or all_prefixes
        elif config == "host+disk":
            options["kv_host_tier_bytes"] = args.host_tier_bytes or max(1, all_prefixes // 4)
            if args.disk_tier_path is None:
                temp_dir = tempfile.mkdtemp(prefix="petrel-w5-disk-")
            options["kv_disk_tier_path"] = args.disk_tier_path or temp_dir
            options["kv_disk_tier_bytes"] = args.disk_tier_bytes or all_prefixes
        elif config == "store":
            if not args.kv_store_url:
                raise SystemExit("petrel bench tiers: the 'store' configuration needs --kv-store-url")
            options["kv_store_url"] = args.kv_store_url
            _publish(source, options, requests)
        try:
            result = _run_config(source, config, options, requests, sizes)
        finally:
            if temp_dir is not None:
                shutil.rmtree(temp_dir, ignore_errors=True)
        doc["results"].append(result)
        print(json.dumps(result), flush=True)
    doc["all_valid"] = all(r["valid"] for r in doc["results"])
    return doc


def _publish(source, options: dict, requests) -> None:
    """A first engine on the store computes each distinct prefix once (a request per prefix) and publishes it."""
    from petrel.llm import LLM
    from petrel.sampling_params import SamplingParams

    firsts = {}
    for prefix, prompt in requests:
        firsts.setdefault(prefix, prompt)
    log(f"W5 store: a first engine publishes {len(firsts)} prefixes")
    llm = LLM(model=source.path, **options)
    try:
        for prompt in firsts.values():  # each prefix's blocks written before the next (bounded puts never drop)
            llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
            llm.engine.call(lambda core: core.tier_io.tiers.shared.flush(120))
    finally:
        llm.shutdown()


def _run_config(source, config: str, options: dict, requests, sizes) -> dict:
    from petrel.llm import LLM
    from petrel.sampling_params import SamplingParams

    log(f"W5 {config}: loading ({options})")
    llm = LLM(model=source.path, **options)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=sizes.new_tokens, min_tokens=sizes.new_tokens)
        llm.generate(requests[0][1][:32], params, use_tqdm=False, cache_salt="w5-warmup")
        records: list[dict | None] = [None] * len(requests)
        next_index = iter(range(len(requests)))
        lock = threading.Lock()

        def worker():
            while True:
                with lock:
                    i = next(next_index, None)
                if i is None:
                    return
                records[i] = _one_request(llm, requests[i][1], params)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=worker, daemon=True) for _ in range(sizes.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        tiers = llm.get_latest_iteration_stats().kv_tiers
    finally:
        llm.shutdown()
    counts = [r["tokens"] for r in records]
    ttfts = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
    prompt_tokens = sum(len(p) for _, p in requests)
    cached = sum(r["cached"] for r in records)
    problems = count_problems(counts, sizes.new_tokens)
    result = {
        "workload": "w5",
        "tiers": config,
        "valid": not problems,
        "problems": problems,
        "num_requests": len(requests),
        "wall_s": wall,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "output_tok_s": sum(counts) / wall,
        "requests_per_s": len(requests) / wall,
        "prompt_tokens": prompt_tokens,
        "cached_prompt_tokens": cached,
        "computed_prompt_tokens": prompt_tokens - cached,
        "kv_tiers": tiers,
        "options": {k: v for k, v in options.items() if k != "kv_disk_tier_path"},
    }
    return result


def _one_request(llm, prompt: list[int], params) -> dict:
    t_send = time.perf_counter()
    first = None
    last = None
    for snap in llm.generate_async(prompt, params, streaming=True):
        if first is None and snap.outputs[0].token_ids:
            first = time.perf_counter()
        last = snap
    return {
        "ttft_s": first - t_send if first is not None else None,
        "tokens": len(last.outputs[0].token_ids),
        "cached": last.num_cached_tokens,
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
