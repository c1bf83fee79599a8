"""W3's work straight on the engine, no HTTP: the W2 prompts as 16 concurrent streaming generate_async calls,
128 tokens each, EOS ignored, greedy. Shows what `petrel serve` adds on top of the engine (see
docs/benchmarks-history.md).

    python benchmarks/w3_engine_only.py
"""

import asyncio
import json
import time

from petrel import LLM, SamplingParams
from petrel.bench import make_w2_prompts

llm = LLM()
prompts = make_w2_prompts()
params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)


async def one(p, sem, rec):
    async with sem:
        t0 = time.perf_counter()
        first = None
        n = 0
        async for snap in llm.generate_async(p, params, streaming=True):
            if snap.outputs[0].text_diff and first is None:
                first = time.perf_counter()
            n = len(snap.outputs[0].token_ids)
        rec.append((first - t0, n, time.perf_counter()))


async def main():
    llm.generate(prompts[0][:32], SamplingParams(max_tokens=4))
    sem = asyncio.Semaphore(16)
    rec = []
    t0 = time.perf_counter()
    await asyncio.gather(*(one(p, sem, rec) for p in prompts))
    wall = time.perf_counter() - t0
    ttft = sorted(r[0] for r in rec)
    print(
        json.dumps(
            {
                "wall_s": wall,
                "output_tok_s": sum(r[1] for r in rec) / wall,
                "ttft_p50_s": ttft[len(ttft) // 2],
                "tokens": sum(r[1] for r in rec),
            }
        )
    )


asyncio.run(main())
llm.shutdown()
