"""The experts' kernel (moe.c, moe_kernels.py): one call per MoE layer against a float64 reference, for every weight
format it takes (float32 rows and panels, bfloat16 rows and panels, int8 rows, GGUF Q8_0 and Q4_K blocks), ragged
token counts per expert with experts that get no token, top-k 1, 2 and 8, 1 and 2 threads, the AVX-512 and AVX2
blocks; the torch loop it falls back to gives the same sums; a spy (the unused experts' weights made unreadable)
shows a decode step reads no unused expert's weights; the engine's tokens are the same through the kernel and
through the torch loop."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from petrel.model import dense_kernels, gemm_kernels, moe_kernels
from petrel.model.moe import Experts
from petrel.model.quantization import QuantizedWeight

E, UNUSED = 10, (3, 7)  # experts 3 and 7 never get a token
FORMATS = ["f32-rows", "f32-panels", "bf16-rows", "bf16-panels", "int8", "Q8_0", "Q4_K"]


@pytest.fixture(autouse=True)
def kernels():
    if dense_kernels.library() is None:
        pytest.skip("petrel's kernels cannot run here (no AVX2/FMA or no C compiler)")


@pytest.fixture(params=["avx512", "avx2"])
def isa(request, monkeypatch):
    """The AVX-512 blocks where the CPU has them, and the AVX2 ones (PETREL_AVX512=0) everywhere."""
    monkeypatch.setenv("PETREL_AVX512", "1" if request.param == "avx512" else "0")
    return request.param


def make_weight(fmt: str, matrix: torch.Tensor, seed: int):
    """matrix [N, K] in format fmt (Q8_0 / Q4_K: random blocks of that type, whatever the matrix)."""
    if fmt == "f32-rows":
        return matrix
    if fmt == "f32-panels":
        return QuantizedWeight.float32_panels(matrix)
    if fmt in ("bf16-rows", "bf16-panels"):
        return QuantizedWeight.bfloat16(matrix, panels=fmt == "bf16-panels")
    if fmt == "int8":
        return QuantizedWeight.int8_per_channel(matrix)
    from test_quantization import random_blocks

    n, k = matrix.shape
    return QuantizedWeight.from_gguf(fmt, random_blocks(fmt, n, k, seed=seed), n, k)


@functools.cache
def build_experts(fmt: str, hidden: int, inter: int, seed: int = 0) -> Experts:
    g = torch.Generator().manual_seed(seed)
    experts = Experts(E, hidden, inter)
    experts.gate_up_proj.data.copy_(torch.randn(E, 2 * inter, hidden, generator=g) / hidden**0.5)
    experts.down_proj.data.copy_(torch.randn(E, hidden, inter, generator=g) / inter**0.5)
    if fmt != "f32-rows":
        count = iter(range(1000))
        experts.hold_experts(lambda m: make_weight(fmt, m.detach().clone(), seed + next(count)))
    return experts


def route(tokens: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top_k distinct experts out of the used ones, drawn with uneven odds (ragged counts), and
    routing weights."""
    g = torch.Generator().manual_seed(seed)
    used = torch.tensor([e for e in range(E) if e not in UNUSED])
    odds = torch.linspace(1.0, 6.0, len(used))
    ids = torch.stack([used[torch.multinomial(odds, top_k, generator=g)] for _ in range(tokens)])
    return ids, torch.rand(tokens, top_k, generator=g) + 0.1


