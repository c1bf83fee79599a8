"""petrel's float32 CPU kernels (petrel/model/dense_kernels.c) against the torch computations they replace.

The few-row product must equal x @ W^T, and paged decode attention must equal the torch path (gathered blocks +
masked SDPA, itself checked against transformers in test_model_tiny) for GQA/MHA, head sizes up to 256, partial
last blocks, padded block tables, scrambled blocks and sliding windows. The engine-level tests of test_model_tiny
run with the kernels on and off."""

from __future__ import annotations

import math

import pytest
import torch

from petrel.model import dense_kernels, gemm_kernels, native
from petrel.model.attention import _decode_attention
from petrel.model.layers import Linear, RMSNorm, RotaryEmbedding, silu_and_mul

pytestmark = pytest.mark.skipif(
    dense_kernels.library() is None, reason="petrel's float32 kernels cannot run here (no AVX2/FMA or no C compiler)"
)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16, 70])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (37, 16), (1001, 576)])
def test_few_row_product_equals_matmul(rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    got = dense_kernels.linear(x, w)
    assert got is not None and got.shape == (rows, out_features)
    torch.testing.assert_close(got, x @ w.t(), atol=1e-4, rtol=1e-5)


def test_linear_layer_uses_the_kernel_with_bias_and_falls_back():
    layer = Linear(64, 40, bias=True)
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-4, rtol=1e-5)
    assert dense_kernels.linear(torch.randn(dense_kernels.GEMV_MAX_ROWS + 1, 64), layer.weight) is None  # many rows
    assert dense_kernels.linear(torch.randn(2, 24), torch.randn(5, 24)) is None  # K not a multiple of 16
    assert dense_kernels.linear(torch.randn(2, 64).double(), layer.weight.double()) is None


needs_avx512 = pytest.mark.skipif(not native.cpu_has_avx512(), reason="no AVX-512 here")
# every many-row kernel this CPU can run: the AVX2 one runs everywhere the kernels do (forced with PETREL_AVX512=0 on
# AVX-512 machines, so CI tests both ISAs' kernels there and the AVX2 one on AVX2-only machines)
ISAS = [pytest.param("avx2", id="avx2"), pytest.param("avx512", id="avx512", marks=needs_avx512)]


def _run_isa(request, monkeypatch, kernels: dict[str, str]):
    """Force request.param's ISA (kernels: ISA -> the library function that ISA runs), yield it, then check with a
    spy on the library that its kernel, and only it, ran."""
    if request.param == "avx2":
        monkeypatch.setenv("PETREL_AVX512", "0")
    lib, ran = dense_kernels.library(), []
    for name in kernels.values():
        kernel = getattr(lib, name)
        monkeypatch.setattr(lib, name, lambda *a, kernel=kernel, name=name: ran.append(name) or kernel(*a))
    yield request.param
    assert ran and set(ran) == {kernels[request.param]}, ran


@pytest.fixture(params=ISAS)
def gemm_isa(request, monkeypatch):
    """The ISA whose GEMM dense_kernels.gemm runs in this test."""
    yield from _run_isa(request, monkeypatch, {"avx512": "f32_gemm", "avx2": "f32_gemm_avx2"})


@pytest.fixture(params=ISAS)
def bf16_gemm_isa(request, monkeypatch):
    """The ISA whose GEMM gemm_kernels.bf16_product runs for many rows in this test."""
    yield from _run_isa(request, monkeypatch, {"avx512": "bf16_gemm", "avx2": "bf16_gemm_avx2"})


@pytest.fixture(params=ISAS)
def prefill_isa(request, monkeypatch):
    """The ISA whose inner step dense_kernels.prefill_attention runs in this test (its next-to-last argument, avx512,
    chooses); a spy on the library shows which one ran."""
    if request.param == "avx2":
        monkeypatch.setenv("PETREL_AVX512", "0")
    lib, ran = dense_kernels.library(), []
    kernel = lib.paged_prefill_attention
    monkeypatch.setattr(lib, "paged_prefill_attention", lambda *a: ran.append(a[-2]) or kernel(*a))
    yield request.param
    assert ran and set(ran) == {int(request.param == "avx512")}, ran


# whole blocks of rows (6 and 14: both kernels' block heights), and tails; K in one slice (576) and in several (1000,
# 2100: slices of 512 and shorter ones, the last not a multiple of 16); N over several chunks of panels (960)
@pytest.mark.parametrize("rows", [257, 14 * 30, 1000])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (33, 1000), (300, 2100), (7, 64), (48, 1), (17, 5)])
def test_many_row_product_equals_matmul(rows, out_features, in_features, gemm_isa):
    g = torch.Generator().manual_seed(rows + out_features)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    got = dense_kernels.gemm(x, w)
    assert got is not None and got.shape == (rows, out_features)
    _assert_within_float32_sum_bound(got, x, w)
    x_strided = torch.randn(rows, 2 * in_features, generator=g)[:, ::2]  # taken as a contiguous copy
    _assert_within_float32_sum_bound(dense_kernels.gemm(x_strided, w), x_strided, w)


