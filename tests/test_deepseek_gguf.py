"""DeepSeek-V2 / V3 from GGUF files in llama.cpp's deepseek2 layout (benchmarks/make_moe.py's write_gguf, as the
converter writes them: attn_q_a / attn_q_a_norm / attn_q_b or attn_q, attn_kv_a_mqa, attn_kv_a_norm, attn_k_b and
attn_v_b (or attn_kv_b in the older layout), exp_probs_b, ffn_*_shexp, leading_dense_block_count,
expert_group_count, expert_weights_scale, expert_gating_func, YaRN's keys): the tiny models' logits equal
transformers'; Q8_0 blocks stay quantized and match transformers on the dequantized weights; bad metadata is refused
naming the key."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from benchmark_scripts import load_script  # noqa: E402
from test_model_tiny import loaded_logits_match  # noqa: E402
from tiny_deepseek import FAMILY_IDS, build_hf, deepseek_factory  # noqa: E402
from tiny_llama import Tiny  # noqa: E402

from petrel.model.config import ModelConfig  # noqa: E402
from petrel.model.loader import load_model, resolve_model  # noqa: E402
from petrel.model.quantization import QuantizedLinear, QuantizedWeight  # noqa: E402

make_moe = load_script("make_moe")
FIELDS = (
    "kv_lora_rank",
    "q_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "dense_layers",
    "norm_topk_prob",
    "scoring_func",
    "topk_method",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return deepseek_factory(tmp_path_factory)


@pytest.mark.parametrize("legacy", [False, True], ids=["k_b-v_b", "kv_b"])
@pytest.mark.parametrize("name", FAMILY_IDS)
def test_gguf_of_each_family_matches_transformers(deepseek, tmp_path, name, legacy):
    t = deepseek(name)
    path = str(tmp_path / f"{name}.gguf")
    make_moe.write_gguf(t.hf, path, mla_legacy=legacy)
    reader = gguf.GGUFReader(path)
    names = {tensor.name for tensor in reader.tensors}
    attention = {"blk.1.attn_kv_b.weight"} if legacy else {"blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight"}
    assert (
        attention | {"blk.1.attn_kv_a_mqa.weight", "blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_shexp.weight"} <= names
    )
    assert ("blk.1.exp_probs_b.bias" in names) == (name == "deepseek_v3")
    assert ("blk.1.attn_q_a.weight" in names) == (name != "deepseek_v2")
    model, cfg = load_model(resolve_model(path), torch.float32, "cpu")
    for field in FIELDS:
        assert getattr(cfg, field) == getattr(t.cfg, field), field
    if t.cfg.rope_scaling:
        for key in ("factor", "original_max_position_embeddings", "mscale_all_dim"):
            assert cfg.rope_scaling[key] == pytest.approx(t.cfg.rope_scaling[key]), key
    loaded_logits_match(t, model, cfg, path, f"{name} from GGUF")


def test_q8_0_blocks_stay_quantized_and_match_the_dequantized_model(tmp_path, monkeypatch):
    """quantization='gguf': the projections (their rotary rows reordered in place) and the experts keep their Q8_0
    blocks; logits within 1e-3 of transformers on the dequantized weights (the quantized tests' bound)."""
    monkeypatch.setenv("PETREL_INT8_COMPUTE", "0")
    hf = build_hf("deepseek_v3", seed=2)
    path = str(tmp_path / "v3-q8_0.gguf")
    make_moe.write_gguf(hf, path, "q8_0")
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.1.attn_q_b.weight"] == types["blk.1.ffn_gate_exps.weight"] == "Q8_0"
    assert types["blk.1.attn_k_b.weight"] == "F32"  # 16 wide: no 32-value blocks
    # the oracle: transformers with every tensor the file holds quantized replaced by its dequantized values
    values = {t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type)) for t in reader.tensors}
    hf_names = {v: k for k, v in make_moe.GGUF_NAMES.items()}
    with torch.no_grad():
        for layer in range(hf.config.num_hidden_layers):
            prefix = f"model.layers.{layer}."
            for gguf_name, data in values.items():
                parts = gguf_name.split(".")
                if parts[0] != "blk" or int(parts[1]) != layer or types[gguf_name] == "F32":
                    continue
                kind = parts[2]
                if kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
                    experts = hf.model.layers[layer].mlp.experts
                    inter = experts.down_proj.shape[2]
                    if kind == "ffn_down_exps":
                        experts.down_proj.copy_(torch.from_numpy(data))
                    else:
                        rows = slice(0, inter) if kind == "ffn_gate_exps" else slice(inter, 2 * inter)
                        experts.gate_up_proj[:, rows].copy_(torch.from_numpy(data))
                    continue
                if kind == "attn_v_b":  # [heads, v, rank]: kv_b_proj's value rows
                    kv_b = hf.get_parameter(prefix + "self_attn.kv_b_proj.weight").view(4, 32, 32)
                    kv_b[:, 16:].copy_(torch.from_numpy(data))
                    continue
                hf.get_parameter(prefix + hf_names[kind] + ".weight").copy_(torch.from_numpy(data))
        hf.model.embed_tokens.weight.copy_(torch.from_numpy(values["token_embd.weight"]))
        hf.lm_head.weight.copy_(torch.from_numpy(values["output.weight"]))
    model, cfg = load_model(resolve_model(path), torch.float32, "cpu", quantization="gguf")
    attn = model.model.layers[1].self_attn
    assert isinstance(attn.q_b_proj, QuantizedLinear) and isinstance(attn.kv_a_proj_with_mqa, QuantizedLinear)
    gate_up, _ = model.model.layers[1].mlp.experts.expert_weights(0)
    assert isinstance(gate_up, QuantizedWeight) and gate_up.bits == 8
    loaded_logits_match(Tiny(hf, None, None, path), model, cfg, path, "Q8_0 blocks", atol=1e-3)


