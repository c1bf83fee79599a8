"""Time one decode step of the default model, alone: `batch` sequences of `context` tokens each, one new token each
(the model runner's inputs + the forward + the logits; no scheduler or sampler). The figures behind "where the time
goes" in docs/benchmarks-history.md.

    python benchmarks/decode_step.py [--batch 1,16,64] [--context 350] [--steps 20] [--quantization gguf]
                                     [--thread main,other] [--model DIR_OR_GGUF] [--dtype bfloat16]

Prints min and median ms per step for each batch size, timed on the main thread and/or on another thread (where
the engine runs its steps: a thread's first parallel work gives it a thread team of its own, see
petrel/model/thread_pool.c).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from petrel import LLM
from petrel.bench.flops import decode_weight_bytes, memory_read_gbs
from petrel.engine.scheduler import ScheduledBatch
from petrel.engine.sequence import EngineRequest, Sequence
from petrel.sampling_params import SamplingParams


def decode_batch(runner, batch: int, context: int) -> ScheduledBatch:
    """`batch` sequences of random tokens of their own (a mixture of experts routes each to its own experts), their
    first context - 1 tokens computed, on distinct blocks."""
    bs = runner.block_size
    free = iter(range(1, 1 << 30))
    seqs = []
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        tokens = torch.randint(100, 4000, (context,), generator=g).tolist()
        seq = Sequence(EngineRequest(f"r{i}", tokens, SamplingParams(temperature=0.0)), 0, tokens, len(tokens))
        seq.block_tables = [[next(free) for _ in range(-(-context // bs))]]
        seq.num_computed_tokens = context - 1
        seqs.append(seq)
    return ScheduledBatch(seqs=seqs, num_new_tokens=[1] * batch)


def step_weight_bytes(model, model_dir: str, step) -> int:
    """The weight bytes one of these steps reads (flops.decode_weight_bytes): a mixture of experts' routed experts by
    the share of them one step actually picks, counted by the model's expert-load counters over one step."""
    take = getattr(model, "take_expert_load", None)
    if take is None:
        return decode_weight_bytes(model_dir)
    take()
    step()
    load = take() or {}
    picked = sum(sum(1 for count in counts if count) for counts in load.values())
    total = sum(len(counts) for counts in load.values())
    return decode_weight_bytes(model_dir, picked / total if total else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--context", type=int, default=350)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--quantization", default=None, help="none (default), int8 or gguf")
    ap.add_argument("--thread", default="main", help="comma-separated: main, other")
    ap.add_argument("--model", default=None, help="a Hugging Face directory or GGUF file (default: the default model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--bound",
        action="store_true",
        help="also the memory bound: the weight bytes a step reads (--model a Hugging Face directory; a mixture of "
        "experts' routed experts as many as the step picks) over the memory read bandwidth measured before and "
        "after each timing, and the step's share of that bound",
    )
    args = ap.parse_args()
    llm = LLM(model=args.model, quantization=args.quantization, dtype=args.dtype)
    runner = llm._engine.core.runner
    try:
        for batch in (int(b) for b in args.batch.split(",")):
            step_batch = decode_batch(runner, batch, args.context)

            def step():
                with torch.inference_mode():
                    ids, positions, meta = runner.build_inputs(runner.spans(step_batch))
                    return runner.model.compute_logits(runner.model(ids, positions, runner.kv_caches, meta))

            weight_bytes = step_weight_bytes(runner.model, args.model, step) if args.bound else 0

            def timed(where: str) -> None:
                for _ in range(3):
                    step()
                read_gbs = [memory_read_gbs()] if args.bound else []
                times = []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    step()
                    times.append((time.perf_counter() - t0) * 1e3)
                print(
                    f"batch {batch}, context {args.context}, {where} thread: min {min(times):.1f} ms, "
                    f"median {statistics.median(times):.1f} ms per decode step",
                    flush=True,
                )
                if args.bound:
                    read_gbs.append(memory_read_gbs())
                    rate = weight_bytes / (min(times) / 1e3) / 1e9
                    print(
                        f"  weights {weight_bytes / 1e9:.3f} GB a step at {rate:.1f} GB/s (best step): "
                        f"{rate / max(read_gbs):.0%} of the memory read rate "
                        f"({' / '.join(f'{g:.1f}' for g in read_gbs)} GB/s before / after)",
                        flush=True,
                    )

            for where in args.thread.split(","):
                if where == "main":
                    timed(where)
                else:
                    other = threading.Thread(target=timed, args=(where,))
                    other.start()
                    other.join()
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
