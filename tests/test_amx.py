"""Prompt-sized products through oneDNN on AMX CPUs (petrel/model/amx.py): which CPU flags and switches choose it
(flags faked), which weights get a oneDNN copy at load, the products against float64 of the rounded inputs, the
one-call decoder stack left from the threshold, the default model in bfloat16 with the path forced, and the
float32_matmul_precision option. PETREL_AMX=force runs oneDNN's path on any CPU whose oneDNN runs bfloat16 (AVX-512
ones too): on an AMX machine these tests run its tile kernels."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch
from torch import nn

from petrel import LLM, SamplingParams
from petrel.config import EngineConfig
from petrel.model import amx, dense_kernels, native
from petrel.model.quantization import QuantizedLinear, QuantizedWeight, unpack_panels

onednn_bf16 = pytest.mark.skipif(
    not amx.onednn_runs_bf16(), reason="this torch's oneDNN runs no bfloat16 products here"
)


@pytest.fixture(autouse=True)
def default_switches(monkeypatch):
    for name in ("PETREL_AMX", "PETREL_AMX_MIN_ROWS", "PETREL_BF16_ACTIVATIONS"):
        monkeypatch.delenv(name, raising=False)


def fake_cpu(monkeypatch, amx_flags: tuple[str, ...]) -> None:
    """This CPU's flags without any AMX flag, plus amx_flags."""
    flags = {f for f in native._cpu_flags() if not f.startswith("amx")}
    monkeypatch.setattr(native, "_cpu_flags", lambda: frozenset(flags | set(amx_flags)))


def test_bf16_products_go_to_onednn_where_the_cpu_has_amx_unless_switched_off(monkeypatch):
    monkeypatch.setattr(amx, "onednn_runs_bf16", lambda: True)
    fake_cpu(monkeypatch, ("amx_tile", "amx_bf16", "amx_int8"))
    assert native.cpu_has_amx("bf16") and native.cpu_has_amx("int8")
    assert amx.bf16_rows() == amx.AMX_MIN_ROWS == 32
    monkeypatch.setenv("PETREL_AMX_MIN_ROWS", "8")
    assert amx.bf16_rows() == 8
    monkeypatch.setenv("PETREL_AMX", "0")
    assert amx.bf16_rows() == 0
    monkeypatch.setenv("PETREL_AMX", "1")
    assert amx.bf16_rows() == 8
    for flags in ((), ("amx_tile",), ("amx_tile", "amx_int8"), ("amx_bf16",)):  # no AMX, or not its bfloat16
        fake_cpu(monkeypatch, flags)
        assert not native.cpu_has_amx("bf16") and amx.bf16_rows() == 0, flags
    monkeypatch.setenv("PETREL_AMX", "force")  # any CPU whose oneDNN runs bfloat16 products
    assert amx.bf16_rows() == 8
    monkeypatch.setattr(amx, "onednn_runs_bf16", lambda: False)
    assert amx.bf16_rows() == 0
    for name, value in (("PETREL_AMX", "yes"), ("PETREL_AMX_MIN_ROWS", "0"), ("PETREL_AMX_MIN_ROWS", "many")):
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=name):
            amx.bf16_rows()
        monkeypatch.delenv(name)


def projections(shape=(96, 80)) -> nn.Module:
    """A stand-in model: projections held in each form, and an LM head."""
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    model = nn.Module()
    model.bf16_panels = QuantizedLinear(QuantizedWeight.bfloat16(w, panels=True))
    model.bf16_rows = QuantizedLinear(QuantizedWeight.bfloat16(w))
    model.f32_panels = QuantizedLinear(QuantizedWeight.float32_panels(w))
    model.int8 = QuantizedLinear(QuantizedWeight.int8_per_channel(w))
    model.lm_head = QuantizedLinear(QuantizedWeight.bfloat16(w))
    return model


def tiled(model: nn.Module) -> set[str]:
    return {name for name, m in model.named_children() if m.qweight.tiles is not None}


