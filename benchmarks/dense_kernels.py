"""petrel's float32 CPU kernels (petrel/model/dense_kernels.c) against the torch operations they replace, on the
default model's shapes (the numbers behind using them).

    python benchmarks/dense_kernels.py [--threads 2] [--rows 1,4,8,12,16,24,32] [--seqs 1,16,64]
                                       [--prefill-rows 512,2048] [--prompts 290,512]

Products: all 30 layers' weights plus the LM head (540 MB, read from memory on every pass as in a decode step),
petrel's f32_gemv against torch's best form for the rows (F.linear at one row, (W @ x^T)^T above, which is what
petrel used before); ms for the whole model and GB/s of weight streamed. Decode attention: one layer, `seqs`
sequences with W2-like contexts (64..640 tokens, scrambled 16-token blocks), the kernel against gather + SDPA in
groups of 16 (the torch path). Small ops: one row. Prefill (with --prefill-rows / --prompts; empty to skip): each
layer shape's product at that many rows, torch's F.linear against petrel's AVX-512 GEMM (where the CPU has it), in
GFLOP/s; attention of one layer over a whole prompt of that many tokens, torch's SDPA (causal) against petrel's
paged prefill kernel. Best of several passes.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from petrel.model import dense_kernels
from petrel.model.attention import _decode_attention
from petrel.model.layers import RotaryEmbedding

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down (out x in)


def best_ms(fn, passes: int = 5, inner: int = 1) -> float:
    fn()
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best * 1e3


def products(rows_list: list[int]) -> None:
    weights = [torch.randn(n, k) for _ in range(30) for n, k in LAYER_SHAPES] + [torch.randn(49152, 576)]
    nbytes = sum(w.numel() * 4 for w in weights)
    xs = {k: {m: torch.randn(m, k) for m in rows_list} for k in (576, 1536)}

    def torch_pass(m):
        for w in weights:
            x = xs[w.shape[1]][m]
            F.linear(x, w) if m == 1 else torch.mm(w, x.t()).t().contiguous()

    def kernel_pass(m):
        for w in weights:
            dense_kernels.linear(xs[w.shape[1]][m], w)

    print(f"products over the whole model ({nbytes / 1e6:.0f} MB of float32 weights), ms per pass:")
    print("| rows | torch | petrel kernel | torch / kernel | kernel GB/s |\n| ---: | ---: | ---: | ---: | ---: |")
    for m in rows_list:
        t, k = best_ms(lambda: torch_pass(m)), best_ms(lambda: kernel_pass(m))
        print(f"| {m} | {t:.1f} | {k:.1f} | {t / k:.2f}x | {nbytes / k / 1e6:.1f} |")


def attention(seq_list: list[int]) -> None:
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    print("\ndecode attention, one layer (SmolLM2: 9 query heads, 3 KV heads, head_dim 64, 16-token blocks), ms:")
    print("| sequences | tokens read | torch (gather + SDPA, groups of 16) | petrel kernel | torch / kernel |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    g = torch.Generator().manual_seed(0)
    for s in seq_list:
        lens = sorted(torch.randint(64, 641, (s,), generator=g).tolist())
        blocks = [math.ceil(n / bs) for n in lens]
        cache = torch.randn(2, sum(blocks) + 1, bs, kv_heads, dim, generator=g)
        order = torch.randperm(sum(blocks), generator=g) + 1
        q = torch.randn(s, heads, dim, generator=g)
        groups = []
        for lo in range(0, s, 16):
            idx = list(range(lo, min(lo + 16, s)))
            width = max(blocks[i] for i in idx)
            tables = torch.zeros(len(idx), width, dtype=torch.int64)
            for r, i in enumerate(idx):
                tables[r, : blocks[i]] = order[sum(blocks[:i]) : sum(blocks[:i]) + blocks[i]]
            lens_t = torch.tensor([lens[i] for i in idx])
            mask = torch.arange(width * bs).unsqueeze(0) < lens_t.unsqueeze(1)
            groups.append((slice(lo, lo + len(idx)), tables, lens_t, mask))

        def torch_path():
            for rows, tables, _, mask in groups:
                _decode_attention(q[rows], cache[0], cache[1], tables, mask, 0.125)

        def kernel_path():
            for rows, tables, lens_t, _ in groups:
                dense_kernels.decode_attention(q[rows], cache[0], cache[1], tables, lens_t, 0.125, None)

        t, k = best_ms(torch_path, 7, 3), best_ms(kernel_path, 7, 3)
        print(f"| {s} | {sum(lens)} | {t:.2f} | {k:.2f} | {t / k:.2f}x |")


def small_ops() -> None:
    x, w = torch.randn(1, 576), torch.randn(576)
    qk = torch.randn(1, 960)[:, :768].view(1, 12, 64)
    cos, sin = RotaryEmbedding(64, 4096, 10_000.0).for_positions(torch.tensor([300]), torch.float32)
    gate_up = torch.randn(1, 3072)
    cases = {
        "RMS norm [1, 576]": (lambda: F.rms_norm(x, (576,), w, 1e-5), lambda: dense_kernels.rms_norm(x, w, 1e-5)),
        "rotary [1, 12, 64]": (
            lambda: qk * cos + torch.cat((-qk[..., 32:], qk[..., :32]), -1) * sin,
            lambda: dense_kernels.rotary(qk, cos, sin),
        ),
        "SiLU and multiply [1, 3072]": (
            lambda: F.silu(gate_up[:, :1536]) * gate_up[:, 1536:],
            lambda: dense_kernels.silu_and_mul(gate_up),
        ),
    }
    print("\nsmall ops at one row, microseconds per call:\n| op | torch | petrel kernel |\n| --- | ---: | ---: |")
    for name, (t_fn, k_fn) in cases.items():
        print(f"| {name} | {best_ms(t_fn, 5, 2000) * 1e3:.1f} | {best_ms(k_fn, 5, 2000) * 1e3:.1f} |")


def prefill(rows_list: list[int], prompts: list[int]) -> None:
    if rows_list and dense_kernels.gemm(torch.randn(2, 16), torch.randn(16, 16)) is not None:
        print("\nprefill products, GFLOP/s (torch F.linear / petrel GEMM):")
        print("| rows | " + " | ".join(f"{n}x{k}" for n, k in LAYER_SHAPES) + " |\n| ---: |" + " ---: |" * 4)
        for m in rows_list:
            cells = []
            for n, k in LAYER_SHAPES:
                x, w = torch.randn(m, k), torch.randn(n, k)
                flop = 2 * m * n * k / 1e6
                torch_ms, petrel_ms = best_ms(lambda: F.linear(x, w)), best_ms(lambda: dense_kernels.gemm(x, w))
                cells.append(f"{flop / torch_ms:.0f} / {flop / petrel_ms:.0f}")
            print(f"| {m} | " + " | ".join(cells) + " |")
    if not prompts:
        return
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    print("\nprefill attention, one layer over a whole prompt (9 query heads, 3 KV heads, head_dim 64), ms:")
    print("| prompt tokens | torch SDPA (causal) | petrel kernel | torch / kernel | kernel GFLOP/s |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for n in prompts:
        blocks = math.ceil(n / bs)
        cache = torch.randn(2, blocks + 1, bs, kv_heads, dim)
        table = torch.randperm(blocks) + 1
        q = torch.randn(n, heads, dim)
        k, v = (cache[i][table].view(-1, kv_heads, dim)[:n].transpose(0, 1).unsqueeze(0) for i in (0, 1))
        t = best_ms(
            lambda: F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0), k, v, is_causal=True, scale=0.125, enable_gqa=True
            ),
            5,
            5,
        )
        kern = best_ms(lambda: dense_kernels.prefill_attention(q, cache[0], cache[1], table, 0, 0.125, None), 5, 5)
        flop = 2 * 2 * heads * dim * n * (n + 1) / 2  # scores and values over the causal half
        print(f"| {n} | {t:.2f} | {kern:.2f} | {t / kern:.2f}x | {flop / kern / 1e6:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,8,12,16,24,32")
    ap.add_argument("--seqs", default="1,16,64")
    ap.add_argument("--prefill-rows", default="512,2048")
    ap.add_argument("--prompts", default="290,512")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if dense_kernels.library() is None:
        raise SystemExit("petrel's float32 kernels cannot run here (no AVX2/FMA or no C compiler)")
    print(f"torch {torch.__version__}, {args.threads} threads")
    numbers = lambda text: [int(v) for v in text.split(",") if v]  # noqa: E731
    products(numbers(args.rows))
    attention(numbers(args.seqs))
    small_ops()
    prefill(numbers(args.prefill_rows), numbers(args.prompts))


if __name__ == "__main__":
    main()
