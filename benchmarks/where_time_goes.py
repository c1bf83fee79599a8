"""Where a model's prefill and decode time goes on this CPU: the figures behind docs/benchmarks-history.md's 2026-12-02
entries on the 1B-shaped model and W6.

    python benchmarks/where_time_goes.py gemm [--model DIR_OR_GGUF] [--rows 16,64,256,512,1024] [--repeats 5]
                                              [--ceiling]
    python benchmarks/where_time_goes.py prefill [--model ...] [--tokens 7936 | --w2-prompts 16] [--layer-by-layer]
    python benchmarks/where_time_goes.py decode [--model ...] [--seqs 16] [--steps 32] [--prompt-tokens 8]
    python benchmarks/where_time_goes.py attention [--chunks 2048@0,2048@5888] [--repeats 5] [--kv-cache-dtype bfloat16]
    python benchmarks/where_time_goes.py decode-attention [--contexts 4x7936,16x2000,64x400,1x7936]
                                                          [--kv-cache-dtype bfloat16] [--heads 16,4]

gemm: each distinct projection shape of the model (fused q/k/v, o, fused gate/up, down) at each row count, GFLOP/s
(2 M N K / time, best of 5, torch's threads): petrel's few-row kernel (dense_kernels.linear, up to 256 rows),
petrel's register-blocked GEMM (dense_kernels.gemm), torch as x @ W^T and as (W @ x^T)^T, the weights packed in panels
(panels.c's f32_panels_product) with the AVX2 blocks and, where the CPU has AVX-512, with its. With --ceiling, also this
machine's float32 FMA ceiling on as many threads (benchmarks/fma_peak.c, compiled with gcc; 256-bit FMAs), measured
before and after the table, and the GEMM's share of the higher of the two.
prefill: one prompt of --tokens random ids (or W2's first --w2-prompts prompts) through LLM.generate (max_tokens 1,
prefix caching off): the time inside the decoder stack's one C call (dense_kernels.DecoderStack, where the CPU kernels
take the whole model) and the rate of its projections' arithmetic over that time; with --layer-by-layer, the model
run a layer at a time in Python instead, the time spent inside prefill attention and inside each projection shape's
Linear.forward, summed over the prompts' chunks, and the products' GFLOP/s.
decode: --seqs sequences of W2's prompts cut to --prompt-tokens tokens (8; 0: whole), --steps new tokens
(--temperature 0: greedy); the engine steps of decodes only (those that run the decoder stack: the prompts' prefill
is not counted), their time, and inside them the decoder stack (one C call for all layers), the LM head
(compute_logits) and the sampler, per step, and what is left around them.
attention: the prefill attention kernel alone on one layer of the default model's heads (9 query heads, 3 KV heads,
head_dim 64, 16-token blocks in shuffled order): a chunk of N queries after P cached positions for each N@P, best of 3
calls --repeats times, with each ISA's kernel this CPU runs (AVX2; AVX-512 too where it has it) in turn; a bfloat16
cache (--kv-cache-dtype bfloat16) through the AVX2 loops that widen it and, where AVX512_BF16 runs, the dpbf16 loops.
decode-attention: the decode attention kernel alone on those heads (or --heads QUERY,KV), S sequences of C keys each
for every SxC, over six layers' caches in turn (so that one call's keys and values are not in cache from the last):
GB/s of keys and values read, and the rate torch sums the same caches at (a sequential read: the memory's rate), the
best of seven runs of each taken in turn; a float32 cache on a CPU with AVX-512 through both its loops and the AVX2
ones, a bfloat16 cache on a CPU with AVX512_BF16 through both the dpbf16 loops and the widening (AVX2) ones, in
turn.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import time

import numpy as np
import torch
from int8_gemm import best_ms

from petrel import LLM, SamplingParams
from petrel.bench.workloads import make_w2_prompts
from petrel.engine import sampler
from petrel.model import dense_kernels, gemm_kernels, layers, native
from petrel.model.config import ModelConfig
from petrel.model.loader import load_model_config, resolve_model
from petrel.model.quantization import QuantizedLinear, pack_panels


class Timers:
    """Seconds and calls spent inside wrapped callables, by label."""

    def __init__(self):
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()

    def wrap(self, owner, name: str, label=None) -> None:
        """Time owner.name (a function or a method); label(args) names each call (default: `name`)."""
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                key = label(args) if label else name
                self.seconds[key] += time.perf_counter() - t0
                self.calls[key] += 1

        setattr(owner, name, timed)

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def best_s(fn, repeats: int = 5) -> float:
    return best_ms(fn, repeats) / 1e3


@contextlib.contextmanager
def kernel_isa(isa: str):
    """petrel's kernels of this ISA ("avx2", or "avx512" where the CPU has it) inside the block: PETREL_AVX512=0
    keeps an AVX-512 machine on the AVX2 ones."""
    before = os.environ.get("PETREL_AVX512")
    os.environ["PETREL_AVX512"] = "1" if isa == "avx512" else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["PETREL_AVX512"]
        else:
            os.environ["PETREL_AVX512"] = before


def fma_ceiling(exe: str, threads: int) -> float:
    """GFLOP/s of fma_peak.c built as `exe` (build_fma_peak) on `threads` threads: the float32 FMA ceiling no product
    can pass."""
    import subprocess

    out = subprocess.run([exe, str(threads)], check=True, capture_output=True, text=True).stdout
    return float(out.split("threads:")[1].split("GFLOP/s")[0])


def build_fma_peak(directory: str) -> str:
    """fma_peak.c (this directory) compiled with gcc into `directory`; the executable's path."""
    import os
    import subprocess

    exe = os.path.join(directory, "fma_peak")
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fma_peak.c")
    subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", source, "-o", exe], check=True)
    return exe