def _assert_within_float32_sum_bound(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """got == x @ w^T up to float32 rounding: the float64 product, within K units of float32 rounding times
    |x| @ |w|^T, the worst case of any order of K float32 multiply-adds (a K slice summed twice or skipped misses by
    the size of the product itself)."""
    exact = x.double() @ w.double().t()
    bound = x.shape[1] * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().t())
    assert ((got.double() - exact).abs() <= bound + 1e-30).all(), (got.double() - exact).abs().max()


def test_many_row_product_writes_no_column_past_n(gemm_isa):
    """A partial last panel of W (N not a multiple of 16 or 32) must not write past each row's N columns: the rows
    are packed, so a stray write would land in the next row's first columns."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(300, 40, generator=g), torch.randn(21, 40, generator=g)
    got = dense_kernels.gemm(x, w)
    torch.testing.assert_close(got, x @ w.t(), atol=1e-4, rtol=1e-4)


def _bf16_case(rows: int, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rows * 7 + out_features)
    return torch.randn(rows, in_features, generator=g), torch.randn(out_features, in_features, generator=g).bfloat16()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 13, 64, 256])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (37, 16), (1001, 576)])
def test_bf16_few_row_product_equals_the_widened_weights(rows, out_features, in_features, monkeypatch):
    """bfloat16 weight rows (quantization 'bf16') multiply float32 x as the float32 values they widen to, exactly."""
    monkeypatch.setenv("PETREL_BF16_ACTIVATIONS", "0")
    x, w = _bf16_case(rows, out_features, in_features)
    got = gemm_kernels.bf16_product(x, w)
    assert got is not None and got.shape == (rows, out_features)
    _assert_within_float32_sum_bound(got, x, w.float())


needs_bf16_pairs = pytest.mark.skipif(not gemm_kernels.bf16_pairs_rows(), reason="no AVX512_BF16 here")


# rows: the few-row kernels (passes of 1, 2, 3, 4 rows), the GEMM (from 128); K a multiple of 32 or not (masked)
@needs_bf16_pairs
@pytest.mark.parametrize("rows", [1, 2, 3, 17, 127, 128, 257, 14 * 30])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (33, 1000), (300, 2100), (17, 18)])
def test_bf16_pairs_product_equals_rounded_x_times_the_weights(rows, out_features, in_features, monkeypatch):
    """From bf16_pairs_rows() rows x is rounded to bfloat16 (nearest even, as torch rounds) and multiplied two
    products an instruction (dpbf16): the float64 product of the rounded x and the weights, within float32 sums'
    bound (K in one slice and in several; rows x K not a multiple of 32: the rounding's masked tail)."""
    x, w = _bf16_case(rows, out_features, in_features)
    lib, ran = dense_kernels.library(), []
    kernel = lib.bf16_pairs_product
    monkeypatch.setattr(lib, "bf16_pairs_product", lambda *a: ran.append(a[1]) or kernel(*a))
    got = gemm_kernels.bf16_product(x, w)
    assert ran == [rows] and got.shape == (rows, out_features)
    _assert_within_float32_sum_bound(got, x.bfloat16().float(), w.float())


# rows: blocks of up to 8 sized evenly (9: 5 and 4; 15: 8 and 7), past 256 in passes; N in partial panels (past it
# nothing written: the rows of y are packed); K from one pair to several thousand
@needs_bf16_pairs
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 15, 64, 133, 300])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (33, 1000), (300, 2100), (17, 2), (32, 64)])
def test_bf16_panels_product_equals_rounded_x_times_the_weights(rows, out_features, in_features):
    """Weights packed in panels (quantization.pack_panels, as dtype 'bfloat16' holds projections where the CPU has
    AVX512_BF16): x rounded to bfloat16 times the weights, within float32 sums' bound, for every count of rows; the
    packing undone gives the rows back."""
    from petrel.model.quantization import pack_panels, unpack_panels

    x, w = _bf16_case(rows, out_features, in_features)
    packed = pack_panels(w)
    assert packed.shape == (-(-out_features // 32), in_features // 2, 32, 2)
    assert torch.equal(unpack_panels(packed, tuple(w.shape)), w)
    got = gemm_kernels.bf16_panels_product(x, packed, out_features)
    assert got is not None and got.shape == (rows, out_features)
    _assert_within_float32_sum_bound(got, x.bfloat16().float(), w.float())


def test_bf16_weights_in_panels_only_where_products_round_x(monkeypatch):
    """QuantizedWeight.bfloat16 packs a projection's (or an embedding's) weights in panels where bf16_panels()
    (AVX512_BF16, the kernels on), and the rows read back are the weights'; a product of them where x may not be
    rounded (PETREL_BF16_ACTIVATIONS=0 after loading) is the float32 one of the unpacked weights, and the decoder
    stack does not take them."""
    from petrel.model.quantization import QuantizedWeight

    x, w = _bf16_case(5, 40, 64)
    packed = QuantizedWeight.bfloat16(w.float(), panels=True)
    assert packed.panels and torch.equal(packed.dequantize(), w.float())
    ids = torch.tensor([0, 31, 32, 39, 5, 5])  # an embedding's lookups: rows gathered across panels
    assert torch.equal(packed.dequantize(ids), w.float()[ids])
    assert torch.equal(packed.dequantize(slice(30, 34)), w.float()[30:34])
    monkeypatch.setenv("PETREL_BF16_ACTIVATIONS", "0")
    assert not gemm_kernels.bf16_panels() and dense_kernels.describe(packed) is None
    assert gemm_kernels.bf16_panels_product(x, packed.codes, 40) is None
    torch.testing.assert_close(packed.matmul(x), x @ w.float().t(), rtol=1e-6, atol=1e-5)


@pytest.fixture(params=ISAS)
def panels_isa(request, monkeypatch):
    """Float32 panels multiplied by request.param's blocks (AVX2's forced with PETREL_AVX512=0): yields the isa
    f32_panels_product is to be called with (gemm_kernels.PANELS_AVX2 or PANELS_AVX512), then checks, with a spy on
    the library, that every call passed it."""
    if request.param == "avx2":
        monkeypatch.setenv("PETREL_AVX512", "0")
    isa = gemm_kernels.PANELS_AVX2 if request.param == "avx2" else gemm_kernels.PANELS_AVX512
    lib, passed = gemm_kernels.library(), []
    product = lib.f32_panels_product
    monkeypatch.setattr(lib, "f32_panels_product", lambda *a: passed.append(a[-1]) or product(*a))
    yield isa
    assert passed and set(passed) == {isa}, passed


# rows: AVX-512 blocks of up to 8 sized evenly (41: five of 7 and one of 6), AVX2 ones of up to 3 over whole panels
# (1-3 rows) or of up to 6 over half panels (4: one of 4; 7: 4 and 3; 41: six of 6 and one of 5), with the next
# slice prefetched (AVX-512 from 8 rows, AVX2 halves always) and without, past 256 in passes (300: one full and one
# short, 523: two full and one of 11 rows); N in partial panels and partial halves (17, 33); K from one value to
# several slices of 1,024 (2,100: three, the last shorter)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 41, 64, 133, 300, 523])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (33, 1000), (300, 2100), (17, 1), (32, 5)])
def test_f32_panels_product_equals_matmul(panels_isa, rows, out_features, in_features):
    """float32 weights packed in panels (quantization.pack_panels, as a float32 model's decoder projections are held
    wherever the kernels run): x @ W^T within float32 sums' bound for every count of rows with either ISA's blocks;
    the packing undone gives the rows back."""
    from petrel.model.quantization import pack_panels, unpack_panels

    x, w = torch.randn(rows, in_features), torch.randn(out_features, in_features)
    packed = pack_panels(w)
    assert packed.shape == (-(-out_features // 32), in_features, 32, 1)
    assert torch.equal(unpack_panels(packed, tuple(w.shape)), w)
    got = gemm_kernels.f32_panels_product(x, packed, out_features)
    assert got is not None and got.shape == (rows, out_features)
    _assert_within_float32_sum_bound(got, x, w)


@pytest.mark.parametrize("rows", [3, 4, 9, 13, 41, 300])
def test_a_rows_panel_product_does_not_depend_on_the_rows_beside_it(panels_isa, rows):
    """Each row of a panel product is summed over k in one order whatever block it falls in (AVX-512: blocks of 1 to
    8 rows, sized by the count; AVX2: whole panels for up to 3 rows, half panels from 4), so every row equals its
    product alone, bit for bit: float32 panels with either ISA's blocks, and bfloat16 ones where AVX512_BF16 runs."""
    from petrel.model.quantization import pack_panels

    x, w = torch.randn(rows, 1000), torch.randn(70, 1000)
    products = [(gemm_kernels.f32_panels_product, pack_panels(w))]
    if gemm_kernels.bf16_pairs_rows():
        products.append((gemm_kernels.bf16_panels_product, pack_panels(w.bfloat16())))
    for product, packed in products:
        together = product(x, packed, 70)
        alone = torch.cat([product(x[i : i + 1], packed, 70) for i in range(rows)])
        assert torch.equal(together, alone)


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_a_panel_product_does_not_depend_on_the_threads(panels_isa, rows):
    """Each output is summed by one thread in one order, whichever thread's share of the panels holds it: 1, 2 and
    3 threads give the same products bit for bit (float32 panels with either ISA's blocks, bfloat16 ones where
    AVX512_BF16 runs), over a few panels (70 columns: 3) and many (1,000: 32)."""
    from petrel.model.quantization import pack_panels

    threads = torch.get_num_threads()
    for out_features in (70, 1000):
        x, w = torch.randn(rows, 300), torch.randn(out_features, 300)
        products = [(gemm_kernels.f32_panels_product, pack_panels(w))]
        if gemm_kernels.bf16_pairs_rows():
            products.append((gemm_kernels.bf16_panels_product, pack_panels(w.bfloat16())))
        for product, packed in products:
            got = []
            try:
                for n in (1, 2, 3):
                    torch.set_num_threads(n)
                    got.append(product(x, packed, out_features))
            finally:
                torch.set_num_threads(threads)
            assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])


def test_f32_weights_in_panels_with_either_isa_and_without_kernels(panels_isa, monkeypatch):
    """QuantizedWeight.float32_panels: the rows read back are the weights (an embedding-style gather across panels
    too), the decoder stack takes them (bits 32, panels the ISA of their blocks), and its product is x @ W^T; where
    the kernels are off after loading (PETREL_DENSE_KERNELS=0) the product is the unpacked weights' and the stack
    declines them; PETREL_F32_PANELS=0 keeps a model's weights in rows."""
    from petrel.model import native
    from petrel.model.quantization import QuantizedWeight

    x, w = torch.randn(5, 64), torch.randn(40, 64)
    packed = QuantizedWeight.float32_panels(w)
    assert packed.panels and packed.bits == 32 and torch.equal(packed.dequantize(), w)
    ids = torch.tensor([0, 31, 32, 39, 5, 5])
    assert torch.equal(packed.dequantize(ids), w[ids])
    described = dense_kernels.describe(packed)
    assert (described.bits, described.panels) == (32, panels_isa) and gemm_kernels.f32_panels()
    torch.testing.assert_close(packed.matmul(x), x @ w.t(), rtol=1e-5, atol=1e-4)
    with monkeypatch.context() as patch:
        patch.setenv("PETREL_DENSE_KERNELS", "0")
        patch.delenv("PETREL_REQUIRE_KERNELS", raising=False)
        patch.setattr(native, "_loaded", {})
        assert not gemm_kernels.f32_panels() and dense_kernels.describe(packed) is None
        assert gemm_kernels.f32_panels_product(x, packed.codes, 40) is None
        torch.testing.assert_close(packed.matmul(x), x @ w.t(), rtol=1e-5, atol=1e-4)
    monkeypatch.setenv("PETREL_F32_PANELS", "0")
    assert not gemm_kernels.f32_panels()


def test_bf16_activations_switch(monkeypatch):
    """PETREL_BF16_ACTIVATIONS=0 (or PETREL_AVX512=0) keeps every bfloat16 product on float32 x."""
    for switch in ("PETREL_BF16_ACTIVATIONS", "PETREL_AVX512"):
        with monkeypatch.context() as patch:
            patch.setenv(switch, "0")
            assert gemm_kernels.bf16_pairs_rows() == 0
            x, w = _bf16_case(40, 24, 64)
            _assert_within_float32_sum_bound(gemm_kernels.bf16_product(x, w), x, w.float())


# as the float32 GEMM's cases: K in one slice and in several, the last not a multiple of 8 or 16 (the packing's
# tails), N in partial panels
@pytest.mark.parametrize("rows", [257, 14 * 30])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (33, 1000), (300, 2100), (17, 5)])
def test_bf16_many_row_product_equals_the_widened_weights(rows, out_features, in_features, bf16_gemm_isa, monkeypatch):
    monkeypatch.setenv("PETREL_BF16_ACTIVATIONS", "0")
    x, w = _bf16_case(rows, out_features, in_features)
    got = gemm_kernels.bf16_product(x, w)
    assert got is not None and got.shape == (rows, out_features)
    _assert_within_float32_sum_bound(got, x, w.float())


