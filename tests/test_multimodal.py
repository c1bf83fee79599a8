"""Images in prompts (Idefics3 / SmolVLM): petrel's inputs, tokens and prompt logprobs equal transformers' on a tiny
random-weight model built with its own classes; prefix caching keyed by image content; chunked prefill inside an
image; the encoder cache; the limits and errors."""

from __future__ import annotations

import io
import os

import pytest
import torch

from petrel import LLM, SamplingParams

pytest.importorskip("transformers")
from tiny_vlm import build_tiny_idefics3, image  # noqa: E402

PROMPT1 = "<|im_start|>User:<image>Describe it.<end_of_utterance>\nAssistant:"
PROMPT2 = "<|im_start|>User:<image>What is this?<image><end_of_utterance>\nAssistant:"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
A, B, C = image(150, 100, 0), image(40, 40, 1), image(300, 90, 2)  # tiled, upscaled, wide


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return build_tiny_idefics3(str(tmp_path_factory.mktemp("tiny-idefics3")))


@pytest.fixture(scope="module")
def llm(vlm):
    engine = LLM(vlm.path, kv_cache_memory=1 << 24, limit_mm_per_prompt={"image": 2})
    yield engine
    engine.shutdown()


def _mm(prompt: str, images) -> dict:
    return {"prompt": prompt, "multi_modal_data": {"image": images}}


