"""Model families beyond Llama, each on a tiny random-weight model checked against transformers.

For every family a tiny model (vocab 256, hidden 64, 2 layers unless a variant says otherwise, 4 heads, 2 KV
heads) is built with transformers, its weights re-drawn (norms not all ones, biases not all zeros), saved as
safetensors and loaded through petrel's loader. Then: (a) prefill logits equal transformers', (b) step-by-step
paged decode equals transformers, (c) chunked prefill equals one shot, (d) the whole engine's greedy tokens equal
`hf.generate`.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_model_tiny import PagedDriver, _engine_generate, _hf_generate, assert_close  # noqa: E402
from tiny_llama import VOCAB, Tiny, _tokens, projection_weight, redraw_weights  # noqa: E402

from petrel.engine.model_runner import kv_bytes_per_block  # noqa: E402
from petrel.model.loader import _GGUF_NAMES, hf_weights, load_model, resolve_model  # noqa: E402

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)

# family id -> (transformers config class name, model class name, config overrides)
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen2-tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    # head_dim 32 != hidden / heads (16): q/o projections wider than hidden, as in Qwen3 checkpoints
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True)),
    "qwen3-bias": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, attention_bias=True)),
    # a window of 8 keys under sequences of up to 30 tokens in blocks of 4
    "mistral-sw": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    # layer 0 full, layer 1 windowed (max_window_layers), a window of 6 that is not a multiple of the block size
    "qwen2-sw": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
    ),
    # checkpoint with fused qkv_proj and gate_up_proj; Phi-3-mini-4k's config has a sliding window too
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0)),
    "phi3-sw": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0, sliding_window=8, tie_word_embeddings=True)),
}
# Gemma 3 (tests/test_gemma3.py has its own checks): 4 layers, sliding / full alternating with a window of 8,
# head_dim 32 (wider than hidden / heads), an attention scale from query_pre_attn_scalar that is not head_dim,
# different rotary bases on local and global layers
GEMMA3 = dict(
    num_hidden_layers=4,
    head_dim=32,
    pad_token_id=0,
    sliding_window=8,
    query_pre_attn_scalar=24,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
    },
)
FAMILIES.update(
    {
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", GEMMA3),
        # global layers with linear rope scaling (Gemma 3 4B and up), a final logit soft-cap, an untied head
        "gemma3-scaled": (
            "Gemma3TextConfig",
            "Gemma3ForCausalLM",
            {
                **GEMMA3,
                "final_logit_softcapping": 5.0,
                "tie_word_embeddings": False,
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                },
            },
        ),
        # what llama.cpp assumes of a gemma3 GGUF: every 6th layer global, the attention scale from head_dim
        "gemma3-gguf": (
            "Gemma3TextConfig",
            "Gemma3ForCausalLM",
            {**GEMMA3, "num_hidden_layers": 6, "layer_types": None, "query_pre_attn_scalar": 32},
        ),
    }
)
VARIANT_IDS = [name for name in FAMILIES if name != "gemma3-gguf"]  # prefill and decode run on every variant
FAMILY_IDS = ["qwen2", "qwen3", "mistral-sw", "phi3", "gemma3", "gemma3-scaled"]  # for the slower tests


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    cache: dict = {}

    def build(name: str, seed: int = 0) -> Tiny:
        if (name, seed) not in cache:
            config_cls, model_cls, overrides = FAMILIES[name]
            config = getattr(transformers, config_cls)(**{**COMMON, **overrides})
            config._attn_implementation = "eager"  # a reference independent of petrel's SDPA calls
            torch.manual_seed(seed)
            hf = getattr(transformers, model_cls)(config)
            redraw_weights(hf, seed)
            hf = hf.float().eval()
            path = tmp_path_factory.mktemp(name)
            hf.save_pretrained(path, safe_serialization=True)
            model, cfg = load_model(resolve_model(str(path)), torch.float32, "cpu")
            cache[(name, seed)] = Tiny(hf, model, cfg, str(path))
        return cache[(name, seed)]

    return build


def test_qwen2_loads_qkv_bias(family):
    for name, tied in (("qwen2", False), ("qwen2-tied", True)):
        t = family(name)
        assert t.cfg.architecture == "Qwen2ForCausalLM" and t.cfg.qkv_bias and not t.cfg.attention_bias
        assert t.cfg.tie_word_embeddings == tied
        attn = t.model.model.layers[1].self_attn
        assert attn.o_proj.bias is None
        hf_attn = t.hf.model.layers[1].self_attn
        expected = torch.cat([hf_attn.q_proj.bias, hf_attn.k_proj.bias, hf_attn.v_proj.bias])
        torch.testing.assert_close(attn.qkv_proj.bias, expected, atol=0, rtol=0)
        assert expected.abs().min() > 0  # re-drawn, so a lost bias would show in the logits


def test_qwen3_loads_qk_norm(family):
    t = family("qwen3")
    assert t.cfg.architecture == "Qwen3ForCausalLM" and t.cfg.qk_norm and t.cfg.head_dim == 32
    assert not (t.cfg.qkv_bias or t.cfg.attention_bias) and t.model.model.layers[0].self_attn.qkv_proj.bias is None
    for i in range(2):
        attn, hf_attn = t.model.model.layers[i].self_attn, t.hf.model.layers[i].self_attn
        for mine, theirs in ((attn.q_norm, hf_attn.q_norm), (attn.k_norm, hf_attn.k_norm)):
            assert mine.weight.shape == (32,)
            torch.testing.assert_close(mine.weight, theirs.weight, atol=0, rtol=0)
            assert not torch.allclose(mine.weight, torch.ones(32), atol=0.05)  # re-drawn: a skipped norm shows
    biased = family("qwen3-bias")  # Qwen3's attention_bias puts a bias on o_proj too
    assert biased.cfg.attention_bias and biased.model.model.layers[0].self_attn.o_proj.bias is not None


def test_phi3_loads_fused_checkpoint(family):
    t = family("phi3")
    assert t.cfg.architecture == "Phi3ForCausalLM" and t.cfg.sliding_windows == []
    names = {name for name, _ in hf_weights(t.path)}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    theirs = t.hf.state_dict()
    for name in ("model.layers.1.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj"):
        mine = projection_weight(t.model.get_submodule(name))  # rows, or panels read back
        torch.testing.assert_close(mine, theirs[name + ".weight"], atol=0, rtol=0)


def test_partial_rotary_is_refused(tmp_path):
    config = transformers.Phi3Config(**COMMON, pad_token_id=0, partial_rotary_factor=0.5)
    transformers.Phi3ForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5"):
        load_model(resolve_model(str(tmp_path)), torch.float32, "cpu")


def test_sliding_window_config(family):
    assert family("mistral-sw").cfg.sliding_windows == [8, 8]
    assert family("qwen2-sw").cfg.sliding_windows == [None, 6]
    assert family("qwen2").cfg.sliding_windows == []  # Qwen2.5 checkpoints: use_sliding_window false
    assert family("phi3-sw").cfg.sliding_windows == [8, 8]
    mistral = family("mistral-sw").model.model.layers
    assert [layer.self_attn.sliding_window for layer in mistral] == [8, 8]


@pytest.mark.parametrize("name", ["mistral-sw", "qwen2-sw", "phi3-sw"])
def test_sliding_window_matters(family, name):
    """The window changes the logits past it: petrel with the window ignored is far from transformers."""
    t = family(name)
    tokens = _tokens(30, 8)
    ref = t.hf_logits(tokens)
    layers = [layer.self_attn for layer in t.model.model.layers]
    windows = [a.sliding_window for a in layers]
    try:
        for a in layers:
            a.sliding_window = None
        drv = PagedDriver(t)
        unwindowed = drv.run_chunks(drv.new_seq(tokens), [12, 9] + [1] * 9)
    finally:
        for a, w in zip(layers, windows):
            a.sliding_window = w
    window = max(w for w in windows if w)
    assert_close(unwindowed[:window], ref[:window], "within the window")  # no difference before it fills
    assert (unwindowed[window:] - ref[window:]).abs().max() > 0.1
    drv = PagedDriver(t)
    assert_close(drv.run_chunks(drv.new_seq(tokens), [12, 9] + [1] * 9), ref, "windowed")


# ---------------------------------------------------------------- (a) prefill


@pytest.mark.parametrize("name", VARIANT_IDS)
def test_prefill_matches_transformers(family, name):
    t = family(name)
    drv = PagedDriver(t, block_size=4)
    prompts = [_tokens(23, 1), _tokens(9, 2), _tokens(1, 3)]  # mid-block ends, and a one-token prompt
    seqs = [drv.new_seq(p) for p in prompts]
    outs = drv.step([(s, s.num_tokens) for s in seqs])
    for p, out in zip(prompts, outs):
        assert_close(out, t.hf_logits(p), f"{name}: prefill of {len(p)} tokens")


# ---------------------------------------------------------------- (b) decode through the paged cache


@pytest.mark.parametrize("name", VARIANT_IDS)
def test_step_by_step_decode_matches_transformers(family, name):
    t = family(name)
    tokens, other = _tokens(30, 10), _tokens(14, 11)
    got_a, got_b = PagedDriver(t, block_size=4).decode_side_by_side(tokens, other)
    assert_close(got_a, t.hf_logits(tokens), f"{name}: step-by-step decode")
    assert_close(got_b, t.hf_logits(other), f"{name}: decode next to another sequence")


# ---------------------------------------------------------------- (c) chunked prefill


@pytest.mark.parametrize("name", FAMILY_IDS)
def test_chunked_prefill_matches_one_shot(family, name):
    t = family(name)
    tokens = _tokens(30, 30)
    one = PagedDriver(t, block_size=4)
    one_shot = one.run_chunks(one.new_seq(tokens), [30])
    for chunks in ([8, 12, 10], [5, 1, 17, 7]):
        drv = PagedDriver(t, block_size=4, seed=3)
        chunked = drv.run_chunks(drv.new_seq(tokens), chunks)
        assert_close(chunked, one_shot, f"{name}: chunks {chunks} vs one shot")
    assert_close(one_shot, t.hf_logits(tokens), f"{name}: one shot vs transformers")


# ---------------------------------------------------------------- (d) the whole engine, greedy


@pytest.mark.parametrize("name", FAMILY_IDS)
def test_engine_greedy_matches_transformers_generate(family, name):
    t = family(name)
    shared = _tokens(9, 60)
    prompts = [_tokens(21, 61), shared + _tokens(5, 62), shared]
    blocks = 64 * kv_bytes_per_block(t.cfg, 4, torch.float32)
    results, core = _engine_generate(t, prompts, 16, block_size=4, max_num_batched_tokens=16, kv_cache_memory=blocks)
    assert core.scheduler.prefix_hit_tokens == 8  # the third prompt reused the second one's two blocks
    for i, p in enumerate(prompts):
        expected = _hf_generate(t, p, 16)
        assert results[f"req{i}"] == expected, f"{name} prompt {i}: petrel {results[f'req{i}']} != {expected}"


# ---------------------------------------------------------------- GGUF files of the Qwen families


def _write_gguf(
    t: Tiny,
    arch: str,
    path: str,
    names: dict = _GGUF_NAMES,
    tokenizer_model: str = "gpt2",
    rope_theta: float | None = None,
    sliding_window: int | None = None,
    convert=None,
) -> None:
    """The tiny model as llama.cpp lays it out (float32 tensors, llama.cpp names; no q/k permutation for qwen).
    names: llama.cpp name -> Hugging Face name; convert(hf_name, array) -> the array as the file stores it."""
    gguf = pytest.importorskip("gguf")
    c = t.hf.config
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(t.cfg.head_dim)
    w.add_value_length(t.cfg.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(rope_theta if rope_theta is not None else c.rope_parameters["rope_theta"])
    if sliding_window is not None:
        w.add_sliding_window(sliding_window)
    w.add_tokenizer_model(tokenizer_model)
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    gguf_name = {hf: short for short, hf in names.items()}
    for name, tensor in t.hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            target = f"blk.{parts[2]}.{gguf_name['.'.join(parts[3:-1])]}.{parts[-1]}"
        else:
            target = f"{gguf_name['.'.join(parts[:-1])]}.{parts[-1]}"
        data = tensor.numpy().astype("float32")
        w.add_tensor(target, convert(name, data) if convert else data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name,arch", [("qwen2", "qwen2"), ("qwen3", "qwen3")])
def test_gguf_qwen_matches_transformers(family, tmp_path, name, arch):
    t = family(name)
    path = str(tmp_path / f"{name}.gguf")
    _write_gguf(t, arch, path)
    model, cfg = load_model(resolve_model(path), torch.float32, "cpu")
    assert cfg.architecture == t.cfg.architecture and cfg.head_dim == t.cfg.head_dim
    assert (cfg.qkv_bias, cfg.qk_norm, cfg.tie_word_embeddings) == (
        t.cfg.qkv_bias,
        t.cfg.qk_norm,
        t.cfg.tie_word_embeddings,
    )
    g = Tiny(t.hf, model, cfg, path)
    tokens = _tokens(19, 70)
    drv = PagedDriver(g)
    assert_close(drv.run_chunks(drv.new_seq(tokens), [11, 1, 7]), t.hf_logits(tokens), f"{name} from GGUF")


def test_qwen3_q_k_norms_run_in_the_one_call_stack(family, monkeypatch):
    """Qwen3's per-head q/k norms are part of the one-call decoder stack (decode_layers' layer extras): its decode
    steps and prompt chunks take the stack, with transformers' logits."""
    from test_model_tiny import stack_calls

    t = family("qwen3")
    taken = stack_calls(monkeypatch)
    tokens = _tokens(19, 40)
    drv = PagedDriver(t, block_size=4)
    got = drv.run_chunks(drv.new_seq(tokens), [7, 1, 1, 10])
    assert taken == [True] * 4
    assert_close(got, t.hf_logits(tokens), "qwen3 through the stack")