def _prefill_gemm_calls(monkeypatch) -> tuple[list, torch.Tensor, Linear]:
    """A biased Linear's product of SMALL_BATCH + 5 rows, checked against torch's; the calls it made to
    dense_kernels.gemm (a spy), its input and the layer."""
    layer = Linear(64, 40, bias=True)
    x = torch.randn(Linear.SMALL_BATCH + 5, 64)
    calls = []
    gemm = dense_kernels.gemm
    monkeypatch.setattr(dense_kernels, "gemm", lambda *a: calls.append(1) or gemm(*a))
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-4, rtol=1e-4)
    return calls, x, layer


def test_linear_layer_uses_the_gemm_for_prefill_with_bias(monkeypatch, gemm_isa):
    monkeypatch.setenv("PETREL_GEMM", "petrel")
    calls, x, layer = _prefill_gemm_calls(monkeypatch)
    assert calls == [1]
    assert dense_kernels.gemm(x.double(), layer.weight.double()) is None


@pytest.mark.parametrize("choice", ["", "torch", "petrel"])
def test_prefill_products_go_to_the_gemm_the_isa_measured_faster(monkeypatch, choice):
    """By default petrel's GEMM (measured ahead of torch's on both ISAs); PETREL_GEMM=torch chooses torch's; either
    way the layer computes the same product."""
    monkeypatch.setenv("PETREL_GEMM", choice)
    expected = choice != "torch"
    assert dense_kernels.prefill_gemm_is_petrels() is expected
    calls, _, _ = _prefill_gemm_calls(monkeypatch)
    assert calls == ([1] if expected and dense_kernels.library() is not None else [])


