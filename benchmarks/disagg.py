"""Disaggregated serving: the size and time of the prompt-KV transfer (TCP over loopback), and the decode
instance's time to the end against one instance doing prefill and decode. Two LLMs on the default model in one
process, prefix caching off (every run computes its prompt).

    python benchmarks/disagg.py [--lengths 128,512,2048] [--max-tokens 32]
"""

import argparse
import statistics
import time

from petrel import LLM, DisaggregatedParams, SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("--lengths", default="128,512,2048")
ap.add_argument("--max-tokens", type=int, default=32)
ap.add_argument("--repeats", type=int, default=3)
args = ap.parse_args()

prefill, decode = (LLM(kv_cache_memory=512 << 20, enable_prefix_caching=False) for _ in range(2))
sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
words = "petrel albatross shearwater gannet fulmar tern skua puffin kittiwake storm ocean wind wave".split()
print(f"{'prompt':>7} {'KV bytes':>11} {'transfer ms':>12} {'MB/s':>7} {'split s':>8} {'one s':>7} {'same':>5}")
for n in map(int, args.lengths.split(",")):
    rows = []
    for r in range(args.repeats):
        ids = [prefill.tokenizer(" " + words[(i * 7 + r * 3) % len(words)])["input_ids"][0] for i in range(n)]
        t0 = time.perf_counter()
        ctx = prefill.generate(
            ids, sp, use_tqdm=False, disaggregated_params=DisaggregatedParams(request_type="context_only")
        )
        dp = DisaggregatedParams(**{**ctx.disaggregated_params.to_dict(), "request_type": "generation_only"})
        out = decode.generate(ids, sp, use_tqdm=False, disaggregated_params=dp)
        split = time.perf_counter() - t0
        t0 = time.perf_counter()
        ref = decode.generate(ids, sp, use_tqdm=False)
        one = time.perf_counter() - t0
        same = out.outputs[0].token_ids == ref.outputs[0].token_ids
        rows.append((out.kv_transfer.num_bytes, out.kv_transfer.seconds, split, one, same))
    b = rows[0][0]
    ms = statistics.median(x[1] for x in rows) * 1e3
    print(
        f"{n:>7} {b:>11,} {ms:>12.1f} {b / ms / 1e3:>7.0f} {statistics.median(x[2] for x in rows):>8.2f} "
        f"{statistics.median(x[3] for x in rows):>7.2f} {str(all(x[4] for x in rows)):>5}"
    )
prefill.shutdown()
decode.shutdown()