def gemm(args) -> None:
    if not args.ceiling:
        return gemm_table(args, None)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        gemm_table(args, build_fma_peak(tmp))


def gemm_table(args, fma_peak: str | None) -> None:
    """gemm's table; with fma_peak (an fma_peak.c executable) the FMA ceiling before and after it"""
    cfg: ModelConfig = load_model_config(resolve_model(args.model))
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes = [(h, q + 2 * kv), (q, h), (h, 2 * cfg.intermediate_size), (cfg.intermediate_size, h)]  # (K, N)
    threads, repeats = torch.get_num_threads(), args.repeats
    ceilings = [fma_ceiling(fma_peak, threads)] if fma_peak else []
    if ceilings:
        print(f"FMA ceiling, {threads} threads: {ceilings[0]:.1f} GFLOP/s")
    print(
        "GFLOP/s: few-row kernel / petrel GEMM / torch x W^T / torch (W x^T)^T / "
        "panels, AVX2 blocks / panels, AVX-512 blocks (0: not on this CPU)"
    )
    isas = [gemm_kernels.PANELS_AVX2]
    if gemm_kernels.f32_panels_isa() == gemm_kernels.PANELS_AVX512:
        isas.append(gemm_kernels.PANELS_AVX512)

    gemm_rates = []
    for k, n in shapes:
        w = torch.randn(n, k) * 0.02
        packed = pack_panels(w) if gemm_kernels.f32_panels_isa() else None
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k)
            gflop = 2 * m * k * n / 1e9
            few = gflop / best_s(lambda: dense_kernels.linear(x, w), repeats) if m <= dense_kernels.GEMV_MAX_ROWS else 0
            cells = [
                few,
                gflop / best_s(lambda: dense_kernels.gemm(x, w), repeats),
                gflop / best_s(lambda: torch.mm(x, w.t()), repeats),
                gflop / best_s(lambda: torch.mm(w, x.t()).t(), repeats),
                *(
                    gflop / best_s(lambda isa=isa: gemm_kernels.f32_panels_product(x, packed, n, isa), repeats)
                    if packed is not None
                    else 0
                    for isa in isas
                ),
            ]
            cells += [0.0] * (6 - len(cells))
            gemm_rates.append(cells[1])
            print(f"K {k:>5} N {n:>5} M {m:>5}: " + " ".join(f"{c:7.1f}" for c in cells), flush=True)
    if ceilings:
        ceilings.append(fma_ceiling(fma_peak, threads))
        top = max(ceilings)
        print(
            f"FMA ceiling after: {ceilings[1]:.1f} GFLOP/s; petrel GEMM {min(gemm_rates) / top:.0%}-"
            f"{max(gemm_rates) / top:.0%} of {top:.1f}"
        )