KV_DTYPES = pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32-cache", "bf16-cache"])
# the attention kernels' cache kinds (decode's and prefill's): float32; bfloat16 widened to float32
# (PETREL_BF16_ACTIVATIONS=0: on every CPU); and bfloat16 through dpbf16 (q and the softmax weights rounded to
# bfloat16 as products round x; where the CPU has AVX512_BF16), so that CI runs both bfloat16 loops on such machines
needs_dpbf16_cache = pytest.mark.skipif(dense_kernels._bf16_cache_kind() != 2, reason="no AVX512_BF16 here")
_KV_KINDS = ["f32-cache", "bf16-cache", pytest.param("bf16-cache-dpbf16", marks=needs_dpbf16_cache)]
ATTENTION_KV_KINDS = pytest.mark.parametrize("kv_kind", _KV_KINDS)
# decode attention's float32 cache also through the AVX2 loops (PETREL_AVX512=0) where AVX-512F's run by default
DECODE_KV_KINDS = pytest.mark.parametrize("kv_kind", ["f32-cache-avx2", *_KV_KINDS])


def _attention_kv_dtype(kv_kind: str, monkeypatch) -> tuple[torch.dtype, bool]:
    """The cache dtype of an ATTENTION_KV_KINDS case, and whether the dpbf16 loops (rounding q and the weights) run
    (after any switch of the ISA, such as prefill_isa's)."""
    if kv_kind == "f32-cache":  # decode attention: the AVX-512F loops where the CPU has them
        return torch.float32, False
    if kv_kind == "f32-cache-avx2":
        monkeypatch.setenv("PETREL_AVX512", "0")
        return torch.float32, False
    if kv_kind == "bf16-cache":
        monkeypatch.setenv("PETREL_BF16_ACTIVATIONS", "0")
        assert dense_kernels._bf16_cache_kind() == 1
        return torch.bfloat16, False
    return torch.bfloat16, dense_kernels._bf16_cache_kind() == 2