@onednn_bf16
def test_weights_are_packed_at_load_for_the_products_amx_takes(monkeypatch, caplog):
    """bfloat16 weights (panels or rows) get a oneDNN copy, the weight rounded to bfloat16; float32 ones only at
    float32_matmul_precision 'medium'; int8 ones and the LM head never; nothing without AMX, under PETREL_AMX=0, or
    where bfloat16 products keep x in float32 (PETREL_BF16_ACTIVATIONS=0)."""
    fake_cpu(monkeypatch, ("amx_tile", "amx_bf16"))
    model = projections()
    assert amx.pack_model(model) == 2 and tiled(model) == {"bf16_panels", "bf16_rows"}
    w = unpack_panels(model.f32_panels.qweight.codes, (96, 80))
    assert torch.equal(model.bf16_panels.qweight.tiles.packed.to_dense(), w.bfloat16())
    assert amx.pack_model(model, "medium") == 1 and "f32_panels" in tiled(model)
    assert model.f32_panels.qweight.tiles.shape == (96, 80)
    for switch, value in (("PETREL_AMX", "0"), ("PETREL_BF16_ACTIVATIONS", "0")):
        monkeypatch.setenv(switch, value)
        assert amx.pack_model(projections()) == 0, switch
        monkeypatch.delenv(switch)
    fake_cpu(monkeypatch, ())
    with caplog.at_level(logging.WARNING, logger="petrel"):
        assert amx.pack_model(projections(), "medium") == 0
        assert amx.pack_model(projections()) == 0  # 'highest': nothing to say
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "float32_matmul_precision 'medium'" in warning and "no AMX" in warning


