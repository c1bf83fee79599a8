"""What every peer script shares: where the peers live, the workloads (petrel/bench/workloads.py, imported from
this checkout so that every engine runs the same token ids), and how a result is checked, summarized and handed
to `petrel bench compare` (a `RESULT name: {json}` line on stdout, and a copy under $PEERS_HOME/results/).

The peers' virtual environments have numpy but not petrel's other dependencies: the modules imported from petrel
here need only numpy (and petrel.bench.runners, for transformers, only torch and transformers)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from petrel.bench.report import count_problems, median, w6_metrics  # noqa: E402
from petrel.bench.workloads import (  # noqa: E402
    FULL,
    QUICK,
    W1_REFERENCE_IDS,
    Sizes,
    W6Plan,
    make_w2_prompts,
    make_w4_prompts,
    make_w6_prompts,  # noqa: F401 - the scripts' W6 prompts (peers.make_w6_prompts)
)

PEERS_HOME = os.path.expanduser(os.environ.get("PEERS_HOME", "~/petrel-peers"))
MODEL_DIR = os.path.join(PEERS_HOME, "models", "smollm2-135m-instruct")  # fp32 Hugging Face directory
GGUF_Q4_1 = os.path.join(PEERS_HOME, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")  # the default model's own GGUF
GGUF_F32 = os.path.join(PEERS_HOME, "models", "smollm2-135m-instruct-f32.gguf")  # the same weights, F32


def parser(description: str, workloads: tuple[str, ...]) -> argparse.ArgumentParser:
    """The options every peer script takes: the workload, --runs (W1), --quick, --tag (the result's name),
    --w1-ids (W1's prompt for another model than the default) and --w6-plan (W6's sizes, made by compare)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("workload", choices=workloads)
    p.add_argument("--runs", type=int, default=None, help=f"timed W1 runs, median reported (default {FULL.w1_runs})")
    p.add_argument("--quick", action="store_true", help="the workloads' smoke-test sizes (`petrel bench --quick`)")
    p.add_argument("--tag", default="", help="appended to the result's name")
    p.add_argument("--w2-requests", type=int, default=None, help="W2 with its first N prompts (default: all 64)")
    p.add_argument(
        "--w1-ids",
        type=_id_list,
        default=None,
        help="W1's prompt as comma-separated token ids (default: the default model's, W1_REFERENCE_IDS)",
    )
    p.add_argument(
        "--w6-plan",
        type=_w6_plan_text,
        default=None,
        metavar="PROMPT,LONG,NEW,VOCAB,REQUESTS,KVBYTES",
        help="W6's plan as `petrel bench compare` makes it (workloads.W6Plan.to_argv); needed by w6",
    )
    return p


def _id_list(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--w1-ids: not comma-separated integers: {text[:40]!r}") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError("--w1-ids: token ids must be >= 0, at least one")
    return ids


def _w6_plan_text(text: str) -> str:
    """--w6-plan checked while parsing, kept as text (the options are saved with the result as JSON)."""
    try:
        W6Plan.from_arg(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def w6_plan_of(args) -> W6Plan:
    """W6's plan from --w6-plan (the script exits with a clear error without one)."""
    if args.w6_plan is None:
        raise SystemExit("w6 needs --w6-plan (petrel bench compare --workloads w6 passes it)")
    return W6Plan.from_arg(args.w6_plan)


def w6_result(plan: W6Plan, batch: list[dict], long: list[dict], mode: str) -> dict:
    """W6's figures (report.w6_metrics for the batch and the long request), valid only if every request produced
    exactly plan.new_tokens tokens."""
    result = {"workload": "w6", "plan": {**plan.__dict__, "notes": list(plan.notes)}, "mode": mode, "problems": []}
    for key, records in (("batch", batch), ("long", long)):
        m = w6_metrics(records, plan.kv_bytes_per_token)
        result["problems"] += [f"{key}: {p}" for p in count_problems(m["new_tokens"], plan.new_tokens)]
        result[key] = m
    result["valid"] = not result["problems"]
    return result


def sizes_of(args) -> Sizes:
    sizes = QUICK if args.quick else FULL
    if args.runs is not None:
        sizes = Sizes(**{**sizes.__dict__, "w1_runs": args.runs})
    if getattr(args, "w2_requests", None) is not None:
        sizes = Sizes(**{**sizes.__dict__, "w2_num_requests": args.w2_requests})
    return sizes


def w1_prompt(args=None) -> list[int]:
    """W1's prompt: --w1-ids when given, else the default model's chat template applied to the W1 message, as
    transformers tokenizes it."""
    ids = getattr(args, "w1_ids", None)
    return list(ids) if ids is not None else list(W1_REFERENCE_IDS)


def batch_prompts(workload: str, sizes: Sizes) -> tuple[list[list[int]], int]:
    """W2's or W4's prompts at these sizes, and the new tokens each must produce."""
    if workload == "w2":
        return make_w2_prompts(sizes.w2_num_requests, sizes.w2_max_prompt_len), sizes.w2_new_tokens
    return make_w4_prompts(sizes.w4_num_requests, sizes.w4_prefix_len, sizes.w4_suffix_len), sizes.w4_new_tokens


def w1_result(runs: list[dict], returned: list[int], n: int, output_ids: list[int]) -> dict:
    """W1's figures over its runs (medians), valid only if every run streamed and returned exactly n tokens."""
    problems = count_problems([r["new_tokens"] for r in runs], n, "run (streamed)")
    problems += count_problems(returned, n, "run (returned)")
    return {
        "workload": "w1",
        "new_tokens": n,
        "num_runs": len(runs),
        "runs": runs,
        "median_ttft_s": median(r["ttft_s"] for r in runs),
        "median_decode_tok_s": median(r["decode_tok_s"] for r in runs),
        "median_total_s": median(r["total_s"] for r in runs),
        "output_ids_first32": output_ids[:32],
        "valid": not problems,
        "problems": problems,
    }


def batch_result(
    workload: str, prompts: list[list[int]], counts: list[int], wall: float, n: int, cached: list[int] | None = None
) -> dict:
    """W2's or W4's figures: wall time, output and total tok/s, prompt tokens served from a cache where the engine
    has one; valid only if every request produced exactly n tokens."""
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(counts)
    problems = count_problems(counts, n)
    result = {
        "workload": workload,
        "num_requests": len(prompts),
        "new_tokens": n,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "expected_output_tokens": n * len(prompts),
        "wall_s": wall,
        "output_tok_s": output_tokens / wall,
        "total_tok_s": (prompt_tokens + output_tokens) / wall,
        "valid": not problems,
        "problems": problems,
    }
    if cached is not None:
        result["cached_prompt_tokens"] = sum(cached)
    return result


def save_result(name: str, result: dict) -> None:
    """Print the `RESULT name: {json}` line petrel bench compare reads, and keep a copy in $PEERS_HOME/results."""
    result = {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        **result,
    }
    if not result.get("valid", True):
        print(f"FIGURE DOES NOT COUNT: {'; '.join(result['problems'])}", flush=True)
    os.makedirs(os.path.join(PEERS_HOME, "results"), exist_ok=True)
    path = os.path.join(PEERS_HOME, "results", f"{name}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"RESULT {name}: {json.dumps(result)}", flush=True)
    print(f"saved {path}", flush=True)