def test_bf16_cache_kind_follows_the_cpu(monkeypatch):
    """A bfloat16 cache goes to the dpbf16 loops (kv_bf16 2) exactly where products round x to bfloat16 (the CPU has
    AVX512_BF16 and BW, and neither PETREL_AVX512 nor PETREL_BF16_ACTIVATIONS is 0) and the CPU has AVX512VL; else to
    the widening ones (1); float32 caches are 0."""
    pairs = native.cpu_has_avx512() and native.cpu_has("avx512_bf16", "avx512bw", "avx512vl")
    cache = torch.zeros(4, 16, 2, 32, dtype=torch.bfloat16)
    assert dense_kernels._kv_bf16(cache, cache) == (2 if pairs else 1)
    assert dense_kernels._kv_bf16(cache.float(), cache.float()) == 0
    monkeypatch.setenv("PETREL_BF16_ACTIVATIONS", "0")
    assert dense_kernels._kv_bf16(cache, cache) == 1
    monkeypatch.setenv("PETREL_BF16_ACTIVATIONS", "1")
    monkeypatch.setenv("PETREL_AVX512", "0")
    assert dense_kernels._kv_bf16(cache, cache) == 1


def test_float32_cache_decode_loops_follow_the_cpu(monkeypatch):
    """A float32 cache's decode attention may run AVX-512F's loops where native.cpu_has_avx512 says so, else AVX2's:
    a spy on the library sees the avx512 flag each call passes, and both give the same attention."""
    q, cache, tables, lens_t = _paged_case(2, 4, 2, 32, 4, [5, 9], seed=4)
    lib, kinds, avx512 = dense_kernels.library(), [], native.cpu_has_avx512()
    kernel = lib.paged_decode_attention
    monkeypatch.setattr(lib, "paged_decode_attention", lambda *a: kinds.append((a[4], a[-2])) or kernel(*a))
    with_512 = dense_kernels.decode_attention(q, cache[0], cache[1], tables, lens_t, 0.2, None)
    monkeypatch.setenv("PETREL_AVX512", "0")
    with_avx2 = dense_kernels.decode_attention(q, cache[0], cache[1], tables, lens_t, 0.2, None)
    assert kinds == [(0, int(avx512)), (0, 0)]
    torch.testing.assert_close(with_512, with_avx2, atol=2e-6, rtol=1e-5)


