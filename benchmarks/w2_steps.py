"""Where W2's time goes, step by step: W2 (64 prompts of 64..512 tokens, 128 new tokens each, greedy) through
`LLM.generate`, with every model-runner step timed and sorted into decode-only steps and steps that carry prefill
chunks (with the decodes running alongside them), and inside the steps the time of the decoder stack's one C call, the
LM head, the sampler and the step's inputs. The figures behind "where the time goes" in docs/benchmarks-history.md.

    python benchmarks/w2_steps.py [--max-num-batched-tokens 2048] [--kv-cache-memory-gib 4] [--dtype bfloat16]
                                  [--quantization int8] [--model FILE.gguf] [--requests 16]
"""

from __future__ import annotations

import argparse
import time

from where_time_goes import Timers

from petrel import LLM, SamplingParams
from petrel.bench import make_w2_prompts
from petrel.engine import sampler
from petrel.engine.model_runner import ModelRunner
from petrel.model import dense_kernels, llama


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-memory-gib", type=float, default=4)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default=None, help="e.g. int8 (default: the weights as they are)")
    ap.add_argument("--model", default=None, help="an HF directory or a .gguf file (default: the default model)")
    ap.add_argument("--requests", type=int, default=64, help="W2's first N prompts (default: all 64)")
    args = ap.parse_args()
    steps: list[tuple[float, int, int]] = []  # seconds, decode rows, prefill tokens
    execute = ModelRunner.execute

    def timed_execute(self, batch):
        t0 = time.perf_counter()
        out = execute(self, batch)
        decodes = sum(1 for n in batch.num_new_tokens if n == 1)
        steps.append((time.perf_counter() - t0, decodes, batch.num_tokens - decodes))
        return out

    ModelRunner.execute = timed_execute
    parts = Timers()
    parts.wrap(dense_kernels.DecoderStack, "__call__", lambda a: "decoder stack (C)")
    parts.wrap(llama.LlamaForCausalLM, "compute_logits", lambda a: "LM head")
    parts.wrap(sampler.Sampler, "sample", lambda a: "sampler")
    parts.wrap(ModelRunner, "build_inputs", lambda a: "step inputs")
    llm = LLM(
        kv_cache_memory=int(args.kv_cache_memory_gib * (1 << 30)),
        max_num_batched_tokens=args.max_num_batched_tokens,
        dtype=args.dtype,
        quantization=args.quantization,
        **({"model": args.model} if args.model else {}),
    )
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    steps.clear()
    parts.clear()
    params = SamplingParams(max_tokens=128, min_tokens=128, ignore_eos=True, temperature=0)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in make_w2_prompts()[: args.requests]], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    decode = [s for s in steps if s[2] == 0]
    mixed = [s for s in steps if s[2] > 0]
    output_rate = args.requests * 128 / wall
    print(f"W2 wall {wall:.2f} s, {output_rate:.1f} output tok/s; {sum(s[0] for s in steps):.2f} s in model steps")
    print(
        f"decode-only steps: {len(decode)}, {sum(s[0] for s in decode):.2f} s, "
        f"{sum(s[0] for s in decode) / max(1, len(decode)) * 1e3:.1f} ms each, "
        f"{sum(s[1] for s in decode) / max(1, len(decode)):.1f} rows on average"
    )
    print(
        f"steps with prefill: {len(mixed)}, {sum(s[0] for s in mixed):.2f} s for {sum(s[2] for s in mixed)} "
        f"prompt tokens ({sum(s[0] for s in mixed) / max(1, sum(s[2] for s in mixed)) * 1e3:.2f} ms a token, "
        "decodes alongside included)"
    )
    print("inside the steps: " + ", ".join(f"{key} {seconds:.2f} s" for key, seconds in parts.seconds.items()))
    llm.shutdown()


if __name__ == "__main__":
    main()
