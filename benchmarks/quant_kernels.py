"""Weight-only low-bit products on this CPU: which kernel to use for QuantizedLinear (the numbers behind the choice).

    python benchmarks/quant_kernels.py [--threads 2] [--rows 1,4,16,64]

SmolLM2-135M's shapes (out x in): 576x576 (o_proj), 3072x576 (gate_up), 576x1536 (down), 49152x576 (LM head).
Each kernel runs over enough copies of the weight (>= 200 MB) that every call reads it from memory, as a decode
step does; the best of 3 passes, ms per call. Kernels: fp32 F.linear; bf16 / fp16 weights and activations;
torch._weight_int8pack_mm (int8, a scale per row); aten._weight_int4pack_mm_for_cpu (int4, groups of 32, the kernel
torchao's CPU int4 layout calls); petrel's quant_kernels.c (4-bit Q4_1 layout and 8-bit Q8_0 layout, and for many
rows a dequantized tile + torch GEMM).
"""

from __future__ import annotations

import argparse
import time

import torch

from petrel.model.quantization import GEMV_MAX_ROWS, QuantizedWeight

SHAPES = [(576, 576), (3072, 576), (576, 1536), (49152, 576)]


def best_ms(fn, weights, passes: int) -> float:
    for w in weights[:2]:
        fn(w)
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        for w in weights:
            fn(w)
        best = min(best, (time.perf_counter() - t0) / len(weights))
    return best * 1e3


def kernels(n: int, k: int):
    """name -> (make one weight, product of x [M, k] with it)."""

    def q4():
        codes = torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8)
        return QuantizedWeight(
            codes, torch.rand(n, k // 32) * 0.01, -torch.rand(n, k // 32) * 0.08, 4, 5, (n, k), "Q4_1"
        )

    def q8():
        codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        return QuantizedWeight(codes, torch.rand(n, k // 32) * 0.01, None, 8, 5, (n, k), "Q8_0")

    def int4pack():
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
        return packed, torch.rand(k // 32, n, 2)

    return {
        "fp32": (lambda: torch.randn(n, k), lambda x, w: torch.nn.functional.linear(x, w)),
        "bf16": (lambda: torch.randn(n, k).bfloat16(), lambda x, w: torch.nn.functional.linear(x.bfloat16(), w)),
        "fp16": (lambda: torch.randn(n, k).half(), lambda x, w: torch.nn.functional.linear(x.half(), w)),
        "torch int8pack": (
            lambda: (torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n)),
            lambda x, w: torch._weight_int8pack_mm(x, w[0], w[1]),
        ),
        "torch int4pack": (int4pack, lambda x, w: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w[0], 32, w[1])),
        "petrel 4-bit": (q4, lambda x, w: w.matmul(x)),
        "petrel 8-bit": (q8, lambda x, w: w.matmul(x)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--kernels", default=None, help="comma-separated subset")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    print(
        f"threads {args.threads}; ms per call; petrel's kernels: register GEMV up to {GEMV_MAX_ROWS} rows, "
        f"dequantized tile + GEMM beyond\n"
    )
    names = list(kernels(1, 32)) if args.kernels is None else args.kernels.split(",")
    print("| shape | rows | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for n, k in SHAPES:
        table = {m: {} for m in rows}
        for name in names:
            make, product = kernels(n, k)[name]
            copies = max(2, int(200e6 / (n * k * 4)))
            weights = [make() for _ in range(copies)]
            for m in rows:
                x = torch.randn(m, k)
                slow = name.startswith("torch int") and m > 1  # seconds per pass: one pass is enough
                table[m][name] = best_ms(
                    lambda w: product(x, w), weights if not slow else weights[:4], 1 if slow else 3
                )
            del weights
        for m in rows:
            print(f"| {n}x{k} | {m} | " + " | ".join(f"{table[m][name]:.3f}" for name in names) + " |", flush=True)


if __name__ == "__main__":
    main()