def _paged_case(num_seqs, heads, kv_heads, head_dim, block_size, lens, seed, kv_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(blocks_needed) + 5
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(kv_dtype)
    order = torch.randperm(num_blocks, generator=g).tolist()
    width = max(blocks_needed) + 1  # one padding column past the longest sequence
    tables = torch.zeros(num_seqs, width, dtype=torch.int64)
    for s, n in enumerate(blocks_needed):
        tables[s, :n] = torch.tensor([order.pop() for _ in range(n)])
    q = torch.randn(num_seqs, heads, head_dim, generator=g)
    return q, cache, tables, torch.tensor(lens, dtype=torch.int64)


def _assert_decode_attention_is_torchs(q, cache, tables, lens_t, window, rounded=False):
    """The C kernel's result against the torch path's (attention._decode_attention) on the same paged case (a
    bfloat16 cache: both widen its values exactly; rounded: the kernel's dpbf16 loops round q and the weights)."""
    block_size, head_dim = cache.shape[2], q.shape[2]
    scale = head_dim**-0.5
    got = dense_kernels.decode_attention(q, cache[0], cache[1], tables, lens_t, scale, window)
    assert got is not None
    span = torch.arange(tables.shape[1] * block_size).unsqueeze(0)
    mask = span < lens_t.unsqueeze(1)
    if window is not None:
        mask &= span >= (lens_t - window).unsqueeze(1)
    expected = _decode_attention(q, cache[0], cache[1], tables, mask, scale)
    if not rounded:
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
        return
    # q and the weights rounded to bfloat16 (8 bits): as in prefill attention's test, each output moves by ~1e-3, an
    # element at most ~1e-2; a misplaced key, value or weight moves them by ~1
    error = (got - expected).abs()
    assert error.max() < 2e-2 and error.mean() < 2e-3, (error.max(), error.mean())


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,window",
    [
        (9, 3, 64, 16, None),  # SmolLM2's shape
        (4, 1, 256, 16, None),  # Gemma 3 270M's
        (4, 1, 256, 16, 20),  # ... with a local layer's window
        (8, 8, 40, 4, None),  # MHA, head_dim not a multiple of 16
        (6, 2, 32, 1, 7),  # one token a block
        (12, 4, 64, 32, None),
        (10, 2, 96, 16, None),  # 5 query heads a KV head (3 + 2 at once), head_dim 64 + 32
    ],
)
# few short contexts: the work split by KV head; many: by sequence
@pytest.mark.parametrize("many", [False, True], ids=["few-seqs", "many-seqs"])
@DECODE_KV_KINDS
def test_paged_decode_attention_equals_torch_path(
    heads, kv_heads, head_dim, block_size, window, many, kv_kind, monkeypatch
):
    kv_dtype, rounded = _attention_kv_dtype(kv_kind, monkeypatch)
    lens = [1, 5, block_size, block_size + 1, 3 * block_size - 1, 70, 133] * (3 if many else 1)
    q, cache, tables, lens_t = _paged_case(
        len(lens), heads, kv_heads, head_dim, block_size, lens, seed=heads + head_dim, kv_dtype=kv_dtype
    )
    if many:  # queries as the model hands them over: a slice of each row of a wider (q, k) tensor
        q = torch.cat([q, torch.randn(len(lens), kv_heads, head_dim)], dim=1)[:, :heads]
    _assert_decode_attention_is_torchs(q, cache, tables, lens_t, window, rounded and head_dim % 32 == 0)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,window",
    [
        (9, 3, 64, 16, None),  # SmolLM2's shape
        (4, 1, 256, 16, None),  # Gemma 3 270M's
        (4, 1, 256, 16, 500),  # ... a local layer's window, the parts split what it sees
        (10, 2, 56, 16, None),  # 5 query heads a KV head (3 + 2 at once), head_dim 32 + 24
        (16, 16, 48, 8, 700),  # MHA, head_dim 32 + 16
    ],
)
@pytest.mark.parametrize("lens", [[2000], [1100, 3]], ids=["one-seq", "long-and-short"])
@DECODE_KV_KINDS
def test_decode_attention_splits_few_long_contexts(
    heads, kv_heads, head_dim, block_size, window, lens, kv_kind, monkeypatch
):
    """Fewer sequences than the threads can share out: each context is split into parts (more parts than the short
    one has blocks, so some parts see nothing), each part's softmax merged into the output at the end."""
    kv_dtype, rounded = _attention_kv_dtype(kv_kind, monkeypatch)
    q, cache, tables, lens_t = _paged_case(
        len(lens), heads, kv_heads, head_dim, block_size, lens, seed=head_dim, kv_dtype=kv_dtype
    )
    _assert_decode_attention_is_torchs(q, cache, tables, lens_t, window, rounded and head_dim % 32 == 0)


@DECODE_KV_KINDS
def test_decode_attention_never_reads_behind_the_window_or_past_the_context(kv_kind, monkeypatch):
    """Blocks wholly behind the window (given back, their FREED entries read as block 0) and the table's padding
    must not matter: filling them with NaN leaves the result unchanged."""
    kv_dtype, _ = _attention_kv_dtype(kv_kind, monkeypatch)
    block_size, window, lens = 4, 8, [30, 9, 17]
    q, cache, tables, lens_t = _paged_case(3, 4, 2, 32, block_size, lens, seed=3, kv_dtype=kv_dtype)
    used = {b for s, n in enumerate(lens) for b in tables[s, : math.ceil(n / block_size)].tolist()}
    spare = next(b for b in range(cache.shape[1]) if b not in used)
    unseen = [spare]
    for s, n in enumerate(lens):
        held = math.ceil(n / block_size)
        tables[s, held:] = spare
        unseen += tables[s, : (n - window) // block_size].tolist()
    clean = dense_kernels.decode_attention(q, cache[0], cache[1], tables, lens_t, 0.2, window)
    cache[:, unseen] = float("nan")
    got = dense_kernels.decode_attention(q, cache[0], cache[1], tables, lens_t, 0.2, window)
    assert len(unseen) > 4 and not got.isnan().any()
    torch.testing.assert_close(got, clean)


def test_decode_attention_declines_what_it_does_not_cover():
    q, cache, tables, lens_t = _paged_case(2, 4, 2, 32, 4, [5, 9], seed=4)
    assert (
        dense_kernels.decode_attention(
            q.bfloat16(), cache[0].bfloat16(), cache[1].bfloat16(), tables, lens_t, 1.0, None
        )
        is None
    )
    assert dense_kernels.decode_attention(q, cache[0], cache[1], tables.int(), lens_t, 1.0, None) is None
    half = cache.half()  # a cache the kernel does not read, or two caches of different kinds
    assert dense_kernels.decode_attention(q, half[0], half[1], tables, lens_t, 1.0, None) is None
    assert dense_kernels.decode_attention(q, cache[0], cache[1].bfloat16(), tables, lens_t, 1.0, None) is None
    q12, cache12, tables12, lens12 = _paged_case(2, 4, 2, 12, 4, [5, 9], seed=5)  # head_dim not a multiple of 8
    assert dense_kernels.decode_attention(q12, cache12[0], cache12[1], tables12, lens12, 1.0, None) is None


def _prefill_case(n, first_pos, heads, kv_heads, head_dim, block_size, seed, kv_dtype=torch.float32):
    """A chunk of n queries at positions first_pos.. and a cache whose scattered blocks hold their context."""
    g = torch.Generator().manual_seed(seed)
    held = math.ceil((first_pos + n) / block_size)
    cache = torch.randn(2, held + 6, block_size, kv_heads, head_dim, generator=g).to(kv_dtype)
    table = torch.randperm(held + 6, generator=g)[:held]
    return torch.randn(n, heads, head_dim, generator=g), cache, table


def _prefill_reference(q, cache, table, first_pos, scale, window):
    n, heads, head_dim = q.shape
    kv_heads, ctx = cache.shape[3], first_pos + n
    k, v = (cache[i][table].reshape(-1, kv_heads, head_dim)[:ctx].double() for i in (0, 1))
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1) for t in (k, v))
    scores = (q.double().transpose(0, 1) @ k.transpose(1, 2)) * scale  # [heads, n, ctx]
    q_pos, k_pos = torch.arange(first_pos, ctx).unsqueeze(1), torch.arange(ctx).unsqueeze(0)
    visible = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
    return (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v).transpose(0, 1).float()