def prefill(args) -> None:
    from petrel.model import llama

    stack = "decoder stack (C)"
    timers = Timers()
    timers.wrap(dense_kernels.DecoderStack, "__call__", lambda a: stack)
    if args.layer_by_layer:
        llama.LlamaForCausalLM._step_in_one_call = lambda self, *a: None
    timers.wrap(dense_kernels, "prefill_attention")
    linear_shapes: dict[str, tuple[int, int]] = {}

    def linear_label(args) -> str:
        layer = args[0]
        shape = tuple(layer.qweight.shape if isinstance(layer, QuantizedLinear) else layer.weight.shape)
        linear_shapes[f"Linear {shape}"] = shape
        return f"Linear {shape}"

    timers.wrap(layers.Linear, "forward", linear_label)
    timers.wrap(QuantizedLinear, "forward", linear_label)  # quantization, dtype bfloat16 on the CPU
    llm = engine(args)
    cfg = load_model_config(resolve_model(args.model))
    if args.w2_prompts:
        prompts = make_w2_prompts(args.w2_prompts)
    else:
        prompts = [np.random.default_rng(6).integers(100, 30000, size=args.tokens).tolist()]
    llm.generate([{"prompt_token_ids": prompts[0][:64]}], SamplingParams(max_tokens=1), use_tqdm=False)  # warm-up
    timers.clear()
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1), use_tqdm=False)
    tokens = sum(map(len, prompts))
    print(f"prefill of {len(prompts)} prompt(s), {tokens} tokens: {time.perf_counter() - t0:.2f} s, of which")
    for key, seconds in sorted(timers.seconds.items(), key=lambda kv: -kv[1]):
        print(f"  {key}: {seconds:.2f} s ({timers.calls[key]} calls)")
    # the decoder's projections see every prompt token (the LM head, vocab_size rows, only the last ones)
    hidden, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_token = 2 * hidden * (q + 2 * kv + q + 3 * cfg.intermediate_size) * cfg.num_hidden_layers
    shapes = {key: shape for key, shape in linear_shapes.items() if shape[0] != cfg.vocab_size}
    if (seconds := timers.seconds[stack]) and not any(timers.seconds[key] for key in shapes):  # the stack took them
        print(f"  the decoder's projections over the stack's time: {tokens * per_token / seconds / 1e9:.0f} GFLOP/s")
    if seconds := sum(timers.seconds[key] for key in shapes):
        print(f"  the decoder's projections: {seconds:.2f} s, {tokens * per_token / seconds / 1e9:.0f} GFLOP/s")


def engine(args) -> LLM:
    """The engine prefill and decode time: --model at --dtype / --kv-cache-dtype, a 4 GiB cache, no prefix cache."""
    return LLM(
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        kv_cache_memory=4 << 30,
        enable_prefix_caching=False,
    )


