"""llama.cpp through llama-cpp-python, the peer in $PEERS_HOME/venv-llamacpp: W1, W2 and W4 on a GGUF file.

    venv-llamacpp/bin/python llamacpp_bench.py w1 --gguf $PEERS_HOME/models/smollm2-135m-instruct-f32.gguf --tag f32
    venv-llamacpp/bin/python llamacpp_bench.py w2 | w4 [--gguf PATH] [--threads 2] [--tag NAME]
    venv-llamacpp/bin/python llamacpp_bench.py w6 --w6-plan PROMPT,LONG,NEW,VOCAB,REQUESTS,KVBYTES --gguf PATH

Llama.generate() yields tokens greedily (temperature 0, no repetition penalty) without stopping at EOS: taking
exactly N tokens is "EOS ignored". Its Python API runs one sequence at a time, so W2 and W4 are sequential
requests. W1 and W2 reset the context before every request (no KV reused); W4 does not: generate() evaluates only
what a prompt does not share with the tokens evaluated before it, which is llama.cpp's prefix reuse, and the
result counts those shared prompt tokens as served from cache. W6 runs its requests one at a time, the context
reset before each, with n_ctx the plan's longest context (at least 2048).
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_common as peers  # noqa: E402

from petrel.bench.report import matching_prefix, w1_metrics  # noqa: E402


def take(llm, prompt: list[int], n: int, times: list[float] | None = None, reset: bool = True) -> list[int]:
    """The first n greedy tokens after `prompt`, each timed into `times` as it comes."""
    if reset:
        llm.reset()
    out = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        if times is not None:
            times.append(time.perf_counter())
        out.append(token)
        if len(out) == n:
            break
    return out


def run_w6(llm, plan) -> dict:
    """W6: each request alone (reset first), its tokens timed as they come."""
    batch, long = peers.make_w6_prompts(plan)
    take(llm, batch[0][:32], 4)  # warm-up, not timed
    records = {"batch": [], "long": []}
    for key, prompts in (("batch", batch), ("long", [long])):
        for i, prompt in enumerate(prompts):
            times: list[float] = []
            t_send = time.perf_counter()
            take(llm, prompt, plan.new_tokens, times)
            records[key].append({"t_send": t_send, "prompt_len": len(prompt), "times": times})
            print(f"w6 {key} {i}: TTFT {times[0] - t_send if times else float('nan'):.2f} s", flush=True)
    return peers.w6_result(plan, records["batch"], records["long"], "requests one at a time")


def run_w1(llm, sizes, args) -> dict:
    n, prompt = sizes.w1_new_tokens, peers.w1_prompt(args)
    take(llm, prompt, 8)  # warm-up, not timed
    runs, returned, ids = [], [], []
    for r in range(sizes.w1_runs):
        times: list[float] = []
        t_start = time.perf_counter()
        ids = take(llm, prompt, n, times)
        runs.append(w1_metrics(t_start, times))
        returned.append(len(ids))
        print(
            f"run {r}: TTFT {1000 * (runs[-1]['ttft_s'] or float('nan')):.1f} ms, "
            f"decode {runs[-1]['decode_tok_s'] or float('nan'):.2f} tok/s",
            flush=True,
        )
    return peers.w1_result(runs, returned, n, ids)


def run_batch(llm, workload: str, sizes) -> dict:
    prompts, n = peers.batch_prompts(workload, sizes)
    take(llm, peers.batch_prompts("w2", sizes)[0][0][:32], 4)  # warm-up, not timed
    reuse = workload == "w4"
    llm.reset()
    evaluated: list[int] = []  # what the context holds: the previous prompt and all but its last token
    counts, cached = [], []
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        cached.append(matching_prefix(evaluated, prompt[:-1]) if reuse else 0)
        out = take(llm, prompt, n, reset=not reuse)
        counts.append(len(out))
        evaluated = prompt + out[:-1]
        if i % 16 == 15:
            print(f"{i + 1} requests done, t={time.perf_counter() - t0:.1f}s", flush=True)
    wall = time.perf_counter() - t0
    result = peers.batch_result(workload, prompts, counts, wall, n, cached if reuse else None)
    result["mode"] = f"{len(prompts)} sequential requests (no batching in the Python API)"
    return result


def main() -> None:
    p = peers.parser(__doc__.split("\n\n")[0], ("w1", "w2", "w4", "w6"))
    p.add_argument(
        "--gguf",
        default=peers.GGUF_F32 if os.path.exists(peers.GGUF_F32) else peers.GGUF_Q4_1,
        help="the model file (default: the F32 GGUF when setup_peers.sh made it, else the Q4_1 one)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-batch", type=int, default=512, help="prompt tokens per evaluation")
    args = p.parse_args()
    sizes = peers.sizes_of(args)
    plan = peers.w6_plan_of(args) if args.workload == "w6" else None
    n_ctx = max(2048, plan.long_context, plan.prompt_len + plan.new_tokens) if plan else 2048

    import llama_cpp

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=args.gguf,
        n_ctx=n_ctx,
        n_batch=args.n_batch,
        n_ubatch=args.n_batch,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        seed=0,
        verbose=False,
    )
    info = {
        "engine": "llama-cpp-python",
        "version": llama_cpp.__version__,
        "gguf": args.gguf,
        "load_s": time.perf_counter() - t0,
        "threads": args.threads,
        "n_batch": args.n_batch,
        "args": vars(args),
    }
    if args.workload == "w6":
        result = run_w6(llm, plan)
    elif args.workload == "w1":
        result = run_w1(llm, sizes, args)
    else:
        result = run_batch(llm, args.workload, sizes)
    peers.save_result(f"llamacpp_{args.workload}_{args.tag or 'run'}", {**info, **result})


if __name__ == "__main__":
    main()
