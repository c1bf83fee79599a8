"""W3's long-output variant: 64 concurrent streams of 1,024 tokens each against `petrel serve` (the W2 prompts,
64-512 tokens, greedy, EOS ignored), reporting output tok/s, TTFT p50/p99 and TPOT p50/p99. Streams this long are
where per-step costs that grow with a stream's length (copying its output so far, keeping every chunk) show.

    python benchmarks/w3_long_streams.py                        # starts `petrel serve`, runs, stops it
    python benchmarks/w3_long_streams.py --quick --max-tokens 16    # a smoke run: 8 short requests
    python benchmarks/w3_long_streams.py --json long.json -- --dtype bfloat16     # options of `petrel bench serve`

Any option of `petrel bench serve` overrides the ones below; options after `--` go to `petrel serve` (by default a
KV cache that holds all 64 streams whole, 64 x (512 + 1,024) tokens of SmolLM2-135M in float32 = 4.5 GB, so no
stream is preempted).
"""

import sys

from petrel.bench.serve import main

WORKLOAD = ["--concurrency", "64", "--num-prompts", "64", "--max-tokens", "1024"]
SERVER = ["--kv-cache-memory", str(5 * 1024**3), "--max-num-seqs", "64"]


def arguments(argv: list[str]) -> list[str]:
    """WORKLOAD, then the caller's options (later ones win), then `--` and the server's options."""
    if "--" in argv:
        at = argv.index("--")
        return WORKLOAD + argv[:at] + ["--"] + SERVER + argv[at + 1 :]
    return WORKLOAD + argv + ["--"] + SERVER


if __name__ == "__main__":
    sys.exit(main(arguments(sys.argv[1:])))
