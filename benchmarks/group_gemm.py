"""Products of many rows (prefill, batched decode) with GGUF's group-quantized weights (quantization='gguf') on this
CPU: group_gemm.c's integer products with each kernel this CPU runs (AVX2, AVX-512, AVX-512 VNNI), int8_gemm.c on
int8 per-row weights of the same shape, QuantizedLinear's float path for the same GGUF weight (what
PETREL_INT8_COMPUTE=0 keeps: quant_gemm's dequantized tiles up to 256 rows, then tiles under torch's GEMM), and
float32 weights (petrel's register-blocked GEMM).

    python benchmarks/group_gemm.py [--threads 1] [--rows 64,256,1024] [--formats Q4_1,Q8_0,Q5_1]

GFLOP/s: 2 M N K / time, best of 5. Shapes (out x in): SmolLM2-135M's down_proj 576x1536 and a 1536x576 one.
"""

from __future__ import annotations

import argparse

import gguf
import torch
from int8_gemm import available_isas, best_ms, float_path, forced

from petrel.model import dense_kernels, quant_kernels
from petrel.model.quantization import QuantizedWeight

SHAPES = [(576, 1536), (1536, 576)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="64,256,1024")
    ap.add_argument("--formats", default="Q4_1,Q8_0,Q5_1")  # gguf quantizes no K-quant
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    lib = quant_kernels.library()
    assert lib is not None, "no kernels here"
    isas = available_isas()
    names = [name for name, _ in isas]
    print(f"threads {args.threads}; GFLOP/s (2 M N K / time, best of 5)")
    header = " ".join(f"{'group ' + n:>12}" for n in names) + " " + " ".join(f"{'int8 ' + n:>11}" for n in names)
    print(f"{'format':>6} {'out x in':>11} {'rows':>5} {header} {'float path':>10} {'fp32':>6}")
    for fmt in args.formats.split(","):
        for n, k in SHAPES:
            dense = torch.randn(n, k) * 0.05
            raw = gguf.quants.quantize(dense.numpy(), gguf.GGMLQuantizationType[fmt])
            weight = QuantizedWeight.from_gguf(fmt, raw, n, k)
            per_row = QuantizedWeight.int8_per_channel(dense)
            for m in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(m, k)
                gflop = 2 * m * n * k / 1e6  # per ms: GFLOP/s

                def group():
                    w = weight
                    return quant_kernels.group_gemm(lib, w.bits, x, w.codes, w.scale, w.mins, w.group_shift)

                grouped = [forced(s, lambda: best_ms(group)) for _, s in isas]
                int8 = [
                    forced(s, lambda: best_ms(lambda: quant_kernels.int8_gemm(lib, x, per_row.codes, per_row.scale)))
                    for _, s in isas
                ]
                floats = float_path(weight, x)
                fp32 = best_ms(lambda: dense_kernels.gemm(x, dense))
                cells = " ".join(f"{gflop / t:>12.0f}" for t in grouped) + " "
                cells += " ".join(f"{gflop / t:>11.0f}" for t in int8)
                print(f"{fmt:>6} {n:>4} x {k:<4} {m:>5} {cells} {gflop / floats:>10.0f} {gflop / fp32:>6.0f}")


if __name__ == "__main__":
    main()