def bf16_bound(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 product of x and w rounded to bfloat16, the most a bfloat16-output product may differ from it: the
    output's rounding, 2^-8 of it, and float32 sums' over K terms)."""
    xb, wb = x.bfloat16().double(), w.bfloat16().double()
    exact = xb @ wb.t()
    return exact, 2.0**-8 * exact.abs() + (x.shape[1] + 2) * 2.0**-24 * (xb.abs() @ wb.abs().t())


@onednn_bf16
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m,k,n", [(32, 64, 48), (45, 100, 70), (130, 576, 211), (33, 36, 5)])
def test_forced_products_equal_float64_of_rounded_inputs(monkeypatch, m, k, n, threads):
    """From the threshold's rows on, QuantizedWeight.matmul runs oneDNN's product (a spy sees it; below, petrel's
    kernels as before): x and the weights rounded to bfloat16, within the output's bfloat16 rounding of the float64
    product; ragged shapes, K not a multiple of 32, 1 and 2 threads."""
    monkeypatch.setenv("PETREL_AMX", "force")
    gen = torch.Generator().manual_seed(m * k + n)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    weights = [QuantizedWeight.bfloat16(w, panels=True), QuantizedWeight.bfloat16(w), QuantizedWeight.float32_panels(w)]
    before = [q.matmul(x[:31]) for q in weights]
    for q in weights:
        q.tiles = amx.tiles_for(q, "medium")
    calls = []
    product = amx.Tiles.__call__
    monkeypatch.setattr(amx.Tiles, "__call__", lambda self, x: calls.append(x.shape[0]) or product(self, x))
    exact, bound = bf16_bound(x, w)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for q, old in zip(weights, before):
            y = q.matmul(x)
            assert y.dtype == torch.float32 and y.shape == (m, n)
            assert ((y.double() - exact).abs() <= bound).all(), ((y.double() - exact).abs() / bound).max()
            assert torch.equal(q.matmul(x[:31]), old)  # 31 rows: petrel's kernels, as before
    finally:
        torch.set_num_threads(saved)
    assert calls == [m] * 3


@onednn_bf16
def test_decoder_stack_takes_steps_below_the_threshold_only(monkeypatch):
    """A layer whose weights carry oneDNN copies runs in the one-call decoder stack only for steps of fewer rows
    than their threshold: larger ones go layer by layer, where their products reach oneDNN."""
    monkeypatch.setenv("PETREL_AMX", "force")
    hidden, inter = 64, 128
    gen = torch.Generator().manual_seed(0)
    shapes = [(3 * hidden, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    weights = [QuantizedWeight.bfloat16(torch.randn(*s, generator=gen), panels=True) for s in shapes]
    parts = dense_kernels.LayerParts((torch.ones(hidden),) * 2, 1e-5, tuple(weights), (4, 4, 16), 0.25, None)
    plain = parts.max_rows
    monkeypatch.setenv("PETREL_AMX_MIN_ROWS", "24")
    weights[2].tiles = amx.tiles_for(weights[2])
    assert parts.max_rows == 23 < plain and parts.fits(23) and not parts.fits(24)


@pytest.mark.e2e
@onednn_bf16
def test_default_model_bf16_forced_path_keeps_greedy_tokens_and_logprobs(monkeypatch):
    """The default model at dtype 'bfloat16', 16 prompts x 16 greedy tokens, oneDNN's path forced against petrel's
    (PETREL_AMX=0): the prompt steps' products run oneDNN's (rows from the threshold), the decode steps' (16 rows)
    stay in the one-call stack; the tokens are the same up to a near-tie of petrel's path (top two within 0.25: the
    bfloat16 output moves a logprob by 0.11 at most, measured on Zen 4: 14 of 16 sequences equal throughout, the
    other two parting at gaps of 0.06 and 0.001), and the chosen tokens' logprobs move within the bfloat16 test's
    bounds (test_quantization: mean < 0.02, largest < 0.2)."""
    from test_quantization import MORE_PROMPTS, PROMPTS

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, return_generation_logits=True)
    product, step = amx.Tiles.__call__, dense_kernels.DecoderStack.__call__
    products, stack_steps = [], []
    monkeypatch.setattr(amx.Tiles, "__call__", lambda self, x: products.append(x.shape[0]) or product(self, x))

    def stack_spy(self, x, *args):
        out = step(self, x, *args)
        stack_steps.append((x.shape[0], out is not None))
        return out

    monkeypatch.setattr(dense_kernels.DecoderStack, "__call__", stack_spy)
    outs = {}
    for mode in ("0", "force"):
        monkeypatch.setenv("PETREL_AMX", mode)
        llm = LLM(dtype="bfloat16", kv_cache_memory=32 << 20)
        try:
            tiles = llm.engine.core.runner.model.model.layers[0].mlp.down_proj.qweight.tiles
            assert (tiles is not None) == (mode == "force")
            products.clear(), stack_steps.clear()
            outs[mode] = llm.generate(PROMPTS + MORE_PROMPTS, params, use_tqdm=False)
        finally:
            llm.shutdown()
    assert products and min(products) >= amx.AMX_MIN_ROWS  # the prompt steps' products, none of the decodes'
    assert (16, True) in stack_steps and all(rows < amx.AMX_MIN_ROWS for rows, ran in stack_steps if ran)
    changes = []
    for petrel_out, forced_out in zip(outs["0"], outs["force"]):
        ours, theirs = petrel_out.outputs[0], forced_out.outputs[0]
        logprobs = ours.generation_logits.log_softmax(-1)
        same = next((i for i, (a, b) in enumerate(zip(ours.token_ids, theirs.token_ids)) if a != b), 16)
        if same < 16:
            top_two = logprobs[same].topk(2).values
            assert top_two[0] - top_two[1] < 0.25, (same, top_two)
        chosen = torch.tensor(ours.token_ids[:same]).unsqueeze(1)
        forced = theirs.generation_logits[:same].log_softmax(-1)
        changes.append((logprobs[:same].gather(1, chosen) - forced.gather(1, chosen)).abs().squeeze(1))
    change = torch.cat(changes)
    assert change.numel() >= 0.8 * 16 * 16 and change.mean() < 0.02 and change.max() < 0.2, change.max()


@onednn_bf16
def test_float32_matmul_precision_option(monkeypatch):
    """float32_matmul_precision: 'highest' by default; 'medium' gives a float32 model's projections oneDNN copies
    (PETREL_AMX=force here), through LLM(...) / EngineConfig and `petrel serve --float32-matmul-precision`; other
    values are refused naming the field."""
    from petrel.serve.server import add_arguments, engine_options

    assert EngineConfig().float32_matmul_precision == "highest"
    for bad in ("high", "MEDIUM", ""):
        with pytest.raises(ValueError, match="float32_matmul_precision"):
            EngineConfig(float32_matmul_precision=bad)
    with pytest.raises(TypeError, match="float32_matmul_precision"):
        EngineConfig(float32_matmul_precision=1)
    parse = add_arguments(argparse.ArgumentParser()).parse_args
    assert engine_options(parse([]))["float32_matmul_precision"] == "highest"
    assert engine_options(parse(["--float32-matmul-precision", "medium"]))["float32_matmul_precision"] == "medium"
    with pytest.raises(SystemExit):
        parse(["--float32-matmul-precision", "low"])
    monkeypatch.setenv("PETREL_AMX", "force")
    calls = []
    product = amx.Tiles.__call__
    monkeypatch.setattr(amx.Tiles, "__call__", lambda self, x: calls.append(x.shape[0]) or product(self, x))
    llm = LLM(float32_matmul_precision="medium", kv_cache_memory=8 << 20)
    try:
        model = llm.engine.core.runner.model
        qweight = model.model.layers[0].self_attn.qkv_proj.qweight
        assert qweight.bits == 32 and qweight.tiles is not None and model.lm_head.qweight.tiles is None
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        (out,) = llm.generate(["The capital of France is " * 8], params, use_tqdm=False)  # a prompt of 40+ rows
        assert len(out.outputs[0].token_ids) == 4 and calls and min(calls) >= amx.AMX_MIN_ROWS
    finally:
        llm.shutdown()
