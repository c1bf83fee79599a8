"""int8 weights times many rows in integers (int8_gemm.c): every kernel this CPU runs (AVX2, AVX-512, AVX-512 VNNI)
against a float64 product of the rounded rows and the codes (ragged shapes, extreme codes, outliers, the largest
sums int32 can hold), the rounding's worst case against the dequantized product, QuantizedLinear's switch, and a
tiny Llama under quantization='int8' against transformers on the dequantized weights."""

from __future__ import annotations

import contextlib

import pytest
import torch

from petrel import LLM, SamplingParams
from petrel.model import native, quant_kernels
from petrel.model.quantization import INT8_MIN_ROWS, QuantizedLinear, QuantizedWeight


@pytest.fixture
def lib():
    lib = quant_kernels.library()
    if lib is None:
        pytest.skip("the AVX2 kernels cannot run here (no AVX2/FMA or no C compiler)")
    return lib


def _has_avx512_int8(vnni: bool) -> pytest.MarkDecorator:
    flags = ("avx512bw", "avx512_vnni") if vnni else ("avx512bw",)
    return pytest.mark.skipif(not (native.cpu_has_avx512() and native.cpu_has(*flags)), reason="no such AVX-512 here")


# every int8_gemm kernel this CPU runs, each forced by switching the wider ones off (CI on AVX-512 machines tests them
# all, AVX2-only machines the AVX2 one)
INT8_ISAS = [
    pytest.param(quant_kernels.INT8_AVX2, id="avx2"),
    pytest.param(quant_kernels.INT8_AVX512, id="avx512", marks=_has_avx512_int8(vnni=False)),
    pytest.param(quant_kernels.INT8_AVX512_VNNI, id="vnni", marks=_has_avx512_int8(vnni=True)),
]


@contextlib.contextmanager
def forced_isa(isa: int, lib, monkeypatch, kernel: str):
    """`isa` forced for lib.<kernel> (int8_gemm or group_gemm: their ISA is the last argument) by switching the
    wider ones off, with a spy on the library that checks, at the end, that the kernel ran with that ISA only."""
    if isa == quant_kernels.INT8_AVX2:
        monkeypatch.setenv("PETREL_AVX512", "0")
    elif isa == quant_kernels.INT8_AVX512:
        monkeypatch.setenv("PETREL_AVX512_VNNI", "0")
    ran, function = [], getattr(lib, kernel)
    monkeypatch.setattr(lib, kernel, lambda *a: ran.append(a[-1] & ~quant_kernels.INT8_ACTIVATIONS) or function(*a))
    yield
    assert ran and set(ran) == {isa}, ran


@pytest.fixture(params=INT8_ISAS)
def int8_isa(request, lib, monkeypatch):
    """The kernel int8_gemm runs in this test, on x rounded to 16-bit integers a row (PETREL_INT8_ACTIVATIONS=16;
    the 8-bit ones of AVX-512 VNNI: the tests of group_gemm_q8 below); a spy on the library shows that it ran."""
    monkeypatch.setenv("PETREL_INT8_ACTIVATIONS", "16")
    with forced_isa(request.param, lib, monkeypatch, "int8_gemm"):
        yield request.param


needs_vnni = pytest.mark.skipif(
    quant_kernels.int8_isa() != quant_kernels.INT8_AVX512_VNNI, reason="8-bit activations for 8-bit codes: AVX-512 VNNI"
)


@needs_vnni
@pytest.mark.parametrize("m, k, n", [(1, 32, 1), (7, 64, 17), (45, 576, 50), (13, 1536, 33), (300, 576, 97)])
def test_int8_gemm_with_8_bit_activations_equals_the_integer_product(lib, m, k, n):
    """On AVX-512 VNNI (the default there) x is rounded to 8 bits a group of 32 and the codes offset to unsigned
    bytes (group_gemm_q8.c): against the float64 product of that rounded x and the weight, float rounding only;
    codes -127..127 and the extremes -128 and 127, a zero row and an outlier."""
    from test_group_gemm import assert_float_rounding_only as group_rounding_only
    from test_group_gemm import eight_bit_activations

    g = torch.Generator().manual_seed(m * k + n)
    x = torch.randn(m, k, generator=g)
    x[0, 0] = 1e4
    if m > 1:
        x[1] = 0
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    codes[0] = -128
    codes[-1] = 127
    weight = QuantizedWeight(codes, torch.rand(n, 1, generator=g) * 0.01 + 1e-4, None, 8, 62, (n, k), "int8")
    assert eight_bit_activations(weight)
    calls = []
    kernel = lib.int8_gemm
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lib, "int8_gemm", lambda *a: calls.append(a[-1]) or kernel(*a))
        got = quant_kernels.int8_gemm(lib, x, weight.codes, weight.scale)
    assert calls == [quant_kernels.INT8_AVX512_VNNI | quant_kernels.INT8_ACTIVATIONS]
    group_rounding_only(got, x, weight)


