"""Products of many rows (prefill, batched decode) with int8 per-row weights (quantization='int8') on this CPU: the
numbers behind quantization.INT8_MIN_ROWS.

    python benchmarks/int8_gemm.py [--threads 2] [--rows 16,64,256,1024,2048]

Kernels, ms per call (best of 5): int8_gemm.c (integer products) with each kernel this CPU runs (AVX2, AVX-512,
AVX-512 VNNI: quant_kernels.int8_isa, forced through its switches), QuantizedLinear's float path (what
PETREL_INT8_COMPUTE=0 keeps: quant_gemm's dequantized 12-row tiles up to 256 rows, dequantized tiles under torch's
GEMM beyond), and float32 weights (petrel's register-blocked GEMM, AVX-512 where the CPU has it, and torch).
Shapes (out x in): SmolLM2-135M's fused q/k/v 960x576, o_proj 576x576, gate_up 3072x576, down 576x1536.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from petrel.model import dense_kernels, quant_kernels
from petrel.model.quantization import QuantizedWeight

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def best_ms(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


# int8_gemm's kernels: (name, the switches that force it, whether this CPU runs it)
ISAS = [
    ("avx2", {"PETREL_AVX512": "0"}, quant_kernels.INT8_AVX2),
    ("avx512", {"PETREL_AVX512_VNNI": "0"}, quant_kernels.INT8_AVX512),
    ("vnni", {}, quant_kernels.INT8_AVX512_VNNI),
]


def forced(switches: dict[str, str], fn):
    """fn() with these environment switches set (and none of the others)."""
    saved = {name: os.environ.pop(name, None) for name in ("PETREL_AVX512", "PETREL_AVX512_VNNI")}
    os.environ.update(switches)
    try:
        return fn()
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


def available_isas() -> list[tuple[str, dict[str, str]]]:
    """(name, switches) of every kernel of ISAS this CPU runs: those whose switches make int8_isa pick them."""
    return [(name, switches) for name, switches, isa in ISAS if forced(switches, quant_kernels.int8_isa) == isa]


def float_path(weight: QuantizedWeight, x: torch.Tensor) -> float:
    os.environ["PETREL_INT8_COMPUTE"] = "0"
    try:
        return best_ms(lambda: weight.matmul(x))
    finally:
        del os.environ["PETREL_INT8_COMPUTE"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="16,64,256,1024,2048")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    lib = quant_kernels.library()
    assert lib is not None, "no kernels here"
    isas = available_isas()
    print(f"threads {args.threads}; ms per call; x: the widest int8_gemm's speed-up over the float path and the best")
    print("float32; GFLOP/s: 2 M N K / time, the widest int8_gemm and petrel's float32 GEMM")
    header = " ".join(f"{'int8 ' + name:>11}" for name, _ in isas)
    header += f" {'float path':>10} {'fp32 petrel':>11} {'fp32 torch':>10}"
    print(f"{'out x in':>10} {'rows':>5} {header}  x  GFLOP/s")
    for n, k in SHAPES:
        dense = torch.randn(n, k) * 0.05
        weight = QuantizedWeight.int8_per_channel(dense)
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k)
            integer = [
                forced(switches, lambda: best_ms(lambda: quant_kernels.int8_gemm(lib, x, weight.codes, weight.scale)))
                for _, switches in isas
            ]
            floats = float_path(weight, x)
            petrel32 = best_ms(lambda: dense_kernels.gemm(x, dense))
            torch32 = best_ms(lambda: torch.nn.functional.linear(x, dense))
            widest, gflop = integer[-1], 2 * m * n * k / 1e6
            times = " ".join(f"{t:>11.3f}" for t in integer)
            print(
                f"{n:>4} x {k:<4} {m:>5} {times} {floats:>10.3f} {petrel32:>11.3f} {torch32:>10.3f}  "
                f"{floats / widest:.2f} / {min(petrel32, torch32) / widest:.2f}  {gflop / widest:.0f} / "
                f"{gflop / petrel32:.0f}"
            )


if __name__ == "__main__":
    main()
