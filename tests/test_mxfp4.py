"""MXFP4 (OCP microscaling: E2M1 4-bit values with an E8M0 scale per 32), gpt-oss's experts, kept as it is.

The codes and scales read as gguf's reference dequantizer reads them; quant_kernels.c's products (few rows: integer
sums over the codes' doubled values; more rows: dequantized tiles; many: torch over dequantized tiles) equal a
float64 product of the dequantized weight, with AVX-512 allowed and with PETREL_AVX512=0; the experts' kernel
(moe.c) on MXFP4 experts equals the torch loop. A tiny gpt-oss saved as the published checkpoints are (experts'
*_blocks and *_scales) and as llama.cpp's GGUF (type MXFP4) loads with every expert still MXFP4 (4.25 bits a
weight), its logits drift from transformers' on the dequantized weights by less than the bound below, and its greedy
tokens through the engine are transformers'."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from benchmark_scripts import load_script  # noqa: E402
from test_gpt_oss import BS, build_hf  # noqa: E402
from test_model_tiny import PagedDriver, _engine_generate, hf_greedy  # noqa: E402
from tiny_llama import Tiny, _tokens  # noqa: E402

from petrel.model import dense_kernels, moe_kernels  # noqa: E402
from petrel.model.loader import load_model, resolve_model  # noqa: E402
from petrel.model.quantization import QuantizedWeight  # noqa: E402

pytestmark = pytest.mark.skipif(dense_kernels.library() is None, reason="no kernels here")

# the logits' drift from transformers on the dequantized weights, relative to the largest logit: the few-row products
# round x to 16 bits a group of 32 (a relative 2^-16 of the group's largest value), over four layers; measured
# 2.6e-5 (5.2e-4 on logits up to 19.9), the same from either file
DRIFT = 1e-4


make_moe = load_script("make_moe")


def random_mxfp4(rows: int, cols: int, seed: int, extreme: bool = False) -> tuple[QuantizedWeight, np.ndarray]:
    """A random MXFP4 weight (every code, exponents around 2^0 and the subnormal scales of 0 and 1) and its GGUF
    blocks; extreme: the largest scale (250: values up to 12 * 2^122) in row 2."""
    g = np.random.default_rng(seed)
    exponents = g.integers(118, 130, size=(rows, cols // 32)).astype(np.uint8)
    exponents[:2, 0] = (0, 1)
    if extreme:
        exponents[2, 0] = 250
    codes = g.integers(0, 256, size=(rows, cols // 32, 16)).astype(np.uint8)
    blocks = np.concatenate([exponents[..., None], codes], axis=-1).reshape(rows, -1)
    return QuantizedWeight.mxfp4(torch.from_numpy(codes), torch.from_numpy(exponents)), blocks


def test_codes_read_as_the_reference_dequantizer_reads_them():
    weight, blocks = random_mxfp4(40, 96, seed=1, extreme=True)
    expected = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.MXFP4).reshape(40, 96)
    torch.testing.assert_close(weight.dequantize(), torch.from_numpy(np.asarray(expected)), atol=0, rtol=0)
    from_gguf = QuantizedWeight.from_gguf("MXFP4", blocks, 40, 96)
    assert from_gguf.fp4 and from_gguf.scale.dtype == torch.uint8
    torch.testing.assert_close(from_gguf.dequantize(), weight.dequantize(), atol=0, rtol=0)
    as_int8 = weight.as_int8(5)  # twice the values times half the scales: exact
    torch.testing.assert_close(as_int8.dequantize(), weight.dequantize(), atol=0, rtol=0)
    assert weight.nbytes == 40 * 96 // 2 + 40 * 96 // 32 and weight.integer_rows == 0


@pytest.mark.parametrize("isa", ["default", "avx2"])
@pytest.mark.parametrize("rows", [1, 3, 4, 12, 40, 300])
def test_products_equal_float64_reference(rows, isa, monkeypatch):
    """quant_gemv (<= 12 rows, four at a time: AVX-512's four groups a step where the CPU has AVX-512 BW, AVX2's
    two with PETREL_AVX512=0; 160 columns leave a last group past a multiple of four), quant_gemm (<= 256) and
    dequantized tiles (more)."""
    if isa == "avx2":
        monkeypatch.setenv("PETREL_AVX512", "0")
    weight, _ = random_mxfp4(70, 160, seed=rows)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    got = weight.matmul(x)
    w = weight.dequantize().double()
    expected = x.double() @ w.t()
    # the few-row kernel rounds x to 16 bits a group of 32 (a step of the group's largest |x| / 32767); float32 sums
    step = x.abs().view(rows, -1, 32).amax(-1).repeat_interleave(32, dim=1).double() / 32767
    bound = step @ w.abs().t() + 1e-6 * (x.double().abs() @ w.abs().t())
    assert ((got.double() - expected).abs() <= bound).all(), ((got.double() - expected).abs() / bound).max()


def test_experts_kernel_on_mxfp4_equals_the_torch_loop():
    """moe.c's experts (gate/up and down of each used expert in MXFP4, their biases and the clamped SwiGLU) against
    the module's torch loop over the same QuantizedWeights."""
    from petrel.model.moe import Experts

    experts = Experts(4, 64, 32, bias=True, activation="swiglu_clamped")
    with torch.no_grad():
        experts.gate_up_bias.normal_()
        experts.down_bias.normal_()
    held = [torch.nn.ModuleList([random_mxfp4(64, 64, 10 + e)[0], random_mxfp4(64, 32, 20 + e)[0]]) for e in range(4)]
    experts._set_held(held)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(3)) * 0.05
    ids = torch.tensor([[0, 2], [1, 3], [2, 0], [3, 3], [0, 1], [1, 2], [2, 3], [3, 0], [0, 0]])
    weights = torch.rand(9, 2, generator=torch.Generator().manual_seed(4))
    fast = moe_kernels.experts(experts, x, ids, weights)
    assert fast is not None
    counts = torch.bincount(ids.reshape(-1), minlength=4)
    slow = experts._forward_torch(x, ids.reshape(-1), weights.reshape(-1), counts, 2)
    torch.testing.assert_close(fast, slow, atol=1e-4 * slow.abs().max().item(), rtol=1e-4)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny gpt-oss rounded to MXFP4 (transformers then holds exactly the blocks' values: the float reference),
    saved as the published checkpoints are and as llama.cpp's GGUF (experts MXFP4, the rest float32)."""
    hf = build_hf(seed=2)
    root = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    make_moe.save_gpt_oss_mxfp4(hf, str(root / "hf"))
    make_moe.write_gguf(hf, str(root / "gpt-oss.gguf"), "mxfp4")
    return hf, str(root / "hf"), str(root / "gpt-oss.gguf")


@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_checkpoints_keep_the_experts_in_mxfp4_within_the_drift_bound(checkpoints, kind):
    hf, hf_path, gguf_path = checkpoints
    path = hf_path if kind == "hf" else gguf_path
    model, cfg = load_model(resolve_model(path), torch.float32, "cpu")
    assert cfg.architecture == "GptOssForCausalLM" and cfg.sliding_windows == [12, None, 12, None]
    for layer, ref in zip(model.model.layers, hf.model.layers):
        for e in range(cfg.num_experts):
            gate_up, down = layer.mlp.experts.expert_weights(e)
            assert gate_up.fp4 and down.fp4 and gate_up.scale.dtype == torch.uint8
            assert gate_up.nbytes == 64 * 64 * 17 // 32  # 4.25 bits a weight
            interleaved = ref.mlp.experts.gate_up_proj[e].t()
            torch.testing.assert_close(gate_up.dequantize(), torch.cat([interleaved[0::2], interleaved[1::2]]))
            torch.testing.assert_close(down.dequantize(), ref.mlp.experts.down_proj[e].t(), atol=0, rtol=0)
        torch.testing.assert_close(layer.self_attn.sink_logits, ref.self_attn.sinks, atol=0, rtol=0)
    t = Tiny(hf, model, cfg, path)
    tokens = _tokens(30, 4)
    drv = PagedDriver(t, block_size=BS)
    seq = drv.new_seq(tokens)
    got = torch.cat([drv.step([(seq, 20)])[0], *(drv.step([(seq, 1)])[0] for _ in range(10))])
    expected = t.hf_logits(tokens)
    drift = (got - expected).abs().max().item() / expected.abs().max().item()
    assert drift < DRIFT, drift
    prompts = [_tokens(25, 5), _tokens(14, 6)]
    results, _ = _engine_generate(t, prompts, 10, block_size=BS, max_num_batched_tokens=16)
    assert [results[f"req{i}"] for i in range(2)] == [hf_greedy(t, p, 10) for p in prompts]