def decode(args) -> None:
    from petrel.engine import engine_core
    from petrel.engine.model_runner import ModelRunner
    from petrel.model import llama

    stack = "decoder stack (C)"
    timers = Timers()
    timers.wrap(dense_kernels.DecoderStack, "__call__", lambda a: stack)
    timers.wrap(llama.LlamaForCausalLM, "compute_logits", lambda a: "LM head")
    timers.wrap(sampler.Sampler, "sample", lambda a: "sampler")
    # the engine's steps of decodes only (every row one new token: prompt chunks run the decoder stack too), their
    # time and their calls
    steps = {"n": 0, "seconds": 0.0, "inside": collections.defaultdict(float), "calls": collections.Counter()}
    inner_step, inner_execute = engine_core.EngineCore.step, ModelRunner.execute
    ran = {"decodes only": False}

    def noted_execute(self, batch):
        ran["decodes only"] = all(n == 1 for n in batch.num_new_tokens)
        return inner_execute(self, batch)

    def timed_step(self):
        before, calls_before, t0 = dict(timers.seconds), collections.Counter(timers.calls), time.perf_counter()
        ran["decodes only"] = False
        try:
            return inner_step(self)
        finally:
            if ran["decodes only"] and timers.calls[stack] > calls_before[stack]:
                steps["n"] += 1
                steps["seconds"] += time.perf_counter() - t0
                for key, seconds in timers.seconds.items():
                    steps["inside"][key] += seconds - before.get(key, 0.0)
                    steps["calls"][key] += timers.calls[key] - calls_before[key]

    engine_core.EngineCore.step = timed_step
    ModelRunner.execute = noted_execute
    llm = engine(args)
    prompts = [{"prompt_token_ids": p[: args.prompt_tokens or None]} for p in make_w2_prompts(args.seqs)]
    llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)  # warm-up
    steps.update(n=0, seconds=0.0, inside=collections.defaultdict(float), calls=collections.Counter())
    params = SamplingParams(max_tokens=args.steps + 1, ignore_eos=True, temperature=args.temperature)
    llm.generate(prompts, params, use_tqdm=False)
    n = steps["n"]
    per_step = steps["seconds"] / n
    print(f"{args.seqs} sequences: {n} steps of decodes only, {per_step * 1000:.1f} ms a step")
    inside = 0.0
    for key, seconds in steps["inside"].items():
        inside += seconds / n
        print(f"  {key}: {seconds / n * 1000:.1f} ms a step ({steps['calls'][key]} calls)")
    print(f"  around them: {(per_step - inside) * 1000:.1f} ms a step")


def attention(args) -> None:
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    isas = ["avx2", "avx512"] if native.cpu_has_avx512() else ["avx2"]
    dtype = torch.bfloat16 if args.kv_cache_dtype == "bfloat16" else torch.float32
    if dtype is torch.bfloat16:  # what each ISA's kernel does with the cache
        names = {
            "avx2": "avx2 widened",
            "avx512": "avx512 " + ("dpbf16" if dense_kernels._bf16_cache_kind() == 2 else "widened"),
        }
    else:
        names = {isa: isa for isa in isas}
    for chunk in args.chunks.split(","):
        n, first_pos = (int(v) for v in chunk.split("@"))
        blocks = (first_pos + n + block_size - 1) // block_size
        k_cache, v_cache = (torch.randn(blocks, block_size, kv_heads, head_dim).to(dtype) for _ in range(2))
        table, q = torch.randperm(blocks), torch.randn(n, heads, head_dim)
        flop = 2 * 2 * heads * head_dim * sum(first_pos + i + 1 for i in range(n))  # causal: the keys each query sees
        best = {}
        for _ in range(args.repeats):  # each ISA's kernel in turn, so that both see the machine's same minutes
            for isa in isas:
                with kernel_isa(isa):
                    seconds = best_s(
                        lambda: dense_kernels.prefill_attention(
                            q, k_cache, v_cache, table, first_pos, head_dim**-0.5, None
                        ),
                        3,
                    )
                best[isa] = min(best.get(isa, seconds), seconds)
        rates = ", ".join(f"{names[isa]} {s * 1000:.1f} ms {flop / s / 1e9:.0f} GFLOP/s" for isa, s in best.items())
        print(f"{n} queries after {first_pos} ({str(dtype).removeprefix('torch.')} cache): {rates}")