def _hf_tokens(vlm, prompt: str, images: list, n: int = 8) -> list[int]:
    inputs = vlm.inputs(prompt, images)
    with torch.no_grad():
        out = vlm.hf.generate(**inputs, max_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("prompt,images", [(PROMPT1, [A]), (PROMPT2, [A, B]), (PROMPT2, [C, A])])
def test_inputs_equal_the_hf_processors(llm, vlm, prompt, images):
    ids, mm = llm.engine.mm_processor.process(prompt, images)
    ref = vlm.inputs(prompt, images)
    assert ids == ref["input_ids"][0].tolist()
    pixels = torch.cat([item.data for item in mm.items])
    assert pixels.shape == ref["pixel_values"][0].shape
    torch.testing.assert_close(pixels, ref["pixel_values"][0], atol=1e-6, rtol=0)
    image_rows = [i for i, t in enumerate(ids) if t == vlm.hf.config.image_token_id]
    assert [p for item in mm.items for p in item.positions] == image_rows


@pytest.mark.parametrize("prompt,images", [(PROMPT1, [A]), (PROMPT2, [A, B])], ids=["1-image", "2-images"])
def test_greedy_tokens_equal_transformers(llm, vlm, prompt, images):
    out = llm.generate(_mm(prompt, images), GREEDY)
    assert out.outputs[0].token_ids == _hf_tokens(vlm, prompt, images)
    assert out.prompt == prompt


def test_prompt_logprobs_equal_transformers(llm, vlm):
    out = llm.generate(_mm(PROMPT2, [A, B]), SamplingParams(max_tokens=1, prompt_logprobs=0))
    inputs = vlm.inputs(PROMPT2, [A, B])
    with torch.no_grad():
        ref = torch.log_softmax(vlm.hf(**inputs).logits[0].float(), -1)
    ids = inputs["input_ids"][0].tolist()
    assert out.prompt_token_ids == ids and out.prompt_logprobs[0] is None
    got = torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_mixed_batch_equals_each_alone(llm, vlm):
    prompts = [_mm(PROMPT2, [A, B]), "Tell me a story about", _mm(PROMPT1, [C])]
    alone = [llm.generate(p, GREEDY).outputs[0].token_ids for p in prompts]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert together == alone
    assert alone[2] == _hf_tokens(vlm, PROMPT1, [C])


def test_bytes_decode_like_the_pil_image_and_share_its_cache(llm):
    first = llm.generate(_mm(PROMPT1, A), GREEDY)
    again = llm.generate(_mm(PROMPT1, _png(A)), GREEDY)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens == (len(again.prompt_token_ids) - 1) // 16 * 16  # all but the last partial block


def test_prefix_cache_is_keyed_by_image_content(llm, vlm):
    prompt = "<|im_start|>System: you are a careful assistant who looks closely.\nUser:<image>Describe.\nAssistant:"
    ids, mm = llm.engine.mm_processor.process(prompt, [B])
    first_row = mm.items[0].positions[0]
    assert first_row >= 16  # some whole blocks of text come before the image
    llm.generate(_mm(prompt, B), GREEDY)
    same = llm.generate(_mm(prompt, B), GREEDY)
    other = llm.generate(_mm(prompt, image(40, 40, 7)), GREEDY)
    assert same.num_cached_tokens == (len(ids) - 1) // 16 * 16 > first_row  # cached past the image
    assert other.num_cached_tokens == first_row // 16 * 16  # the text before the image only
    assert other.outputs[0].token_ids == _hf_tokens(vlm, prompt, [image(40, 40, 7)])


def test_one_image_in_many_requests_is_encoded_once(llm):
    cache = llm.engine.core.runner.encoder_cache
    picture = image(64, 64, 11)
    before = cache.num_encoded
    prompts = [_mm(f"<|im_start|>User:<image>Question {i}?\nAssistant:", picture) for i in range(3)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 2 for o in outs)
    assert cache.num_encoded - before == 1


def test_chunked_prefill_inside_an_image_is_exact(vlm, llm):
    reference = llm.generate(_mm(PROMPT2, [A, B]), GREEDY).outputs[0].token_ids
    with LLM(vlm.path, kv_cache_memory=1 << 24, max_num_batched_tokens=7, enable_prefix_caching=False) as chunked:
        out = chunked.generate(_mm(PROMPT2, [A, B]), GREEDY)
        assert chunked.engine.core.runner.encoder_cache.num_encoded == 2  # each image once over its many chunks
    assert out.outputs[0].token_ids == reference


@pytest.mark.parametrize(
    "images,match",
    [
        (b"not an image", r"multi_modal_data\.image\[0\]: not a decodable image"),
        ([A, b"\x89PNG\r\n\x1a\nbroken"], r"multi_modal_data\.image\[1\]"),
        ([A, B, C], r"multi_modal_data\.image: 3 images, over the limit of 2 per prompt"),
        ("a.png", r"multi_modal_data\.image\[0\] must be a PIL image or encoded image bytes"),
    ],
)
def test_bad_images_are_refused_by_name(llm, images, match):
    prompt = PROMPT2 if isinstance(images, list) and len(images) == 2 else PROMPT1
    with pytest.raises(ValueError, match=match):
        llm.generate(_mm(prompt, images), GREEDY)
    assert llm.generate(_mm(PROMPT1, A), GREEDY).outputs[0].token_ids  # and the engine goes on


def _png_header(width: int, height: int) -> bytes:
    """A PNG that claims width x height RGB pixels (its pixel data cut short): only its header is ever read."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + header + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("side", [10000, 20000])  # 100 MP: over petrel's budget; 400 MP: over Pillow's bomb limit too
def test_pixel_budget_is_checked_before_decoding(llm, side):
    with pytest.raises(ValueError, match=r"image\[0\]: the image is .*over the (limit|pixel budget)"):
        llm.generate(_mm(PROMPT1, _png_header(side, side)), GREEDY)


def test_placeholder_count_must_match(llm):
    with pytest.raises(ValueError, match="1 <image> placeholder"):
        llm.generate(_mm(PROMPT1, [A, B]), GREEDY)


def test_text_only_model_refuses_images(tiny, tokenizer_dir):
    with LLM(tiny(2, False).path, tokenizer=tokenizer_dir, kv_cache_memory=1 << 20) as text_only:
        with pytest.raises(ValueError, match="this model takes no images"):
            text_only.generate(_mm("<image>hi", A), GREEDY)


def test_prompt_token_ids_with_images(llm):
    ids = llm.tokenizer(PROMPT2)["input_ids"]
    by_ids = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [A, B]}}, GREEDY)
    assert by_ids.outputs[0].token_ids == llm.generate(_mm(PROMPT2, [A, B]), GREEDY).outputs[0].token_ids
    assert by_ids.prompt_token_ids == llm.engine.mm_processor.process(PROMPT2, [A, B])[0]


def test_text_generation_request_images(llm, vlm):
    from petrel.text_request import TextGenerationRequest

    want = _hf_tokens(vlm, PROMPT2, [A, B])
    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}, {"type": "image_url"}],
        }
    ]
    chat_prompt = vlm.processor.apply_chat_template(
        [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}, {"type": "image"}],
            }
        ],
        add_generation_prompt=True,
    )
    requests = [
        TextGenerationRequest("bytes", prompt=PROMPT2, images=[_png(A), _png(B)], sampling_params=GREEDY),
        TextGenerationRequest(
            "decoded", prompt=PROMPT2, images=[b"x", b"y"], decoded_images=[A, B], sampling_params=GREEDY
        ),
        TextGenerationRequest("chat", messages=messages, decoded_images=[A, B], sampling_params=GREEDY),
    ]
    outs = llm.generate(requests, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:2]] == [want, want]
    assert outs[2].outputs[0].token_ids == _hf_tokens(vlm, chat_prompt, [A, B])
    with pytest.raises(ValueError, match="videos: this model takes no video input"):
        llm.generate(TextGenerationRequest("v", prompt=PROMPT1, decoded_images=[A], videos=[b"mp4"]))
    with pytest.raises(ValueError, match="2 <image> placeholder"):
        llm.generate(TextGenerationRequest("missing", prompt=PROMPT2, sampling_params=GREEDY))


def test_published_layout_loads_the_same(vlm, llm, tmp_path):
    """The layout of the published SmolVLM / Idefics3 directories (written by transformers 4.x): rope_theta in
    text_config, the vision config's model_type 'idefics3', the text config's own architectures, the image
    processor in preprocessor_config.json and the template in chat_template.json."""
    import json
    import shutil

    for name in os.listdir(vlm.path):
        shutil.copy(os.path.join(vlm.path, name), tmp_path / name)
    config = json.loads((tmp_path / "config.json").read_text())
    text = config["text_config"]
    text["rope_theta"] = text.pop("rope_parameters")["rope_theta"]
    text["architectures"] = ["VLlama3ForCausalLM"]
    config["vision_config"]["model_type"] = "idefics3"
    (tmp_path / "config.json").write_text(json.dumps(config))
    processor = json.loads((tmp_path / "processor_config.json").read_text())
    image_processor = dict(processor.pop("image_processor"), processor_class="Idefics3Processor")
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(image_processor))
    (tmp_path / "processor_config.json").write_text(json.dumps(processor))
    template = (tmp_path / "chat_template.jinja").read_text()
    os.remove(tmp_path / "chat_template.jinja")
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    with LLM(str(tmp_path), kv_cache_memory=1 << 22) as published:
        assert published.tokenizer.chat_template == template
        out = published.generate(_mm(PROMPT2, [A, B]), GREEDY)
    assert out.outputs[0].token_ids == llm.generate(_mm(PROMPT2, [A, B]), GREEDY).outputs[0].token_ids


def test_speculative_decoding_with_images(vlm, llm):
    want = llm.generate(_mm(PROMPT2, [A, B]), GREEDY).outputs[0].token_ids
    spec = {"method": "self", "num_speculative_tokens": 2, "draft_num_layers": 1}
    with LLM(vlm.path, kv_cache_memory=1 << 22, speculative_config=spec) as speculative:
        assert speculative.generate(_mm(PROMPT2, [A, B]), GREEDY).outputs[0].token_ids == want
    with pytest.raises(ValueError, match="draft model cannot run with a vision-language model"):
        LLM(vlm.path, speculative_config={"method": "draft_model", "draft_model": vlm.path})


def test_placeholder_without_image_is_refused(llm):
    with pytest.raises(ValueError, match="1 <image> placeholder"):
        llm.generate(PROMPT1, GREEDY)
    assert llm.generate("A plain prompt", GREEDY).outputs[0].token_ids  # text alone runs


def test_prefix_hit_ending_inside_an_image(llm, vlm):
    """The cached blocks end inside the image's rows: the rest of its rows come from the encoder, which re-encodes
    the whole image when its output was dropped meanwhile."""
    prompt, picture = "User:<image>Hi", image(40, 40, 21)
    ids, mm = llm.engine.mm_processor.process(prompt, [picture])
    llm.generate(_mm(prompt, picture), GREEDY)
    cache = llm.engine.core.runner.encoder_cache
    llm.engine.call(lambda core: cache.clear())
    before = cache.num_encoded
    again = llm.generate(_mm(prompt, picture), GREEDY)
    assert mm.items[0].positions[0] < again.num_cached_tokens <= mm.items[0].positions[-1]
    assert cache.num_encoded == before + 1
    assert again.outputs[0].token_ids == _hf_tokens(vlm, prompt, [picture])


def test_smolvlm_architecture(tmp_path):
    smol = build_tiny_idefics3(str(tmp_path), seed=3, smolvlm=True)
    assert type(smol.hf).__name__ == "SmolVLMForConditionalGeneration"
    with LLM(smol.path, kv_cache_memory=1 << 22) as engine:
        out = engine.generate(_mm(PROMPT2, [A, C]), GREEDY)
    assert out.outputs[0].token_ids == _hf_tokens(smol, PROMPT2, [A, C])


def test_encoder_cache_evicts_least_recently_used():
    from petrel.engine.encoder_cache import EncoderCache
    from petrel.multimodal.inputs import MultiModalItem

    calls = []

    def encode(data):
        calls.append(len(data))
        return [d * 2 for d in data]

    items = [MultiModalItem("image", bytes([i]), (0, 1), torch.full((2, 4), float(i))) for i in range(3)]
    cache = EncoderCache(capacity_bytes=2 * 2 * 4 * 4)  # room for two outputs
    assert torch.equal(cache.outputs(items[:2] + items[:1], encode)[b"\x01"], items[1].data * 2)
    assert calls == [2]  # one call, each item once
    cache.outputs([items[0]], encode)  # item 0 is now the most recent
    cache.outputs([items[2]], encode)  # evicts item 1
    assert list(cache.entries) == [b"\x00", b"\x02"] and cache.num_bytes == 2 * 32
    cache.outputs([items[1]], encode)
    assert calls == [2, 1, 1] and (cache.num_encoded, cache.num_hits) == (4, 1)


def test_preempted_image_requests_recompute_exactly(vlm, llm):
    prompts = [_mm(PROMPT2, [A, B]), _mm(PROMPT2, [C, B]), _mm(PROMPT1, [image(90, 150, 5)])]
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, long, use_tqdm=False)]
    # 24 blocks of 16 tokens: the three prompts (about 200, 150 and 100 tokens) cannot all run on to 40 tokens
    with LLM(vlm.path, kv_cache_memory=24 * 8192, max_model_len=256) as small:
        got = [o.outputs[0].token_ids for o in small.generate(prompts, long, use_tqdm=False)]
        assert small.engine.core.scheduler.num_preemptions > 0
    assert got == want


def test_iteration_stats_count_the_encoders_work(llm):
    """IterationStats: images encoded, encoder-cache hits and encoder time, per step; their sums over the steps of
    a run equal the encoder cache's own counts."""
    history = llm.engine.stats_history
    llm.engine.call(lambda core: history.clear())
    picture = image(64, 48, 31)
    first = llm.generate(_mm(PROMPT1, picture), GREEDY)
    again = llm.generate(_mm("<|im_start|>Other text first. User:<image>Why?\nAssistant:", picture), GREEDY)
    assert first.outputs[0].token_ids and again.outputs[0].token_ids
    steps = llm.engine.call(lambda core: list(history))
    encoded = [s.num_images_encoded for s in steps]
    assert sum(encoded) == 1 and encoded.index(1) == 0  # in the first request's first (prefill) step
    assert sum(s.num_encoder_cache_hits for s in steps) == 1  # the second request's image
    assert steps[0].encoder_time > 0 and all(s.encoder_time == 0 for s in steps[1:])
    llm.generate("A text-only prompt", GREEDY)
    last = llm.engine.call(lambda core: core.last_stats)
    assert (last.num_images_encoded, last.num_encoder_cache_hits, last.encoder_time) == (0, 0, 0.0)
