"""petrel's fused Triton ops (petrel/model/triton_ops) in Triton's interpreter on the CPU.

Each op is checked against a float64 reference: RMS norm with and without the residual add, on odd hidden sizes
and strided rows; SiLU-and-multiply across several column blocks; rotary in place on a strided [T, heads, d] view
at positions past one block, with Llama 3 scaling in the cos/sin cache. float32, float16 and bfloat16 (elementwise
bfloat16 is handled by the interpreter). The dispatch in layers.py must leave a tiny Llama's logits unchanged.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are defined: they then run on CPU tensors
pytest.importorskip("triton")

from test_model_tiny import PagedDriver  # noqa: E402
from tiny_llama import LLAMA3_ROPE, _tokens  # noqa: E402

from petrel.model import layers, triton_attention, triton_ops  # noqa: E402
from petrel.model.layers import RotaryEmbedding  # noqa: E402

TOLERANCES = {  # atol, rtol against float64: 16-bit types round inputs, intermediates and outputs
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
DTYPES = list(TOLERANCES)


def randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def assert_near(got, expected, dtype):
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.double(), expected, atol=atol, rtol=rtol)


def rms_norm_reference(x, weight, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,hidden", [(1, 40), (7, 576), (3, 64)])
def test_rms_norm_equals_float64_reference(tokens, hidden, dtype):
    x = randn(tokens, hidden + 8, seed=hidden, dtype=dtype)[:, 8:] * 3  # strided rows
    weight = randn(hidden, seed=1, dtype=dtype)
    out, same = triton_ops.rms_norm(x, weight, 1e-6)
    assert out.dtype == dtype and same is x
    assert_near(out, rms_norm_reference(x, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,hidden", [(1, 40), (7, 576)])
def test_rms_norm_adds_the_residual_first(tokens, hidden, dtype):
    x, residual = randn(2, tokens, hidden, seed=tokens, dtype=dtype)
    weight = randn(hidden, seed=2, dtype=dtype)
    out, new_residual = triton_ops.rms_norm(x, weight, 1e-5, residual)
    expected_sum = x.double() + residual.double()
    assert_near(new_residual, expected_sum, dtype)
    assert_near(out, rms_norm_reference(expected_sum, weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,inter", [(1, 40), (7, 576), (2, 2100)])  # 2100: three column blocks
def test_silu_and_mul_equals_float64_reference(tokens, inter, dtype):
    gate_up = randn(tokens, 2 * inter, seed=inter, dtype=dtype) * 4
    gate, up = gate_up.double().chunk(2, dim=-1)
    got = triton_ops.silu_and_mul(gate_up)
    assert got.shape == (tokens, inter) and got.dtype == dtype
    assert_near(got, gate / (1 + torch.exp(-gate)) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim,scaling", [(64, None), (40, LLAMA3_ROPE), (128, None)])
def test_rotary_in_place_equals_float64_reference(head_dim, scaling, dtype):
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, scaling)
    positions = torch.tensor([0, 1, 5, 63, 64, 1000, 4095])  # past one block of positions, and the last one
    heads, kv_heads = 4, 2
    qkv = randn(len(positions), (heads + 2 * kv_heads) * head_dim, seed=head_dim, dtype=dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(-1, heads + kv_heads, head_dim)  # strided, as llama.py gives
    before, v_before = qk.double().clone(), qkv[:, (heads + kv_heads) * head_dim :].clone()
    cos, sin = rotary.for_positions(positions, dtype)
    got = triton_ops.rotary_(qk, cos, sin)
    assert got is qk
    inv_freq = layers.rope_inverse_frequencies(head_dim, 10000.0, scaling)
    angles = positions.double()[:, None, None] * inv_freq
    c, s = angles.cos(), angles.sin()
    first, second = before.chunk(2, dim=-1)
    expected = torch.cat([first * c - second * s, second * c + first * s], -1)
    assert_near(qk, expected, dtype)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # the values beside it are untouched


def test_rotary_applies_any_cos_sin_rows_as_rotate_half():
    """cos and sin rows whose halves differ (the cache's never do): the kernel must still read each half's own."""
    x, (cos, sin) = randn(5, 3, 24, seed=6), randn(2, 5, 1, 24, seed=7)
    expected = x.double() * cos.double() + torch.cat([-x[..., 12:], x[..., :12]], -1).double() * sin.double()
    got = triton_ops.rotary_(x.clone(), cos, sin)
    assert_near(got, expected, torch.float32)


def test_layers_use_the_kernels_only_where_triton_serves(monkeypatch):
    x = randn(3, 40, seed=5)
    calls = []
    monkeypatch.setattr(triton_ops, "rms_norm", lambda *a: calls.append(a) or (x, x), raising=False)
    norm = layers.RMSNorm(40, 1e-6)
    norm(x)
    assert not calls  # CPU steps stay on the C / PyTorch path
    monkeypatch.setattr(triton_attention, "DEVICE_TYPES", ("cpu",))
    norm(x)
    assert len(calls) == 1


def test_tiny_llama_logits_unchanged_by_the_fused_ops(tiny, monkeypatch):
    """A prefill, a chunk after it and decodes through the whole model with every op (and attention) on the
    Triton kernels, against the same steps on the CPU path and against transformers."""
    t = tiny(kv_heads=2)
    prompt = _tokens(9, seed=4)

    def run() -> torch.Tensor:
        drv = PagedDriver(t, block_size=4)
        seq = drv.new_seq(prompt + [7, 8])
        return drv.run_chunks(seq, [6, 3, 1, 1])

    expected = run()
    ran = []
    for name in ("rms_norm", "silu_and_mul", "rotary_"):
        kernel = getattr(triton_ops, name)
        monkeypatch.setattr(triton_ops, name, lambda *a, k=kernel, n=name: ran.append(n) or k(*a), raising=False)
    monkeypatch.setattr(triton_attention, "DEVICE_TYPES", ("cpu",))
    got = run()
    assert {"rms_norm", "silu_and_mul", "rotary_"} <= set(ran)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, t.hf_logits(prompt + [7, 8]), atol=1e-4, rtol=1e-4)
