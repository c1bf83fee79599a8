"""A text GGUF + an mmproj GGUF (llama.cpp's `-m model.gguf --mmproj mmproj.gguf`) for Idefics3 / SmolVLM: the tiny
random-weight Idefics3 written as llama.cpp's converter lays it out (llama text GGUF with q/k rows permuted and the
tokenizer's image tokens; the vision tower and connector under gguf-py's own MMPROJ tensor names and clip.* keys)
gives the same inputs and greedy tokens as the Hugging Face directory (and so as transformers); bad files are
refused by name."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")
from test_multimodal import PROMPT1, PROMPT2, A, B, C, _hf_tokens, _mm  # noqa: E402
from tiny_vlm import CHAT_TEMPLATE, build_tiny_idefics3  # noqa: E402

from petrel import LLM, SamplingParams  # noqa: E402
from petrel.model.loader import load_model_config, resolve_model  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
TEXT_NAMES = {  # Hugging Face text decoder name -> llama.cpp's
    "embed_tokens": "token_embd",
    "norm": "output_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_text_gguf(vlm, path: str, arch: str = "llama") -> None:
    c = vlm.hf.config.text_config
    tok = vlm.processor.tokenizer
    w = gguf.GGUFWriter(path, arch)
    w.add_vocab_size(c.vocab_size)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    # the vocabulary as llama.cpp's converter writes it: the tokens, the added ones as control tokens, padded
    tokens = tok.convert_ids_to_tokens(list(range(len(tok))))
    added = set(tok.added_tokens_encoder)
    types = [gguf.TokenType.CONTROL if t in added else gguf.TokenType.NORMAL for t in tokens]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), c.vocab_size)]
    types += [gguf.TokenType.UNUSED] * (c.vocab_size - len(types))
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, tensor in vlm.hf.state_dict().items():
        if not name.startswith("model.text_model.") and name != "lm_head.weight":
            continue
        data = tensor.numpy().astype(np.float32)
        parts = name.removeprefix("model.text_model.").split(".")
        if name == "lm_head.weight":
            target = "output.weight"
        elif parts[0] == "layers":
            short = TEXT_NAMES[".".join(parts[2:-1])]
            target = f"blk.{parts[1]}.{short}.{parts[-1]}"
            if short in ("attn_q", "attn_k"):
                data = _permute(data, c.num_attention_heads if short == "attn_q" else c.num_key_value_heads)
        else:
            target = f"{TEXT_NAMES[parts[0]]}.{parts[-1]}"
        w.add_tensor(target, data)
    _finish(w)


def write_mmproj(
    vlm, path: str, projector: str = "idefics3", drop: str | None = None, f16: bool = False, preproc: bool = True
) -> None:
    """The vision tower and connector under llama.cpp's names, from gguf-py's own table (TensorNameMap); drop: a
    tensor left out; f16: matrices as F16; preproc: write clip.vision.preproc_image_size."""
    v = vlm.hf.config.vision_config
    ip = vlm.processor.image_processor
    w = gguf.GGUFWriter(path, "clip")
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type(projector)
    w.add_vision_image_size(v.image_size)
    w.add_vision_patch_size(v.patch_size)
    w.add_vision_embedding_length(v.hidden_size)
    w.add_vision_feed_forward_length(v.intermediate_size)
    w.add_vision_block_count(v.num_hidden_layers)
    w.add_vision_head_count(v.num_attention_heads)
    w.add_vision_attention_layernorm_eps(v.layer_norm_eps)
    w.add_vision_image_mean(list(ip.image_mean))
    w.add_vision_image_std(list(ip.image_std))
    w.add_vision_projector_scale_factor(vlm.hf.config.scale_factor)
    w.add_vision_use_gelu(True)
    if preproc:
        w.add_vision_preproc_image_size(ip.size["longest_edge"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, v.num_hidden_layers)
    for name, tensor in vlm.hf.state_dict().items():
        if not name.startswith(("model.vision_model.", "model.connector.")):
            continue
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert target is not None, name
        if target == drop:
            continue
        data = tensor.numpy().astype(np.float32)
        if f16 and data.ndim == 2 and "position_embd" not in target:  # llama.cpp keeps .embeddings. in F32
            data = data.astype(np.float16)
        w.add_tensor(target, data)
    _finish(w)


def _finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("mmproj")
    vlm = build_tiny_idefics3(str(root / "hf"), seed=5)
    text, mmproj = str(root / "text.gguf"), str(root / "mmproj.gguf")
    write_text_gguf(vlm, text)
    write_mmproj(vlm, mmproj)
    return vlm, text, mmproj


@pytest.fixture(scope="module")
def pair(files):
    vlm, text, mmproj = files
    gguf_llm = LLM(text, mmproj=mmproj, kv_cache_memory=1 << 23)
    hf_llm = LLM(vlm.path, kv_cache_memory=1 << 23)
    yield vlm, gguf_llm, hf_llm
    gguf_llm.shutdown()
    hf_llm.shutdown()


@pytest.mark.parametrize("prompt,images", [(PROMPT1, [A]), (PROMPT2, [A, B]), (PROMPT2, [C, A])])
def test_gguf_mmproj_equals_hf_directory(pair, prompt, images):
    vlm, gguf_llm, hf_llm = pair
    ids, mm = gguf_llm.engine.mm_processor.process(prompt, images)
    ref_ids, ref_mm = hf_llm.engine.mm_processor.process(prompt, images)
    assert ids == ref_ids
    for item, ref in zip(mm.items, ref_mm.items):
        assert item.positions == ref.positions and np.array_equal(item.data.numpy(), ref.data.numpy())
    got = gguf_llm.generate(_mm(prompt, images), GREEDY).outputs[0].token_ids
    assert got == hf_llm.generate(_mm(prompt, images), GREEDY).outputs[0].token_ids
    assert got == _hf_tokens(vlm, prompt, images)


def test_processor_settings_come_from_the_mmproj(pair):
    vlm, gguf_llm, _ = pair
    processor = gguf_llm.engine.mm_processor
    assert processor.image_seq_len == vlm.processor.image_seq_len
    assert processor.image_processor.size == vlm.processor.image_processor.size
    assert processor.image_processor.max_image_size == vlm.processor.image_processor.max_image_size


def test_processor_defaults_without_the_preproc_key(files, tmp_path):
    from petrel.model.mmproj import Mmproj

    vlm, _, _ = files
    path = str(tmp_path / "plain.gguf")
    write_mmproj(vlm, path, preproc=False)
    side = vlm.hf.config.vision_config.image_size
    settings = Mmproj(path).processor_config()["image_processor"]
    assert settings["size"] == {"longest_edge": 4 * side} and settings["max_image_size"] == {"longest_edge": side}


def test_f16_mmproj_loads_its_values(files, tmp_path):
    from petrel.model.mmproj import Mmproj

    vlm, _, _ = files
    path = str(tmp_path / "f16.gguf")
    write_mmproj(vlm, path, f16=True)
    state = vlm.hf.state_dict()
    weights = dict(Mmproj(path).weights())
    assert sorted(weights) == sorted(n for n in state if n.startswith(("model.vision_model.", "model.connector.")))
    for name, tensor in weights.items():
        expected = state[name].numpy()
        expected = expected.astype(np.float16) if expected.ndim == 2 and "position" not in name else expected
        np.testing.assert_array_equal(tensor.numpy(), expected.astype(np.float32), err_msg=name)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(projector="gemma3"), "clip.projector_type is 'gemma3'"),
        (dict(drop="v.blk.1.ffn_down.weight"), "tensor 'v.blk.1.ffn_down.weight' is missing"),
        (dict(drop="mm.model.fc.weight"), "tensor 'mm.model.fc.weight' is missing"),
    ],
)
def test_bad_mmproj_is_refused_by_name(files, tmp_path, kwargs, match):
    vlm, text, _ = files
    path = str(tmp_path / "bad.gguf")
    write_mmproj(vlm, path, **kwargs)
    with pytest.raises(ValueError, match=match):
        LLM(text, mmproj=path, kv_cache_memory=1 << 22)


def test_mmproj_needs_a_llama_text_gguf(files, tmp_path):
    vlm, _, mmproj = files
    with pytest.raises(ValueError, match="not a GGUF file"):
        LLM(vlm.path, mmproj=mmproj, kv_cache_memory=1 << 22)
    with pytest.raises(ValueError, match="no such .gguf file"):
        LLM(os.path.join(os.path.dirname(mmproj), "text.gguf"), mmproj=str(tmp_path / "none.gguf"))
    qwen = str(tmp_path / "qwen2.gguf")
    write_text_gguf(vlm, qwen, arch="qwen2")
    with pytest.raises(ValueError, match="text model is a Qwen2ForCausalLM GGUF"):
        load_model_config(resolve_model(qwen, mmproj))  # what LLM(qwen, mmproj=...) does before loading weights


def test_serve_flag_reaches_the_engine():
    import argparse

    from petrel.serve.server import add_arguments, engine_options

    args = add_arguments(argparse.ArgumentParser()).parse_args(["--model", "t.gguf", "--mmproj", "m.gguf"])
    assert engine_options(args)["mmproj"] == "m.gguf"