@pytest.mark.parametrize(
    "n,first_pos,heads,kv_heads,head_dim,block_size,window",
    [
        (290, 0, 9, 3, 64, 16, None),  # SmolLM2's shape, a whole prompt
        (37, 100, 9, 3, 64, 16, None),  # a chunk after a cached prefix
        (1, 50, 9, 3, 64, 16, None),  # one token
        (40, 5, 4, 1, 256, 16, None),  # Gemma 3 270M's heads
        (50, 30, 4, 1, 256, 16, 20),  # ... a local layer's window, reaching behind the chunk
        (130, 0, 8, 2, 64, 16, 64),  # a window inside one fresh prompt
        (13, 0, 8, 8, 32, 4, None),  # MHA
        (9, 11, 6, 2, 16, 1, 7),  # one token a block
        (200, 1000, 9, 3, 64, 16, None),  # a later chunk of a long prompt: many row groups, many key blocks
        (300, 700, 8, 2, 64, 16, 128),  # ... windowed: key blocks wholly behind some groups' windows
    ],
)
@ATTENTION_KV_KINDS
def test_paged_prefill_attention_equals_masked_softmax(
    n, first_pos, heads, kv_heads, head_dim, block_size, window, prefill_isa, kv_kind, monkeypatch
):
    kv_dtype, rounded = _attention_kv_dtype(kv_kind, monkeypatch)
    lib, kinds = dense_kernels.library(), []
    kernel = lib.paged_prefill_attention
    monkeypatch.setattr(lib, "paged_prefill_attention", lambda *a: kinds.append(a[4]) or kernel(*a))
    q, cache, table = _prefill_case(
        n, first_pos, heads, kv_heads, head_dim, block_size, seed=n + head_dim, kv_dtype=kv_dtype
    )
    if n > 1:  # queries as the model hands them over: a slice of each row of a wider (q, k) tensor
        q = torch.cat([q, torch.randn(n, kv_heads, head_dim)], dim=1)[:, :heads]
    scale = head_dim**-0.5
    got = dense_kernels.prefill_attention(q, cache[0], cache[1], table, first_pos, scale, window)
    assert got is not None and kinds == [2 if rounded else int(kv_dtype is torch.bfloat16)]
    expected = _prefill_reference(q, cache, table, first_pos, scale, window)
    if not rounded:
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
        return
    # q and the weights rounded to bfloat16 (8 bits): each output moves by ~1e-3, an element at most ~1e-2; a
    # misplaced key, value or weight moves them by ~1
    error = (got - expected).abs()
    assert error.max() < 2e-2 and error.mean() < 2e-3, (error.max(), error.mean())


@pytest.mark.parametrize("scale", [3.0, 0.0])
def test_prefill_attention_at_extreme_scores(scale, prefill_isa):
    """Scores ~25 standard deviations wide (most weights underflow to exactly 0, the kernel's 2^x at its clamp)
    and all-equal scores (every weight exactly 1), over several key blocks."""
    n, first_pos = 70, 600
    q, cache, table = _prefill_case(n, first_pos, 9, 3, 64, 16, seed=11)
    got = dense_kernels.prefill_attention(q, cache[0], cache[1], table, first_pos, scale, None)
    assert got is not None and got.isfinite().all()
    # float32 scores of magnitude ~100 are exact to ~1e-5, which their weights inherit: 1e-4 is that, not slack
    torch.testing.assert_close(got, _prefill_reference(q, cache, table, first_pos, scale, None), atol=1e-4, rtol=1e-4)


