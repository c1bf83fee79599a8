"""Rotary positions given with an Executor Request (petrel/executor/positions.py): position_ids on the tiny random
Llama against transformers given the same position_ids (positions 0, 1, 2, ... change nothing; other positions
key the prefix cache), and mrope_config on a tiny Qwen2-VL whose image rows come as embeddings: given the rotary
table and delta of the positions petrel computes itself for the images, the greedy tokens are LLM.generate's with
the images. Bad values are refused naming the field."""

from __future__ import annotations

import pytest
import torch

from petrel import LLM, SamplingParams
from petrel.config import EngineConfig
from petrel.executor import Executor, MropeConfig, OutputConfig, Request

pytest.importorskip("transformers")

EOS = 2
PROMPT = [5, 17, 33, 61, 99, 120, 7, 42, 8, 200, 31, 77, 12, 19]
N = 10


def hf_greedy(model, ids: list[int], positions: list[int], n: int) -> list[int]:
    """transformers, whole sequence each step, given position_ids (a new token's: the last one + 1), EOS banned."""
    tokens, positions = list(ids), list(positions)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([tokens]), position_ids=torch.tensor([positions])).logits[0, -1]
            logits[EOS] = float("-inf")
            tokens.append(int(logits.argmax()))
            positions.append(positions[-1] + 1)
    return tokens[len(ids) :]


def run(ex: Executor, ids, n: int = N, **fields):
    oc = OutputConfig(exclude_input_from_output=True)
    rid = ex.enqueue_request(Request(list(ids), n, bad_words=[[EOS]], output_config=oc, **fields))
    return ex.await_responses(rid, timeout=120)[-1]


def tokens(ex: Executor, ids, **fields) -> list[int]:
    r = run(ex, ids, **fields)
    assert not r.has_error(), r.error_msg
    return r.result.output_token_ids[0]


@pytest.fixture(scope="module")
def text(tiny, tokenizer_dir):
    t = tiny(2, False)
    config = EngineConfig.from_kwargs(model=t.path, tokenizer=tokenizer_dir, kv_cache_memory=1 << 20, block_size=4)
    with Executor(config) as ex:
        yield t, ex


def test_position_ids_equal_transformers_given_them(text):
    t, ex = text
    plain = tokens(ex, PROMPT)
    assert plain == hf_greedy(t.hf, PROMPT, list(range(len(PROMPT))), N)
    assert tokens(ex, PROMPT, position_ids=list(range(len(PROMPT)))) == plain  # the default, given
    # rotary attention sees relative positions: a shift changes nothing, a jump or other spacing does
    shifted = [p + 40 for p in range(len(PROMPT))]
    assert tokens(ex, PROMPT, position_ids=shifted) == plain == hf_greedy(t.hf, PROMPT, shifted, N)
    gaps = [p if p < 6 else p + 25 for p in range(len(PROMPT))]
    doubled = [2 * p for p in range(len(PROMPT))]
    for positions in (gaps, doubled):
        want = hf_greedy(t.hf, PROMPT, positions, N)
        assert want != plain  # the positions change these tokens
        for _ in range(2):  # after the default prompt's blocks are cached: never reused for other positions
            assert tokens(ex, PROMPT, position_ids=positions) == want


@pytest.mark.parametrize(
    "value, words",
    [
        ([0, 1, 2], "one per token"),
        ([-1] + list(range(1, len(PROMPT))), "integers >= 0"),
        ([float(p) for p in range(len(PROMPT))], "integers >= 0"),
        ([p + 250 for p in range(len(PROMPT))], "rotary positions"),
    ],
)
def test_bad_position_ids_are_refused(text, value, words):
    _, ex = text
    r = run(ex, PROMPT, position_ids=value)
    assert r.has_error() and "position_ids" in r.error_msg and words in r.error_msg, r.error_msg


def test_mrope_config_on_a_text_model_is_refused(text):
    _, ex = text
    r = run(ex, PROMPT, mrope_config=MropeConfig(torch.zeros(len(PROMPT), 16), 0))
    assert r.has_error() and "mrope_config" in r.error_msg


# ------------------------------------------------------------------------------------------- Qwen2-VL, M-RoPE
PAD = "<|vision_start|><|image_pad|><|vision_end|>"
VL_PROMPT = f"<|im_start|>user\n{PAD}What is this?{PAD}<|im_end|>\n<|im_start|>assistant\n"


def rotary_table(model, positions: torch.Tensor) -> torch.Tensor:
    """TensorRT-LLM's mrope_rotary_cos_sin of [3, L] positions: per token, per frequency, (cos, sin) of its section's
    stream's position, flattened as [1, L * head_dim]."""
    rotary = model.model.rotary
    half = rotary.cos.shape[1] // 2
    stream = rotary.stream[:half]
    angle_cos = rotary.cos[positions][:, :, :half]  # [3, L, half]: cos of each stream's position
    angle_sin = rotary.sin[positions][:, :, :half]
    index = stream.view(1, 1, -1).expand(1, positions.shape[1], -1)
    cos = angle_cos.gather(0, index)[0]
    sin = angle_sin.gather(0, index)[0]
    return torch.stack([cos, sin], dim=-1).reshape(1, -1)


def test_mrope_config_with_embeddings_gives_the_tokens_of_the_images(tmp_path):
    from tiny_qwen2_vl import build_tiny_qwen_vl
    from tiny_vlm import image

    vlm = build_tiny_qwen_vl(str(tmp_path / "qwen2-vl"))
    images = [image(150, 100, 0), image(40, 40, 1)]
    with LLM(vlm.path, kv_cache_memory=1 << 24) as llm:
        want = llm.generate(
            {"prompt": VL_PROMPT, "multi_modal_data": {"image": images}},
            SamplingParams(temperature=0, max_tokens=N, bad_words_token_ids=[[EOS]]),
        )
    want = want.outputs[0].token_ids
    with Executor(vlm.path, kv_cache_memory=1 << 24) as ex:
        ids, mm = ex.engine.mm_processor.process(VL_PROMPT, images)  # petrel's own ids, patches and positions
        model = ex.engine.core.runner.model
        rows = torch.cat(ex.engine.call(lambda core: model.encode_images([item.data for item in mm.items])))
        config = MropeConfig(rotary_table(model, mm.mrope_positions), torch.tensor([mm.mrope_delta]))
        assert mm.mrope_delta < 0
        assert tokens(ex, ids, multimodal_embedding=rows, mrope_config=config) == want
        assert tokens(ex, ids, multimodal_embedding=rows, mrope_config=config) == want  # through the prefix cache
        wrong = MropeConfig(rotary_table(model, torch.arange(len(ids)).expand(3, -1)), 0)  # text positions instead
        assert tokens(ex, ids, multimodal_embedding=rows, mrope_config=wrong) != want
        for fields, words in (
            ({"multimodal_embedding": rows}, "mrope_config is needed"),
            ({"multimodal_embedding": rows, "mrope_config": MropeConfig(torch.zeros(3, 16), 0)}, "rows of head_dim"),
            ({"multimodal_embedding": rows, "mrope_config": MropeConfig(config.mrope_rotary_cos_sin, 1.5)}, "integer"),
        ):
            r = run(ex, ids, **fields)
            assert r.has_error() and words in r.error_msg, r.error_msg
        r = run(ex, [5, 6, 7], position_ids=[0, 2, 4])
        assert r.has_error() and "M-RoPE" in r.error_msg, r.error_msg