def reference(experts: Experts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """float64: each token's sum over its picks of weight * down(silu(gate) * up)(x), the weights as held."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = experts.intermediate_size
    for e in ids.unique().tolist():
        gate_up, down = (
            w.double() if isinstance(w, torch.Tensor) else w.dequantize().double() for w in experts.expert_weights(e)
        )
        rows, picks = (ids == e).nonzero(as_tuple=True)
        h = x[rows].double() @ gate_up.t()
        y = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ down.t()
        out.index_add_(0, rows, y * weights[rows, picks].double().unsqueeze(1))
    return out


def tolerance(fmt: str) -> float:
    """Relative to the largest output: float32 rounding; quantized products of a few rows round x to 16 bits a
    block of 32 first (quant_kernels.c: 2^-16 of the block's largest value); bfloat16 panels round x (and the
    activation) to bfloat16 first (dpbf16), a relative 2^-9 each."""
    return {"bf16-panels": 2e-2, "int8": 3e-4, "Q8_0": 3e-4, "Q4_K": 3e-4}.get(fmt, 2e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_equals_a_float64_reference(fmt, top_k, threads, isa, monkeypatch):
    if fmt == "bf16-panels" and not gemm_kernels.bf16_panels():
        pytest.skip("bfloat16 panels are multiplied only where the CPU has AVX512_BF16 (and AVX-512 is on)")
    if fmt == "bf16-rows":
        monkeypatch.setenv("PETREL_BF16_ACTIVATIONS", "0")  # each weight widened exactly (panels always round x)
    monkeypatch.setenv("PETREL_INT8_COMPUTE", "0")  # quantized products in floats: the reference's arithmetic
    # K-quants' blocks of 256 columns; other quantized codes' groups of 32; else a width that is no multiple of 32
    hidden, inter = {"Q4_K": (256, 256), "Q8_0": (256, 64), "int8": (256, 64)}.get(fmt, (272, 48))
    experts = build_experts(fmt, hidden, inter, seed=FORMATS.index(fmt))
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for tokens in (1, 5, 40):  # a decode step, a few rows, a prompt's worth (ragged counts, some above 12)
            ids, weights = route(tokens, top_k, seed=tokens + top_k)
            x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens))
            expected = reference(experts, x, ids, weights)
            got = moe_kernels.experts(experts, x, ids, weights)
            assert got is not None, "the kernel did not take the layer"
            bound = tolerance(fmt) * expected.abs().max().item()
            assert (got.double() - expected).abs().max().item() <= bound, (tokens, fmt)
            counts = torch.bincount(ids.reshape(-1), minlength=E)
            fallback = experts._forward_torch(x, ids.reshape(-1), weights.reshape(-1), counts, top_k)
            assert (fallback.double() - expected).abs().max().item() <= bound, ("torch loop", tokens, fmt)
    finally:
        torch.set_num_threads(saved)


def test_scratch_kept_between_calls_leaves_no_trace():
    """A thread keeps its scratch from call to call (scratch.c): a few rows after a prompt's worth, in the larger
    buffer the prompt left full of its rows, give exactly what they gave before it."""
    experts = build_experts("f32-panels", 272, 48)
    ids, weights = route(3, 2, seed=1)
    x = torch.randn(3, 272, generator=torch.Generator().manual_seed(1))
    before = moe_kernels.experts(experts, x, ids, weights)
    big_ids, big_weights = route(200, 8, seed=2)
    big_x = torch.randn(200, 272, generator=torch.Generator().manual_seed(2))
    big = moe_kernels.experts(experts, big_x, big_ids, big_weights)
    after = moe_kernels.experts(experts, x, ids, weights)
    assert torch.equal(before, after)
    expected = reference(experts, big_x, big_ids, big_weights)
    assert (big.double() - expected).abs().max().item() <= 2e-5 * expected.abs().max().item()


def test_a_prompt_step_in_chunks_equals_the_reference():
    """Past 32 MiB of rows a pass (moe.c's chunk_tokens: here 8 picks x (272 + 3 x 48) floats a token, 2,520 tokens)
    the tokens go through the experts in even chunks; every token's output is still its own picks' sum."""
    experts = build_experts("f32-panels", 272, 48)
    ids, weights = route(2600, 8, seed=3)  # two chunks of 1,300
    x = torch.randn(2600, 272, generator=torch.Generator().manual_seed(3))
    got = moe_kernels.experts(experts, x, ids, weights)
    expected = reference(experts, x, ids, weights)
    assert (got.double() - expected).abs().max().item() <= 2e-5 * expected.abs().max().item()


def test_integer_products_equal_the_torch_loops(monkeypatch):
    """From 13 rows an expert GGUF's blocks multiply in integers (group_gemm.c): the kernel's per-expert products
    are the ones QuantizedWeight.matmul runs, so the kernel equals the torch loop up to the order of the sums."""
    experts = build_experts("Q4_K", 256, 256, seed=11)
    ids, weights = route(64, 2, seed=5)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(6))
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    assert counts.max() >= 13
    got = moe_kernels.experts(experts, x, ids, weights)
    fallback = experts._forward_torch(x, ids.reshape(-1), weights.reshape(-1), counts, 2)
    torch.testing.assert_close(got, fallback, atol=1e-5 * fallback.abs().max().item(), rtol=0)


def test_expert_parallel_ranks_sum_to_the_whole():
    """With expert parallelism each rank computes its experts' picks only; the ranks' outputs sum to one rank's."""
    from petrel.model.parallel import TensorParallel

    whole = build_experts("f32-panels", 272, 48, seed=2)
    ids, weights = route(9, 2, seed=3)
    x = torch.randn(9, 272, generator=torch.Generator().manual_seed(4))
    parts = []
    for rank in range(3):
        tp = TensorParallel(rank, 3)
        tp.expert_parallel = True
        mine = Experts(E, 272, 48, tp)
        for e in range(mine.num_local):
            for name in ("gate_up", "down"):
                src = whole.expert_weights(mine.first + e)[0 if name == "gate_up" else 1].dequantize()
                getattr(mine, f"{name}_proj").data[e].copy_(src)
        parts.append(moe_kernels.experts(mine, x, ids, weights))
    expected = moe_kernels.experts(whole, x, ids, weights)
    torch.testing.assert_close(sum(parts), expected, atol=1e-5, rtol=1e-5)


SPY = textwrap.dedent(
    """
    import ctypes, mmap, os, sys
    import torch
    sys.path.insert(0, {tests!r})
    from test_moe_kernel import build_experts, route
    from petrel.model import moe_kernels
    from petrel.model.quantization import QuantizedWeight

    experts = build_experts("f32-panels", 256, 256, seed=1)
    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    protect = {protect}
    for e in range(experts.num_local):  # each expert's weights moved onto pages of their own
        for w in experts.held[e]:
            size = w.codes.numel() * 4
            buffer = mmap.mmap(-1, size)
            codes = torch.frombuffer(buffer, dtype=torch.float32).view(w.codes.shape)
            codes.copy_(w.codes)
            w._buffers["codes"] = codes
            w._keep = buffer
            if e in protect:
                assert size % mmap.PAGESIZE == 0
                address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
                assert libc.mprotect(address, size, 0) == 0  # PROT_NONE: a read is a segmentation fault
    ids = torch.tensor([[1, 4], [4, 8]])  # two decode rows: experts 1, 4 and 8 only
    x = torch.randn(2, 256)
    for avx512 in ("1", "0"):  # the AVX-512 blocks, then the AVX2 ones
        os.environ["PETREL_AVX512"] = avx512
        out = moe_kernels.experts(experts, x, ids, torch.tensor([[0.75, 0.25], [0.5, 0.5]]))
        assert out is not None and torch.isfinite(out).all()
    print("read only the used experts")
    """
)


def test_a_decode_step_reads_no_unused_experts_weights():
    """The weights of every expert the step does not use are made unreadable (mprotect PROT_NONE): the kernel
    still runs (with the AVX-512 blocks and with the AVX2 ones); the control run, with a used expert's weights
    unreadable as well, dies of the read."""
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(tests), tests])}
    unused = [e for e in range(E) if e not in (1, 4, 8)]
    for protect, ok in ((unused, True), ([*unused, 4], False)):
        script = SPY.format(tests=tests, protect=protect)
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        if ok:
            assert proc.returncode == 0 and "read only the used experts" in proc.stdout, proc.stderr[-2000:]
        else:
            assert proc.returncode == -11, (proc.returncode, proc.stderr[-2000:])  # SIGSEGV
