"""Gemma 3 text (Gemma3ForCausalLM) on tiny random-weight models checked against transformers.

Each model: vocab 256, hidden 64, 4 layers (sliding, full, sliding, full with a window of 8 keys under sequences
of up to 30 tokens in blocks of 4), 4 heads, 2 KV heads, head_dim 32 (wider than hidden / heads), an attention
scale from query_pre_attn_scalar that is not head_dim, different rotary bases on local and global layers, weights
re-drawn so no norm is the identity. Then, as for the other families: (a) prefill logits, (b) step-by-step paged
decode equal transformers', (c) chunked prefill equals one shot, (d) the engine's greedy tokens equal
`hf.generate`.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from petrel.engine.model_runner import kv_bytes_per_block  # noqa: E402
from petrel.model.config import ModelConfig  # noqa: E402
from petrel.model.gemma3 import Gemma3ForCausalLM  # noqa: E402
from petrel.model.loader import load_model, resolve_model  # noqa: E402

from test_model_tiny import PagedDriver, _engine_generate, _hf_generate, assert_close  # noqa: E402
from tiny_llama import VOCAB, Tiny, _tokens, redraw_weights  # noqa: E402

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, sliding_window=8, layer_types=LAYER_TYPES,
              query_pre_attn_scalar=24,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                               "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}})

VARIANTS = {
    "gemma3": dict(),
    # global layers with linear rope scaling (Gemma 3 4B and up), a final logit soft-cap, an untied head
    "gemma3-scaled": dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                           "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                              "rope_theta": 1_000_000.0}},
                          final_logit_softcapping=5.0, tie_word_embeddings=False),
}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    cache: dict = {}

    def build(name: str = "gemma3", seed: int = 0) -> Tiny:
        if (name, seed) not in cache:
            config = transformers.Gemma3TextConfig(**{**COMMON, **VARIANTS[name]})
            config._attn_implementation = "eager"   # a reference independent of petrel's SDPA calls
            torch.manual_seed(seed)
            hf = transformers.Gemma3ForCausalLM(config)
            redraw_weights(hf, seed)
            hf = hf.float().eval()
            path = tmp_path_factory.mktemp(name)
            hf.save_pretrained(path, safe_serialization=True)
            model, cfg = load_model(resolve_model(str(path)), torch.float32, "cpu")
            cache[(name, seed)] = Tiny(hf, model, cfg, str(path))
        return cache[(name, seed)]

    return build


def test_config_and_weights(gemma):
    t = gemma()
    cfg = t.cfg
    assert isinstance(t.model, Gemma3ForCausalLM) and cfg.architecture == "Gemma3ForCausalLM"
    assert cfg.sliding_windows == [8, None, 8, None]
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling) == (1_000_000.0, 10_000.0, None)
    assert cfg.query_pre_attn_scalar == 24 and cfg.final_logit_softcapping is None
    assert cfg.tie_word_embeddings and cfg.qk_norm and cfg.head_dim == 32
    assert [layer.is_local for layer in t.model.model.layers] == [True, False, True, False]
    assert t.model.model.layers[0].self_attn.scale == 24 ** -0.5
    mine, theirs = t.model.model.layers[1], t.hf.model.layers[1]
    for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"):
        torch.testing.assert_close(getattr(mine, name).weight, getattr(theirs, name).weight, atol=0, rtol=0)
    torch.testing.assert_close(mine.self_attn.k_norm.weight, theirs.self_attn.k_norm.weight, atol=0, rtol=0)
    scaled = gemma("gemma3-scaled").cfg
    assert scaled.rope_scaling["rope_type"] == "linear" and scaled.rope_scaling["factor"] == 8.0
    assert scaled.final_logit_softcapping == 5.0 and not scaled.tie_word_embeddings


def _hf_config(**overrides) -> dict:
    cfg = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 256,
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 12, "num_attention_heads": 4,
           "num_key_value_heads": 1, "head_dim": 32, "sliding_window": 512, "rope_theta": 1_000_000.0,
           "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256, "attn_logit_softcapping": None,
           "final_logit_softcapping": None, "hidden_activation": "gelu_pytorch_tanh"}
    cfg.update(overrides)
    return cfg


def test_older_config_layout():
    """Configs written before transformers 5: rope_theta / rope_local_base_freq, and no layer_types."""
    cfg = ModelConfig.from_hf_config(_hf_config(rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert cfg.sliding_windows == ([512] * 5 + [None]) * 2        # every 6th layer global
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
    cfg = ModelConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
                                      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4})
    assert (cfg.rope_local_theta, cfg.query_pre_attn_scalar, cfg.final_logit_softcapping) == (None, None, None)
    assert not cfg.tie_word_embeddings and not cfg.qk_norm and cfg.sliding_windows == []


def test_local_rotary_and_window_matter(gemma):
    """Local layers really use their own rotary base and window: with either swapped petrel is far off."""
    t = gemma()
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


# ---------------------------------------------------------------- (a) prefill

@pytest.mark.parametrize("name", list(VARIANTS))
def test_prefill_matches_transformers(gemma, name):
    t = gemma(name)
    drv = PagedDriver(t, block_size=4)
    prompts = [_tokens(23, 1), _tokens(9, 2), _tokens(1, 3)]
    seqs = [drv.new_seq(p) for p in prompts]
    outs = drv.step([(s, s.num_tokens) for s in seqs])
    for p, out in zip(prompts, outs):
        assert_close(out, t.hf_logits(p), f"{name}: prefill of {len(p)} tokens")


# ---------------------------------------------------------------- (b) decode through the paged cache

@pytest.mark.parametrize("name", list(VARIANTS))
def test_step_by_step_decode_matches_transformers(gemma, name):
    t = gemma(name)
    drv = PagedDriver(t, block_size=4)
    tokens = _tokens(30, 10)
    other = _tokens(14, 11)
    a, b = drv.new_seq(tokens), drv.new_seq(other)
    got_a, got_b = drv.step([(a, 6), (b, 5)])
    got_a, got_b = [got_a], [got_b]
    for _ in range(24):
        work = [(a, 1)] + ([(b, 1)] if b.num_computed_tokens < b.num_tokens else [])
        outs = drv.step(work)
        got_a.append(outs[0])
        if len(outs) > 1:
            got_b.append(outs[1])
    assert_close(torch.cat(got_a), t.hf_logits(tokens), f"{name}: step-by-step decode")
    assert_close(torch.cat(got_b), t.hf_logits(other), f"{name}: decode next to another sequence")


# ---------------------------------------------------------------- (c) chunked prefill

def test_chunked_prefill_matches_one_shot(gemma):
    t = gemma()
    tokens = _tokens(30, 30)
    one = PagedDriver(t, block_size=4)
    one_shot = one.run_chunks(one.new_seq(tokens), [30])
    for chunks in ([8, 12, 10], [5, 1, 17, 7]):
        drv = PagedDriver(t, block_size=4, seed=3)
        assert_close(drv.run_chunks(drv.new_seq(tokens), chunks), one_shot, f"chunks {chunks} vs one shot")
    assert_close(one_shot, t.hf_logits(tokens), "one shot vs transformers")


# ---------------------------------------------------------------- (d) the whole engine, greedy

@pytest.mark.parametrize("name", list(VARIANTS))
def test_engine_greedy_matches_transformers_generate(gemma, name):
    t = gemma(name)
    shared = _tokens(9, 60)
    prompts = [_tokens(21, 61), shared + _tokens(5, 62), shared]
    blocks = 64 * kv_bytes_per_block(t.cfg, 4, torch.float32)
    results, core = _engine_generate(t, prompts, 16, block_size=4, max_num_batched_tokens=16, kv_cache_memory=blocks)
    assert core.scheduler.prefix_hit_tokens == 8
    for i, p in enumerate(prompts):
        expected = _hf_generate(t, p, 16)
        assert results[f"req{i}"] == expected, f"{name} prompt {i}: petrel {results[f'req{i}']} != {expected}"