@ATTENTION_KV_KINDS
def test_prefill_attention_never_reads_behind_the_window_or_past_the_context(prefill_isa, kv_kind, monkeypatch):
    kv_dtype, _ = _attention_kv_dtype(kv_kind, monkeypatch)
    n, first_pos, block_size, window = 10, 27, 4, 8
    q, cache, table = _prefill_case(n, first_pos, 4, 2, 32, block_size, seed=7, kv_dtype=kv_dtype)
    clean = dense_kernels.prefill_attention(q, cache[0], cache[1], table, first_pos, 0.2, window)
    unused = [b for b in range(cache.shape[1]) if b not in table.tolist()]
    behind = table[: (first_pos - window + 1) // block_size].tolist()  # wholly behind the first query's window
    cache[:, unused + behind] = float("nan")
    end = first_pos + n  # slots of the last block past the context
    if end % block_size:
        cache[:, table[-1], end % block_size :] = float("nan")
    got = dense_kernels.prefill_attention(q, cache[0], cache[1], table, first_pos, 0.2, window)
    assert len(behind) >= 4 and not got.isnan().any()
    torch.testing.assert_close(got, clean)


def test_prefill_attention_declines_what_it_does_not_cover():
    q, cache, table = _prefill_case(5, 0, 4, 2, 40, 4, seed=8)  # head_dim not a multiple of 16
    assert dense_kernels.prefill_attention(q, cache[0], cache[1], table, 0, 1.0, None) is None
    q, cache, table = _prefill_case(5, 0, 4, 2, 32, 4, seed=9)
    assert (
        dense_kernels.prefill_attention(q.bfloat16(), cache[0].bfloat16(), cache[1].bfloat16(), table, 0, 1.0, None)
        is None
    )
    assert dense_kernels.prefill_attention(q, cache[0], cache[1], table.int(), 0, 1.0, None) is None
    half = cache.half()
    assert dense_kernels.prefill_attention(q, half[0], half[1], table, 0, 1.0, None) is None
    assert dense_kernels.prefill_attention(q, cache[0], cache[1].bfloat16(), table, 0, 1.0, None) is None


@pytest.mark.parametrize("rows", [1, 3, 700])  # 700 x 576 rows run on several threads
def test_rms_norm_equals_torch(rows):
    g = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 600, generator=g) * 3
    x = wide[:, :576]  # rows 600 floats apart
    w = torch.randn(576, generator=g)
    got = dense_kernels.rms_norm(x, w, 1e-5)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    layer = RMSNorm(576, 1e-5)
    layer.weight.data.copy_(w)
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows,head_dim", [(1, 64), (5, 256), (600, 32)])
def test_rotary_equals_torch(rows, head_dim):
    rope = RotaryEmbedding(head_dim, 4096, 10_000.0)
    g = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(rows, 15 * head_dim, generator=g)
    qk = qkv[:, : 12 * head_dim].view(rows, 12, head_dim)  # queries and keys of a fused qkv row, as the model has them
    cos, sin = rope.for_positions(torch.randint(0, 4096, (rows,), generator=g), torch.float32)
    got = dense_kernels.rotary(qk, cos, sin)
    half = head_dim // 2
    expected = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 4, 300])
def test_silu_and_mul_equals_torch(rows):
    x = torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)) * 8  # large |x|: exp's range
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -88.5])
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(dense_kernels.silu_and_mul(x), torch.nn.functional.silu(gate) * up, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(silu_and_mul(x), torch.nn.functional.silu(gate) * up, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows,vocab", [(1, 1), (2, 7), (3, 16), (3, 17), (5, 263), (1, 49152), (64, 49152)])
def test_greedy_rows_equal_torch_argmax_and_log_softmax(rows, vocab):
    """The first maximum bit for bit (ties across and inside the vector lanes, the scalar tail), its log-softmax
    within float32 rounding; 64 rows of 49,152 run on several threads, and rows may be any stride apart."""
    g = torch.Generator().manual_seed(rows * 7 + vocab)
    wide = torch.randint(-4, 4, (rows, vocab + 5), generator=g).float()  # many ties of the maximum
    wide += torch.randn(rows, vocab + 5, generator=g) * (torch.arange(rows) % 2).unsqueeze(1)  # odd rows: no ties
    x = wide[:, :vocab]
    tokens, logprobs = dense_kernels.greedy_rows(x)
    assert tokens.tolist() == x.argmax(dim=1).tolist()
    want = torch.log_softmax(x.double(), dim=1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(logprobs.double(), want, atol=1e-6, rtol=1e-6)


def test_greedy_rows_on_nan_and_infinities_as_torch():
    """NaN is the maximum (the first NaN, as torch's argmax), and where a NaN or an infinite maximum leaves no
    log-softmax the logprob is NaN, as torch's log_softmax gives."""
    vocab = 1000
    x = torch.zeros(7, vocab)
    x[0, [3, 600]] = float("nan")
    x[1, 997] = float("nan")  # in the scalar tail
    x[2] = float("-inf")  # all -inf: token 0
    x[3, [10, 999]] = float("inf")
    x[4] = float("-inf")
    x[4, 998] = 1.0  # one finite logit among -inf: logprob 0
    x[5, [255, 256, 900]] = 2.0  # ties: the first
    x[6, 996:] = 3.0  # ties in the tail only
    tokens, logprobs = dense_kernels.greedy_rows(x)
    assert tokens.tolist() == x.argmax(dim=1).tolist()
    want = torch.log_softmax(x, dim=1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(logprobs, want, equal_nan=True)
    assert dense_kernels.greedy_rows(x.double()) is None
    assert dense_kernels.greedy_rows(x.t()) is None  # columns apart: not rows
