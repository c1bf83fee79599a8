"""The Executor's multimodal fields on a tiny random-weight Idefics3: image rows given as embeddings (what
transformers' own encoder makes) give the greedy tokens LLM.generate gives with the images, without running petrel's
encoder; MultimodalInput splits them into items; the prefix cache is keyed by the embeddings; bad fields are refused
by name and the executor goes on."""

from __future__ import annotations

import re
import time

import pytest
import torch

from petrel import LLM, SamplingParams

pytest.importorskip("transformers")
from tiny_vlm import build_tiny_idefics3, image  # noqa: E402

from petrel.executor import Executor, MultimodalInput, OutputConfig, Request  # noqa: E402

PROMPT1 = "<|im_start|>User:<image>Describe it.<end_of_utterance>\nAssistant:"
PROMPT2 = "<|im_start|>User:<image>What is this?<image><end_of_utterance>\nAssistant:"
A, B = image(150, 100, 0), image(40, 40, 1)
N = 8


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return build_tiny_idefics3(str(tmp_path_factory.mktemp("tiny-idefics3")))


@pytest.fixture(scope="module")
def executor(vlm):
    ex = Executor(vlm.path, kv_cache_memory=1 << 23)
    yield ex
    ex.shutdown()


def _hf_embeddings(vlm, prompt: str, images: list) -> tuple[list[int], list[torch.Tensor]]:
    """(the HF processor's input_ids, each image's rows from transformers' vision tower + connector)."""
    rows = []
    for picture in images:  # one [tiles * image_seq_len, hidden] tensor per image
        one = vlm.inputs("<image>", [picture])
        with torch.no_grad():
            features = vlm.hf.model.get_image_features(one["pixel_values"], one["pixel_attention_mask"])
        rows.append(features.pooler_output[0])
    return vlm.inputs(prompt, images)["input_ids"][0].tolist(), rows


def _run(ex: Executor, ids: list[int], **fields):
    request = Request(ids, N, output_config=OutputConfig(exclude_input_from_output=True), **fields)
    request_id, deadline = ex.enqueue_request(request), time.monotonic() + 120
    while time.monotonic() < deadline:
        for r in ex.await_responses(request_id, timeout=1.0):
            if r.has_error() or r.result.is_final:
                return r
    raise AssertionError("the request did not finish")


def _tokens(response) -> list[int]:
    assert not response.has_error(), response.error_msg
    return response.result.output_token_ids[0]


def _llm_tokens(vlm, prompt: str, images: list) -> list[int]:
    with LLM(vlm.path, kv_cache_memory=1 << 22) as llm:
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, _greedy())
    return out.outputs[0].token_ids


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=N)


def _encoded(ex: Executor) -> int:
    return ex.engine.call(lambda core: core.runner.encoder_cache.num_encoded)


def test_embeddings_give_the_tokens_of_the_images(executor, vlm):
    ids1, (rows_a,) = _hf_embeddings(vlm, PROMPT1, [A])
    ids2, (rows_a2, rows_b) = _hf_embeddings(vlm, PROMPT2, [A, B])
    want1, want2 = _llm_tokens(vlm, PROMPT1, [A]), _llm_tokens(vlm, PROMPT2, [A, B])
    before = _encoded(executor)
    assert _tokens(_run(executor, ids1, multimodal_embedding=rows_a)) == want1
    both = torch.cat([rows_a2, rows_b])
    assert _tokens(_run(executor, ids2, multimodal_embedding=both)) == want2
    # the same rows split into the two images by TensorRT-LLM's MultimodalInput
    image_rows = [i for i, t in enumerate(ids2) if t == vlm.hf.config.image_token_id]
    split = MultimodalInput([[1] * 8, [2] * 8], [image_rows[0], image_rows[len(rows_a2)]], [len(rows_a2), len(rows_b)])
    assert _tokens(_run(executor, ids2, multimodal_embedding=both, multimodal_input=split)) == want2
    assert _encoded(executor) == before  # petrel's vision encoder never ran
    assert not any(s.num_images_encoded or s.num_encoder_cache_hits for s in executor.get_latest_iteration_stats())


