"""Mixture-of-experts models from GGUF files: each tiny model (Mixtral, Qwen2-MoE, Qwen3-MoE, built with transformers)
written as llama.cpp's converter writes it (benchmarks/make_moe.py's write_gguf: ffn_{gate,up,down}_exps stacks,
ffn_gate_inp, the shared expert's ffn_*_shexp, Mixtral as a llama with permuted q/k) loads to transformers' logits;
experts in Q8_0 and Q4_K blocks stay quantized and give the logits of transformers on the dequantized weights within
the quantized tests' bound; bad expert metadata is refused naming the key."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from benchmark_scripts import load_script  # noqa: E402
from test_model_tiny import loaded_logits_match  # noqa: E402
from tiny_llama import Tiny  # noqa: E402
from tiny_moe import FAMILY_IDS, build_hf, moe_factory  # noqa: E402

from petrel.model.config import ModelConfig  # noqa: E402
from petrel.model.loader import _gguf_moe_layers, load_model, resolve_model  # noqa: E402
from petrel.model.quantization import QuantizedWeight  # noqa: E402

make_moe = load_script("make_moe")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return moe_factory(tmp_path_factory)


@pytest.mark.parametrize("name", FAMILY_IDS)
def test_gguf_of_each_family_matches_transformers(moe, tmp_path, name):
    t = moe(name)
    path = str(tmp_path / f"{name}.gguf")
    make_moe.write_gguf(t.hf, path)
    names = {tensor.name for tensor in gguf.GGUFReader(path).tensors}
    assert {"blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate_exps.weight", "blk.0.ffn_down_exps.weight"} <= names
    model, cfg = load_model(resolve_model(path), torch.float32, "cpu")
    for field in ("architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"):
        assert getattr(cfg, field) == getattr(t.cfg, field), field
    for field in ("shared_expert_intermediate_size", "dense_layers", "qkv_bias", "qk_norm", "head_dim"):
        assert getattr(cfg, field) == getattr(t.cfg, field), field
    loaded_logits_match(t, model, cfg, path, f"{name} from GGUF")


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_quantized_experts_stay_quantized_and_match_the_dequantized_model(tmp_path, fmt, monkeypatch):
    """quantization='gguf': the experts' Q8_0 / Q4_K blocks are held as they are (8-bit / 4-bit codes), and the
    logits are transformers' on the dequantized weights within 1e-3 (the int8 test's bound: products of a few rows
    round x to 16 bits a block; PETREL_INT8_COMPUTE=0 keeps the many-row products in floats)."""
    monkeypatch.setenv("PETREL_INT8_COMPUTE", "0")
    # a Qwen3-MoE of 256-wide matrices (Q4_K's blocks of 256)
    hf = build_hf("qwen3_moe", hidden_size=256, moe_intermediate_size=256, num_attention_heads=4, head_dim=64)
    path = str(tmp_path / f"moe-{fmt}.gguf")
    make_moe.write_gguf(hf, path, fmt)
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == fmt.upper() and types["blk.0.ffn_gate_inp.weight"] == "F32"
    # the oracle: transformers with every tensor the file holds quantized replaced by its dequantized values
    values = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    with torch.no_grad():
        for layer in range(hf.config.num_hidden_layers):
            experts = hf.model.layers[layer].mlp.experts
            gate, up = (values[f"blk.{layer}.ffn_{k}_exps.weight"] for k in ("gate", "up"))
            experts.gate_up_proj.copy_(torch.from_numpy(np.concatenate([gate, up], axis=1)))
            experts.down_proj.copy_(torch.from_numpy(values[f"blk.{layer}.ffn_down_exps.weight"]))
            attn = hf.model.layers[layer].self_attn
            for proj, key in (
                ("q_proj", "attn_q"),
                ("k_proj", "attn_k"),
                ("v_proj", "attn_v"),
                ("o_proj", "attn_output"),
            ):
                getattr(attn, proj).weight.copy_(torch.from_numpy(values[f"blk.{layer}.{key}.weight"]))
        hf.model.embed_tokens.weight.copy_(torch.from_numpy(values["token_embd.weight"]))
        hf.lm_head.weight.copy_(torch.from_numpy(values["output.weight"]))
    model, cfg = load_model(resolve_model(path), torch.float32, "cpu", quantization="gguf")
    experts = model.model.layers[0].mlp.experts
    gate_up, down = experts.expert_weights(0)
    bits = {"q8_0": 8, "q4_k": 4}[fmt]
    assert isinstance(gate_up, QuantizedWeight) and (gate_up.bits, down.bits) == (bits, bits)
    torch.testing.assert_close(gate_up.dequantize(), hf.model.layers[0].mlp.experts.gate_up_proj[0], atol=0, rtol=0)
    loaded_logits_match(Tiny(hf, None, None, path), model, cfg, path, f"{fmt} experts", atol=1e-3)


def test_q4_k_quantizer_writes_blocks_gguf_and_petrel_read_alike():
    data = np.random.default_rng(0).standard_normal((6, 512)).astype(np.float32)
    blocks = make_moe.quantize_q4_k(data)
    assert blocks.shape == (6, 2 * 144)
    theirs = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K).reshape(6, 512)
    mine = QuantizedWeight.from_gguf("Q4_K", blocks, 6, 512).dequantize().numpy()
    np.testing.assert_array_equal(mine, theirs)
    span = data.reshape(6, 16, 32).max(-1) - np.minimum(data.reshape(6, 16, 32).min(-1), 0)
    error = np.abs(theirs - data).reshape(6, 16, 32).max(-1)
    assert (error <= span / 15).all()  # within a code step of its sub-block (plus the 6-bit scales' rounding)


def _metadata(**moe) -> dict:
    meta = {
        "general.architecture": "qwen3moe",
        "qwen3moe.attention.head_count": 4,
        "qwen3moe.embedding_length": 64,
        "qwen3moe.block_count": 2,
        "qwen3moe.feed_forward_length": 96,
        "qwen3moe.vocab_size": 256,
        "qwen3moe.expert_count": 8,
        "qwen3moe.expert_used_count": 2,
        "qwen3moe.expert_feed_forward_length": 32,
    }
    meta.update({f"qwen3moe.{k}": v for k, v in moe.items()})
    return meta


@pytest.mark.parametrize(
    "overrides,key",
    [
        (dict(expert_used_count=9), "expert_used_count"),
        (dict(expert_count=0), "expert_count"),
        (dict(expert_gating_func=2), "expert_gating_func"),
        (dict(expert_shared_count=2), "expert_shared_count"),
    ],
)
def test_bad_expert_metadata_is_refused_naming_the_key(overrides, key):
    cfg = ModelConfig.from_gguf_metadata(_metadata(), has_output_tensor=True)
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (
        "Qwen3MoeForCausalLM",
        8,
        2,
        True,
    )
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_gguf_metadata(_metadata(**overrides), has_output_tensor=True)


def test_dense_layers_and_expert_score_bias_come_from_the_tensors():
    cfg = ModelConfig.from_gguf_metadata(_metadata(), has_output_tensor=True)
    _gguf_moe_layers(cfg, {"blk.1.ffn_gate_inp.weight", "blk.0.ffn_gate.weight"})
    assert cfg.dense_layers == [0]
    with pytest.raises(ValueError, match="exp_probs_b"):
        _gguf_moe_layers(cfg, {"blk.0.ffn_gate_inp.weight", "blk.0.exp_probs_b.bias"})