def test_int8_isa_is_the_widest_the_cpu_has(monkeypatch):
    widest = quant_kernels.int8_isa()
    if native.cpu_has_avx512() and native.cpu_has("avx512bw", "avx512_vnni"):
        assert widest == quant_kernels.INT8_AVX512_VNNI
    elif native.cpu_has_avx512() and native.cpu_has("avx512bw"):
        assert widest == quant_kernels.INT8_AVX512
    else:
        assert widest == quant_kernels.INT8_AVX2
    monkeypatch.setenv("PETREL_AVX512_VNNI", "0")
    assert quant_kernels.int8_isa() == min(widest, quant_kernels.INT8_AVX512)
    monkeypatch.setenv("PETREL_AVX512", "0")
    assert quant_kernels.int8_isa() == quant_kernels.INT8_AVX2


def rounded_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x's rows as int8_gemm.c rounds them, float64: codes round(x * (Q / max|x|)) in float32 (half to even) and
    scales max|x| / Q, Q the most that keeps every int32 lane of the sums from overflowing."""
    pairs = (x.shape[1] + 1) // 2
    levels = min(32767, (2**31 - 1) // (256 * pairs))
    top = x.abs().amax(dim=1, keepdim=True)
    most = torch.full_like(top, levels)  # tensor / tensor: IEEE division (levels / top would multiply by 1 / top)
    inverse = torch.where(top > 0, most / top, torch.zeros_like(top))
    return torch.round(x * inverse).double(), (top / most).double()


def integer_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    q, dx = rounded_rows(x)
    return (q @ codes.double().t()) * dx * scale.double().reshape(1, -1)


def assert_float_rounding_only(got: torch.Tensor, expected: torch.Tensor) -> None:
    """The integer sums are exact: what is left is three float32 roundings (the sum, the two scales' product, their
    product), 2^-24 each, of every element itself."""
    assert (got.double() - expected).abs().le(2e-7 * expected.abs()).all()


@pytest.mark.parametrize("m, k, n", [(1, 32, 1), (7, 31, 17), (45, 576, 50), (13, 1538, 33), (17, 64, 97)])
def test_int8_gemm_equals_the_integer_product(lib, int8_isa, m, k, n):
    g = torch.Generator().manual_seed(m * k + n)
    x = torch.randn(m, k, generator=g)
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, 1, generator=g) * 0.01 + 1e-4
    assert_float_rounding_only(quant_kernels.int8_gemm(lib, x, codes, scale), integer_reference(x, codes, scale))


def test_int8_gemm_extremes(lib, int8_isa):
    """Codes -128 and 127 only, an activation outlier 10^4 times the rest, a zero row, and rows of one value times
    codes of one sign at K = 4097: sums of 2,146,959,104, just below 2^31."""
    m, k, n = 7, 4097, 20
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g)
    x[0, 5] = 1e4
    x[1] = 0
    x[2], x[3] = 3.5, -3.5
    codes = torch.where(torch.rand(n, k, generator=g) < 0.5, 127, -128).to(torch.int8)
    codes[0], codes[1] = -128, 127
    scale = torch.rand(n, 1, generator=g) + 0.5
    got = quant_kernels.int8_gemm(lib, x, codes, scale)
    expected = integer_reference(x, codes, scale)
    assert_float_rounding_only(got, expected)
    assert (got[1] == 0).all() and got[2, 0] == -got[3, 0] and expected[2, 0] < 0
    assert rounded_rows(x)[0][2, 0] * -128 * k == -2_146_959_104


def test_rounding_rows_costs_at_most_half_a_step_per_activation(lib, int8_isa):
    """Against the dequantized weight's float product: |y - x W^T| <= (max|x| / 2Q) sum_k |W[n, k]| (and float
    rounding), outliers or not."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 1536, generator=g)
    x[::3, 7] *= 300
    weight = QuantizedWeight.int8_per_channel(torch.randn(96, 1536, generator=g))
    w = weight.dequantize().double()
    got = quant_kernels.int8_gemm(lib, x, weight.codes, weight.scale).double()
    _, dx = rounded_rows(x)
    bound = dx / 2 * w.abs().sum(dim=1) + 1e-6 * (x.double().abs() @ w.abs().t())
    assert ((got - x.double() @ w.t()).abs() <= bound).all()