def test_prefix_cache_is_keyed_by_the_embeddings(executor, vlm):
    prompt = "<|im_start|>System: you are a careful assistant who looks closely.\nUser:<image>Describe.\nAssistant:"
    ids, (rows,) = _hf_embeddings(vlm, prompt, [B])
    first_row = ids.index(vlm.hf.config.image_token_id)
    assert first_row >= 16  # whole blocks of text before the image
    perf = OutputConfig(exclude_input_from_output=True, return_perf_metrics=True)

    def reused(embedding) -> tuple[int, list[int]]:
        request = Request(ids, N, output_config=perf, multimodal_embedding=embedding)
        request_id = executor.enqueue_request(request)
        [r] = [r for r in executor.await_responses(request_id, timeout=120)]
        return r.result.request_perf_metrics.kv_cache_metrics.num_reused_blocks, _tokens(r)

    _, want = reused(rows)
    same_blocks, same = reused(rows.clone())
    other_blocks, other = reused(rows + 0.5)
    assert same == want and other != want  # the rows are what the model reads
    assert same_blocks == (len(ids) - 1) // 16  # cached past the image
    assert other_blocks == first_row // 16  # the text before the image only


def _split(hashes, positions, lengths):
    return lambda rows: {"multimodal_embedding": rows, "multimodal_input": MultimodalInput(hashes, positions, lengths)}


@pytest.mark.parametrize(
    "fields,match",
    [
        (lambda rows: {"multimodal_embedding": "rows"}, r"multimodal_embedding must be a \[rows, hidden\] tensor"),
        (lambda rows: {"multimodal_embedding": rows[:, :32]}, r"must be a floating-point \[rows, 64\] tensor"),
        (lambda rows: {"multimodal_embedding": rows[:3]}, r"multimodal_embedding has 3 rows, but input_token_ids has"),
        (lambda rows: {"multimodal_embedding": rows * float("nan")}, "multimodal_embedding has NaN"),
        (
            lambda rows: {"multimodal_input": MultimodalInput([[1] * 8], [0], [len(rows)])},
            "multimodal_input needs Request.multimodal_embedding",
        ),
        (lambda rows: {}, "input_token_ids has .* image placeholder token.* no multimodal_embedding"),
        (lambda rows: _split([[1] * 8], [0], [len(rows)])(rows), r"multimodal_positions\[0\] = 0"),
        (lambda rows: _split([[1] * 8], [None], [len(rows)])(rows), "multimodal_positions must be a list of int"),
        (lambda rows: _split([[1] * 8, [2]], [0], [1])(rows), "2 hashes, 1 positions and 1 lengths"),
        (lambda rows: {"multimodal_embedding": rows, "multimodal_input": "x"}, "must be an executor MultimodalInput"),
    ],
    ids=["not-a-tensor", "width", "rows", "nan", "input-alone", "none", "position", "int", "counts", "type"],
)
def test_bad_multimodal_fields_are_refused_by_name(executor, vlm, fields, match):
    ids, (rows,) = _hf_embeddings(vlm, "User:<image>Hi", [B])
    response = _run(executor, ids, **fields(rows))
    assert response.has_error() and re.search(match, response.error_msg), response.error_msg
    assert _tokens(_run(executor, ids, multimodal_embedding=rows))  # and the executor goes on


def test_multimodal_input_must_cover_every_placeholder(executor, vlm):
    ids, (rows_a, rows_b) = _hf_embeddings(vlm, PROMPT2, [A, B])
    image_rows = [i for i, t in enumerate(ids) if t == vlm.hf.config.image_token_id]
    both = torch.cat([rows_a, rows_b])
    short = MultimodalInput([[1] * 8], [image_rows[0]], [len(rows_a)])
    r = _run(executor, ids, multimodal_embedding=both, multimodal_input=short)
    assert r.has_error() and "multimodal_lengths sum to" in r.error_msg
    gap = MultimodalInput([[1] * 8, [2] * 8], [image_rows[0], image_rows[len(rows_a) + 1]], [len(rows_a), len(rows_b)])
    r = _run(executor, ids, multimodal_embedding=both, multimodal_input=gap)
    assert r.has_error() and "multimodal_positions[1]" in r.error_msg
