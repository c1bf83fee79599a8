"""bfloat16 products per row count on this CPU: petrel's panels against oneDNN with the weights packed once (what
petrel.model.amx runs from its row threshold where the CPU has AMX) and torch's plain bfloat16 F.linear (oneDNN,
packing the weights every call): the numbers behind amx.AMX_MIN_ROWS, for a machine with AMX.

    python benchmarks/amx_products.py [--threads 2] [--rows 1,2,4,...,2048] [--shapes smollm2,1b] [--repeats 5]
    python benchmarks/amx_products.py --quick      # a smoke run: 3 row counts, SmolLM2's shapes, 2 repeats

GFLOP/s (2 M N K over the best of --repeats calls), a row per (shape, M):
  panels   gemm_kernels.bf16_panels_product: x float32 rounded to bfloat16 in the kernel, float32 sums and output
           (bf16_pairs.c, AVX512_BF16's dpbf16; absent where the CPU has no AVX512_BF16)
  onednn   amx.Tiles: x rounded to bfloat16, mkldnn._linear_pointwise on the weights reordered once at load, its
           bfloat16 output widened to float32 (all three counted)
  torch    torch.nn.functional.linear on bfloat16 x and weights (x's rounding not counted)
and per shape the first row count from which onednn leads panels at every larger count. Shapes (out x in): SmolLM2-
135M's fused q/k/v 960x576, o_proj 576x576, gate_up 3072x576, down 576x1536; Llama-3.2-1B's q/k/v 3072x2048,
gate_up 16384x2048, down 2048x8192. The header names the CPU and whether it has AMX (amx_tile, amx_bf16): oneDNN
takes its tile kernels only there (ONEDNN_VERBOSE=1 shows avx512_core_amx in the implementations' names).
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
import torch.nn.functional as F

from petrel.model import amx, gemm_kernels, native
from petrel.model.quantization import pack_panels

SHAPES = {
    "smollm2": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
    "1b": [(3072, 2048), (16384, 2048), (2048, 8192)],
}
ROWS = "1,2,4,8,16,32,64,128,256,512,1024,2048"


def best_s(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def warm_up(panels: bool, repeats: int) -> None:
    """Each path run a while first: the threads started, oneDNN's kernels generated, the clocks up."""
    w, x = torch.randn(1024, 1024).bfloat16(), torch.randn(256, 1024)
    packed, tiles = pack_panels(w) if panels else None, amx.Tiles.bf16(w, 1) if amx.onednn_runs_bf16() else None
    for _ in range(4 * repeats):
        if packed is not None:
            gemm_kernels.bf16_panels_product(x, packed, 1024)
        if tiles is not None:
            tiles(x)
        F.linear(x.bfloat16(), w)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default=ROWS)
    ap.add_argument("--shapes", default="smollm2,1b", help=f"comma-separated: {', '.join(SHAPES)}")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="--rows 1,32,256 --shapes smollm2 --repeats 2")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.shapes, args.repeats = "1,32,256", "smollm2", 2
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    shapes = [s for name in args.shapes.split(",") for s in SHAPES[name.strip()]]
    panels = gemm_kernels.bf16_panels()
    print(
        f"{cpu_name()}; AMX bf16: {native.cpu_has_amx('bf16')}; oneDNN bf16: {amx.onednn_runs_bf16()}; "
        f"petrel panels: {panels}; torch {torch.__version__}, {args.threads} threads, best of {args.repeats}"
    )
    warm_up(panels, args.repeats)
    print(f"{'N x K':>12} {'M':>5} {'panels':>8} {'onednn':>8} {'torch':>8}  GFLOP/s")
    for n, k in shapes:
        w = torch.randn(n, k).bfloat16()
        packed = pack_panels(w) if panels else None
        tiles = amx.Tiles.bf16(w, 1) if amx.onednn_runs_bf16() else None
        onednn_leads = None
        for m in rows:
            x = torch.randn(m, k)
            xb = x.bfloat16()
            flop = 2 * m * n * k / 1e9
            rates = {}
            if packed is not None:
                rates["panels"] = flop / best_s(lambda: gemm_kernels.bf16_panels_product(x, packed, n), args.repeats)
            if tiles is not None:
                rates["onednn"] = flop / best_s(lambda: tiles(x), args.repeats)
            rates["torch"] = flop / best_s(lambda: F.linear(xb, w), args.repeats)
            if "panels" in rates and "onednn" in rates:
                ahead = rates["onednn"] > rates["panels"]
                onednn_leads = (onednn_leads or m) if ahead else None
            cells = " ".join(f"{rates[c]:8.1f}" if c in rates else f"{'-':>8}" for c in ("panels", "onednn", "torch"))
            print(f"{n:>6} x {k:<5} {m:>5} {cells}")
        if packed is not None and tiles is not None:
            print(f"{n:>6} x {k:<5} onednn ahead of panels from {onednn_leads or 'no'} rows (of those measured)")


if __name__ == "__main__":
    main()