def decode_attention(args) -> None:
    heads, kv_heads = (int(n) for n in args.heads.split(","))
    head_dim, block_size, layers_ = 64, 16, 6
    dtype = torch.bfloat16 if args.kv_cache_dtype == "bfloat16" else torch.float32
    size = dtype.itemsize
    for case in args.contexts.split(","):
        seqs, ctx = (int(v) for v in case.split("x"))
        blocks = (ctx + block_size - 1) // block_size
        caches = [
            tuple(torch.randn(seqs * blocks, block_size, kv_heads, head_dim).to(dtype) for _ in range(2))
            for _ in range(layers_)
        ]
        tables = torch.stack([torch.randperm(seqs * blocks)[:blocks] for _ in range(seqs)])
        lens, q = torch.full((seqs,), ctx, dtype=torch.int64), torch.randn(seqs, heads, head_dim)

        def attend():
            for k, v in caches:
                dense_kernels.decode_attention(q, k, v, tables, lens, head_dim**-0.5, None)

        def widened():  # through the AVX2 loops, where the CPU would take AVX-512's (float32) or dpbf16's
            with kernel_isa("avx2"):
                attend()

        def read():
            for k, v in caches:
                k.sum(), v.sum()

        loops = {"": attend}
        if dtype is torch.bfloat16 and dense_kernels._bf16_cache_kind() == 2:
            loops = {" dpbf16": attend, " widened": widened}
        elif dtype is torch.float32 and native.cpu_has_avx512():
            loops = {" AVX-512": attend, " AVX2": widened}
        seconds, read_s = dict.fromkeys(loops, float("inf")), float("inf")
        for _ in range(7):  # interleaved: the memory's rate on this shared machine moves from minute to minute
            for name, run in loops.items():
                seconds[name] = min(seconds[name], best_s(run, 1) / layers_)
            read_s = min(read_s, best_s(read, 1) / layers_)
        kv_gb, cache_gb = seqs * ctx * 2 * kv_heads * head_dim * size / 1e9, 2 * caches[0][0].numel() * size / 1e9
        for name, s in seconds.items():
            print(
                f"{seqs} x {ctx} keys ({args.kv_cache_dtype}{name}): {s * 1000:.2f} ms a layer, "
                f"{kv_gb / s:.1f} GB/s of keys and values; "
                f"torch's sum of the caches {cache_gb / read_s:.1f} GB/s ({kv_gb / s / (cache_gb / read_s):.0%})"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["gemm", "prefill", "decode", "attention", "decode-attention"])
    ap.add_argument("--model", default=None, help="a Hugging Face directory or GGUF file (default: the default model)")
    ap.add_argument("--rows", default="16,64,256,512,1024", help="gemm: rows of x")
    ap.add_argument(
        "--repeats", type=int, default=5, help="gemm: each cell the best of this many calls; attention: rounds"
    )
    ap.add_argument("--ceiling", action="store_true", help="gemm: also the FMA ceiling (gcc, fma_peak.c)")
    ap.add_argument("--dtype", default="auto", help="prefill, decode: the engine's dtype (bfloat16: bfloat16 weights)")
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="prefill, decode: the engine's kv_cache_dtype; attention, decode-attention: the caches' (float32 or "
        "bfloat16)",
    )
    ap.add_argument("--quantization", default=None, help="prefill, decode: e.g. int8 (default: none)")
    ap.add_argument("--tokens", type=int, default=7936, help="prefill: the prompt's length")
    ap.add_argument("--w2-prompts", type=int, default=0, help="prefill: W2's first N prompts instead")
    ap.add_argument(
        "--layer-by-layer", action="store_true", help="prefill: each layer's operations from Python, timed apart"
    )
    ap.add_argument("--seqs", type=int, default=16, help="decode: sequences")
    ap.add_argument("--steps", type=int, default=32, help="decode: steps timed")
    ap.add_argument("--temperature", type=float, default=0.0, help="decode: 0 for greedy rows")
    ap.add_argument("--prompt-tokens", type=int, default=8, help="decode: W2's prompts cut to N tokens (0: whole)")
    ap.add_argument("--chunks", default="2048@0,2048@5888", help="attention: N@P, comma-separated")
    ap.add_argument("--contexts", default="4x7936,16x2000,64x400,1x7936", help="decode-attention: SxC, comma-separated")
    ap.add_argument("--heads", default="9,3", help="decode-attention: query heads,KV heads (default SmolLM2's)")
    args = ap.parse_args()
    what = {
        "gemm": gemm,
        "prefill": prefill,
        "decode": decode,
        "attention": attention,
        "decode-attention": decode_attention,
    }
    what[args.what](args)


if __name__ == "__main__":
    main()