def _metadata(hf, **changes) -> dict:
    """The deepseek2 metadata write_gguf gives a model, as petrel reads it, with changes (None: key removed)."""
    meta = {
        "general.architecture": "deepseek2",
        "deepseek2.block_count": 3,
        "deepseek2.context_length": 256,
        "deepseek2.embedding_length": 64,
        "deepseek2.feed_forward_length": 96,
        "deepseek2.attention.head_count": 4,
        "deepseek2.attention.head_count_kv": 1,
        "deepseek2.attention.kv_lora_rank": 32,
        "deepseek2.attention.q_lora_rank": 32,
        "deepseek2.attention.key_length": 40,
        "deepseek2.attention.value_length": 32,
        "deepseek2.attention.key_length_mla": 24,
        "deepseek2.attention.value_length_mla": 16,
        "deepseek2.rope.dimension_count": 8,
        "deepseek2.vocab_size": 256,
        "deepseek2.leading_dense_block_count": 1,
        "deepseek2.expert_count": 8,
        "deepseek2.expert_used_count": 2,
        "deepseek2.expert_shared_count": 1,
        "deepseek2.expert_feed_forward_length": 32,
        "deepseek2.expert_gating_func": 2,
        "deepseek2.expert_group_count": 4,
        "deepseek2.expert_group_used_count": 2,
    }
    for key, value in changes.items():
        key = f"deepseek2.{key}"
        meta.pop(key) if value is None else meta.__setitem__(key, value)
    return meta


@pytest.mark.parametrize(
    "changes,key",
    [
        (dict(expert_gating_func=3), "deepseek2.expert_gating_func"),
        (dict(expert_group_count=3), "deepseek2.expert_group_count"),
        (dict(expert_group_used_count=5), "deepseek2.expert_group_used_count"),
        (dict(expert_used_count=9), "deepseek2.expert_used_count"),
        ({"attention.kv_lora_rank": None}, "deepseek2.attention.kv_lora_rank"),
        ({"rope.dimension_count": 7}, "qk_rope_head_dim"),
        ({"rope.scaling.type": "longrope"}, "rope.scaling.type"),
    ],
)
def test_bad_gguf_metadata_is_refused_naming_the_key(changes, key):
    names = {"blk.1.exp_probs_b.bias", "blk.0.attn_q_a.weight"}
    ModelConfig.from_gguf_metadata(_metadata(None), True, names)  # as written: fine
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        ModelConfig.from_gguf_metadata(_metadata(None, **changes), True, names)


def test_make_moe_builds_a_deepseek_v3_shaped_model_served_alike_from_both_files(tmp_path, capsys):
    """benchmarks/make_moe.py --family deepseek-v3 at a tiny scale: the Hugging Face directory and the GGUF (the
    default model's tokenizer in both: transformers reads no deepseek2 GGUF config, petrel reads its vocabulary)
    give the same greedy text through petrel; config.json names the router as published; --kv-report prints the
    latent cache's bytes against expanded heads."""
    from petrel import LLM, SamplingParams

    tiny = "--layers 2 --hidden 64 --heads 4 --experts 16 --top-k 2 --moe-intermediate 32 --kv-lora-rank 32"
    args = ["--family", "deepseek-v3", *tiny.split(), "--q-lora-rank", "32", "--context", "8192"]
    assert make_moe.main([*args, "--out", str(tmp_path), "--no-bf16"]) == 0
    report = capsys.readouterr().out
    # 2 layers x (32 + 64) values against 2 x 4 heads x (128 + 64 + 128)
    assert "latent 768 (float32)" in report and "expanded heads 10,240" in report and "DeepSeek-V3: " in report
    # the router keys the published config.json spells out (vLLM reads topk_method for the score-correction bias)
    config = json.loads((tmp_path / "fp32" / "config.json").read_text())
    assert (config["topk_method"], config["scoring_func"]) == ("noaux_tc", "sigmoid")
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    texts = []
    for path in (tmp_path / "fp32", tmp_path / "deepseek-f32.gguf"):
        llm = LLM(str(path), kv_cache_memory=1 << 22)
        try:
            assert llm.engine.model_config.architecture == "DeepseekV3ForCausalLM"
            texts.append(llm.generate("The capital of France is", greedy, use_tqdm=False).outputs[0].text)
        finally:
            llm.shutdown()
    assert texts[0] == texts[1] and len(texts[0]) > 8