def test_quantized_linear_switches_to_integers_from_int8_min_rows(lib, monkeypatch):
    """int8 per-row weights with INT8_MIN_ROWS rows or more: integer products; PETREL_INT8_COMPUTE=0: the float
    product of the dequantized weight (tiles, exact up to float summation order)."""
    g = torch.Generator().manual_seed(2)
    monkeypatch.setenv("PETREL_INT8_ACTIVATIONS", "16")
    weight = QuantizedWeight.int8_per_channel(torch.randn(64, 256, generator=g))
    layer = QuantizedLinear(weight)
    x = torch.randn(INT8_MIN_ROWS, 256, generator=g)
    assert_float_rounding_only(layer(x), integer_reference(x, weight.codes, weight.scale))
    monkeypatch.setenv("PETREL_INT8_COMPUTE", "0")
    exact = x.double() @ weight.dequantize().double().t()
    assert (layer(x).double() - exact).abs().max() <= 1e-6 * exact.abs().max()


def test_int8_model_logits_match_transformers_on_dequantized_weights(tiny, tmp_path, lib, monkeypatch):
    """quantization='int8' with prefill and decode steps of INT8_MIN_ROWS rows (decode_layers) in integers, 16-bit
    activations: every prompt and generated position's log-probabilities are those of transformers on the
    int8-dequantized weights within 1e-3 (measured: 3e-4, against 2e-6 with PETREL_INT8_COMPUTE=0: each activation
    moves by up to 2^-16 of its row's largest), and every greedy token is transformers' argmax. This random model
    magnifies a change of its hidden state many times (8-bit activations flip its near-tied tokens): the 8-bit
    activations of AVX-512 VNNI are measured on the default model (test_quantization.py)."""
    monkeypatch.setenv("PETREL_INT8_ACTIVATIONS", "16")
    from test_lora import prompt
    from test_quantization import _int8_reference

    from petrel.model.loader import resolve_model
    from petrel.model.tokenizer import load_tokenizer

    calls = []
    integer_gemm = quant_kernels.int8_gemm
    monkeypatch.setattr(quant_kernels, "int8_gemm", lambda *a: calls.append(a) or integer_gemm(*a))
    t = tiny(2, False)
    ref = _int8_reference(t.hf)
    load_tokenizer(resolve_model(None)).save_pretrained(tmp_path / "tok")
    llm = LLM(t.path, tokenizer=str(tmp_path / "tok"), kv_cache_memory=1 << 20, quantization="int8")
    try:
        params = SamplingParams(
            temperature=0, max_tokens=4, ignore_eos=True, return_context_logits=True, return_generation_logits=True
        )
        prompts = [prompt(s, 20 + s) for s in range(INT8_MIN_ROWS)]
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert calls  # the prompts went through int8_gemm
    worst = 0.0
    for ids, out in zip(prompts, outs):
        tokens = list(out.outputs[0].token_ids)
        with torch.no_grad():
            expected = ref(torch.tensor([ids + tokens])).logits[0].float()[: len(ids) + len(tokens) - 1]
        assert expected[len(ids) - 1 :].argmax(-1).tolist() == tokens
        got = torch.cat([out.context_logits, out.outputs[0].generation_logits[1:]])
        worst = max(worst, (got.log_softmax(-1) - expected.log_softmax(-1)).abs().max().item())
    print(f"int8 in integers vs transformers on the dequantized weights: max |delta logprob| {worst:.2e}")
    assert worst < 1e-3
