"""Qwen2-VL and Qwen2.5-VL (dynamic resolution, multimodal rotary positions): petrel's inputs, tokens and prompt
logprobs equal transformers' on tiny random-weight models built with its own classes; mixed batches; prefix caching
keyed by image content; chunked prefill inside an image; the published checkpoint layouts."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from petrel import LLM, SamplingParams

pytest.importorskip("transformers")
from tiny_qwen2_vl import build_tiny_qwen_vl  # noqa: E402
from tiny_vlm import image  # noqa: E402

PAD = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT1 = f"<|im_start|>user\n{PAD}Describe it.<|im_end|>\n<|im_start|>assistant\n"
PROMPT2 = f"<|im_start|>user\n{PAD}What is this?{PAD}<|im_end|>\n<|im_start|>assistant\n"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
A, B, C = image(150, 100, 0), image(40, 40, 1), image(300, 90, 2)  # 6 x 8 patches, upscaled to the minimum, wide


@pytest.fixture(scope="module", params=["qwen2-vl", "qwen2.5-vl"])
def vlm(request, tmp_path_factory):
    return build_tiny_qwen_vl(str(tmp_path_factory.mktemp(request.param)), qwen25=request.param == "qwen2.5-vl")


@pytest.fixture(scope="module")
def llm(vlm):
    engine = LLM(vlm.path, kv_cache_memory=1 << 24, limit_mm_per_prompt={"image": 2, "video": 1})
    yield engine
    engine.shutdown()


def _mm(prompt: str, images) -> dict:
    return {"prompt": prompt, "multi_modal_data": {"image": images}}


def _hf_tokens(vlm, prompt: str, images: list, n: int = 8) -> list[int]:
    inputs = vlm.inputs(prompt, images)
    with torch.no_grad():
        out = vlm.hf.generate(**inputs, max_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize("prompt,images", [(PROMPT1, [A]), (PROMPT2, [A, B]), (PROMPT2, [C, A])])
def test_inputs_equal_the_hf_processors(llm, vlm, prompt, images):
    ids, mm = llm.engine.mm_processor.process(prompt, images)
    ref = vlm.inputs(prompt, images)
    assert ids == ref["input_ids"][0].tolist()
    assert [list(item.data.shape[:3]) for item in mm.items] == ref["image_grid_thw"].tolist()
    pixels = torch.cat([item.data.reshape(-1, item.data.shape[-1]) for item in mm.items])
    torch.testing.assert_close(pixels, ref["pixel_values"], atol=1e-6, rtol=0)
    image_rows = [i for i, t in enumerate(ids) if t == vlm.hf.config.image_token_id]
    assert [p for item in mm.items for p in item.positions] == image_rows
    want, delta = vlm.hf.model.get_rope_index(
        ref["input_ids"], ref["mm_token_type_ids"], image_grid_thw=ref["image_grid_thw"]
    )
    assert torch.equal(mm.mrope_positions, want[:, 0]) and mm.mrope_delta == int(delta)
    assert mm.mrope_delta < 0  # an image's tokens take fewer positions than tokens


@pytest.mark.parametrize("prompt,images", [(PROMPT1, [A]), (PROMPT2, [A, B])], ids=["1-image", "2-images"])
def test_greedy_tokens_equal_transformers(llm, vlm, prompt, images):
    out = llm.generate(_mm(prompt, images), GREEDY)
    assert out.outputs[0].token_ids == _hf_tokens(vlm, prompt, images)


def test_prompt_logprobs_equal_transformers(llm, vlm):
    out = llm.generate(_mm(PROMPT2, [A, C]), SamplingParams(max_tokens=1, prompt_logprobs=0))
    inputs = vlm.inputs(PROMPT2, [A, C])
    with torch.no_grad():
        ref = torch.log_softmax(vlm.hf(**inputs).logits[0].float(), -1)
    ids = inputs["input_ids"][0].tolist()
    assert out.prompt_token_ids == ids
    got = torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_text_only_prompt_equals_transformers(llm, vlm):
    prompt = "<|im_start|>user\nTell me a story about<|im_end|>\n<|im_start|>assistant\n"
    out = llm.generate(prompt, GREEDY)
    assert out.outputs[0].token_ids == _hf_tokens(vlm, prompt, [])


def test_mixed_batch_equals_each_alone(llm, vlm):
    prompts = [_mm(PROMPT2, [A, B]), "Tell me a story about", _mm(PROMPT1, [C])]
    alone = [llm.generate(p, GREEDY).outputs[0].token_ids for p in prompts]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert together == alone
    assert alone[2] == _hf_tokens(vlm, PROMPT1, [C])


def test_prefix_cache_is_keyed_by_image_content(llm, vlm):
    prompt = f"<|im_start|>system\nYou are a careful assistant who looks closely.\nuser:{PAD}Describe it well.\nai:"
    ids, mm = llm.engine.mm_processor.process(prompt, [A])
    first_row = mm.items[0].positions[0]
    assert first_row >= 16  # some whole blocks of text come before the image
    llm.generate(_mm(prompt, A), GREEDY)
    same = llm.generate(_mm(prompt, A), GREEDY)
    other_image = image(150, 100, 7)
    other = llm.generate(_mm(prompt, other_image), GREEDY)
    assert same.num_cached_tokens == (len(ids) - 1) // 16 * 16 > first_row  # cached past the image
    assert other.num_cached_tokens == first_row // 16 * 16  # the text before the image only
    assert other.outputs[0].token_ids == _hf_tokens(vlm, prompt, [other_image])


def test_chunked_prefill_inside_an_image_is_exact(vlm, llm):
    reference = llm.generate(_mm(PROMPT2, [A, C]), GREEDY).outputs[0].token_ids
    with LLM(vlm.path, kv_cache_memory=1 << 24, max_num_batched_tokens=7, enable_prefix_caching=False) as chunked:
        out = chunked.generate(_mm(PROMPT2, [A, C]), GREEDY)
        assert chunked.engine.core.runner.encoder_cache.num_encoded == 2  # each image once over its many chunks
    assert out.outputs[0].token_ids == reference == _hf_tokens(vlm, PROMPT2, [A, C])


def test_placeholder_count_must_match(llm):
    with pytest.raises(ValueError, match=r"1 <\|image_pad\|> placeholder\(s\) for 2 image"):
        llm.generate(_mm(PROMPT1, [A, B]), GREEDY)
    with pytest.raises(ValueError, match=r"2 <\|image_pad\|> placeholder"):
        llm.generate(PROMPT2, GREEDY)
    assert llm.generate(_mm(PROMPT1, [A]), GREEDY).outputs[0].token_ids  # and the engine goes on


def test_module_layout_loads_the_same(vlm, llm, tmp_path):
    """transformers' module names (model.visual.*, model.language_model.*) and a flat config with
    rope_scaling {"type": "mrope"}, as the published Qwen2-VL configs have it, load to the same model."""
    from safetensors.torch import load_file, save_file

    for name in os.listdir(vlm.path):
        shutil.copy(os.path.join(vlm.path, name), tmp_path / name)
    weights = load_file(str(tmp_path / "model.safetensors"))
    renamed = {}
    for name, tensor in weights.items():
        if name.startswith("visual."):
            name = "model." + name
        elif name.startswith("model."):
            name = "model.language_model." + name.removeprefix("model.")
        renamed[name] = tensor
    save_file(renamed, str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    config.update(text, rope_theta=rope["rope_theta"], rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    (tmp_path / "config.json").write_text(json.dumps(config))
    with LLM(str(tmp_path), kv_cache_memory=1 << 22) as published:
        out = published.generate(_mm(PROMPT2, [A, B]), GREEDY)
    assert out.outputs[0].token_ids == llm.generate(_mm(PROMPT2, [A, B]), GREEDY).outputs[0].token_ids


def test_preempted_image_requests_recompute_exactly(vlm, llm):
    """Recomputing a preempted sequence runs prompt and generated tokens in one span: the generated ones take
    index + rope delta."""
    prompts = [_mm(PROMPT2, [A, C]), _mm(PROMPT2, [C, B]), _mm(PROMPT1, [image(90, 150, 5)])]
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, long, use_tqdm=False)]
    with LLM(vlm.path, kv_cache_memory=12 * 4096, max_model_len=128, enable_prefix_caching=False) as small:
        got = [o.outputs[0].token_ids for o in small.generate(prompts, long, use_tqdm=False)]
        assert small.engine.core.scheduler.num_preemptions > 0
    assert got == want


VPAD = "<|vision_start|><|video_pad|><|vision_end|>"
VIDEO_PROMPT = f"<|im_start|>user\n{VPAD}What happens?{PAD}<|im_end|>\n<|im_start|>assistant\n"


def _frames(n: int, seed: int = 0) -> list:
    return [image(80, 60, seed + i) for i in range(n)]


def _encode(frames, rate: int = 5) -> bytes:
    """The frames as a lossless video (FFV1 in Matroska), decodable back to the same pixels."""
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as container:
        stream = container.add_stream("ffv1", rate=rate)
        stream.width, stream.height, stream.pix_fmt = frames[0].size[0], frames[0].size[1], "bgr0"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.asarray(frame), format="rgb24")))
        container.mux(stream.encode())
    return buf.getvalue()


def _hf_video_tokens(vlm, llm, prompt: str, video, images: list, n: int = 8) -> list[int]:
    """transformers' generate on petrel's token ids and patches (transformers' video processor needs torchvision,
    which is not installed here): the video's tower output, M-RoPE positions and decoding are the reference's."""
    ids, mm = llm.engine.mm_processor.process(prompt, images, [video])
    config = vlm.hf.config
    kinds = torch.tensor([[{config.image_token_id: 1, config.video_token_id: 2}.get(t, 0) for t in ids]])
    videos = [item for item in mm.items if item.kind == "video"]
    pics = [item for item in mm.items if item.kind == "image"]
    inputs = dict(
        input_ids=torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        mm_token_type_ids=kinds,
        pixel_values_videos=torch.cat([v.data.reshape(-1, v.data.shape[-1]) for v in videos]),
        video_grid_thw=torch.tensor([list(v.data.shape[:3]) for v in videos]),
    )
    if pics:
        inputs["pixel_values"] = torch.cat([p.data.reshape(-1, p.data.shape[-1]) for p in pics])
        inputs["image_grid_thw"] = torch.tensor([list(p.data.shape[:3]) for p in pics])
    if "Qwen2_5" in type(vlm.hf).__name__:
        inputs["second_per_grid_ts"] = torch.tensor([2 / video.fps])
    with torch.no_grad():
        out = vlm.hf.generate(**inputs, max_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


def test_video_greedy_tokens_equal_transformers(llm, vlm):
    pytest.importorskip("av")
    video = llm.engine.mm_processor.load_video(_encode(_frames(10)), "video", 1 << 30)
    assert len(video.frames) == 4  # 2 s at 5 fps, sampled at 2 fps
    prompt = {"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": _encode(_frames(10)), "image": [B]}}
    out = llm.generate(prompt, GREEDY)
    ids, mm = llm.engine.mm_processor.process(VIDEO_PROMPT, [B], [video])
    assert out.prompt_token_ids == ids and mm.items[0].kind == "video" and mm.items[0].data.shape[0] == 2
    assert out.outputs[0].token_ids == _hf_video_tokens(vlm, llm, VIDEO_PROMPT, video, [B])


def test_video_frames_decode_like_the_video_and_share_its_cache(llm):
    pytest.importorskip("av")
    frames = _frames(6, seed=40)
    prompt = f"{VPAD}Describe the clip in one long sentence, please."
    encoded = llm.generate({"prompt": prompt, "multi_modal_data": {"video": _encode(frames, rate=2)}}, GREEDY)
    given = llm.generate({"prompt": prompt, "multi_modal_data": {"video": [frames]}}, GREEDY)
    assert given.outputs[0].token_ids == encoded.outputs[0].token_ids
    array = np.stack([np.asarray(f) for f in frames])  # [frames, height, width, 3]
    as_array = llm.generate({"prompt": prompt, "multi_modal_data": {"video": array}}, GREEDY)
    assert as_array.outputs[0].token_ids == encoded.outputs[0].token_ids
    assert given.num_cached_tokens == (len(given.prompt_token_ids) - 1) // 16 * 16 > 0
    other = llm.generate({"prompt": prompt, "multi_modal_data": {"video": [_frames(6, seed=50)]}}, GREEDY)
    assert other.num_cached_tokens == 0  # the video starts the prompt


@pytest.mark.parametrize(
    "video,match",
    [
        (b"not a video", r"multi_modal_data\.video\[0\]: not a decodable video"),
        ("clip.mp4", r"multi_modal_data\.video\[0\] must be encoded video bytes"),
        ([[image(80, 60, 0), image(40, 40, 1)]], r"multi_modal_data\.video\[0\]: the frames differ in size"),
        ([b"a", b"b"], r"multi_modal_data\.video: 2 videos, over the limit of 1"),
    ],
)
def test_bad_videos_are_refused_by_name(llm, video, match):
    with pytest.raises(ValueError, match=match):
        llm.generate({"prompt": f"{VPAD}Hi", "multi_modal_data": {"video": video}}, GREEDY)
    assert llm.generate(_mm(PROMPT1, [A]), GREEDY).outputs[0].token_ids  # and the engine goes on


def test_serve_image_and_video_urls(vlm, llm):
    """petrel serve: image_url and video_url data URLs through the official openai client give transformers'
    tokens; a broken video is a 400 naming its content part, and the server keeps serving."""
    import base64
    import io

    import openai

    from petrel.serve import build_app
    from petrel.serve.server import BackgroundServer

    pytest.importorskip("av")
    buf = io.BytesIO()
    B.save(buf, format="PNG")
    image_url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    clip = _encode(_frames(10, seed=60))
    video_url = "data:video/x-matroska;base64," + base64.b64encode(clip).decode()
    content = [
        {"type": "video_url", "video_url": {"url": video_url}},
        {"type": "text", "text": "What happens?"},
        {"type": "image_url", "image_url": {"url": image_url}},
    ]
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, content[1], {"type": "image"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    video = llm.engine.mm_processor.load_video(clip, "video", 1 << 30)
    want = _hf_video_tokens(vlm, llm, prompt, video, [B], n=6)
    with BackgroundServer(build_app(llm, allow_remote_media=False)) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        kwargs = dict(model=vlm.path, max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
        resp = client.chat.completions.create(messages=[{"role": "user", "content": content}], **kwargs)
        assert resp.choices[0].token_ids == want
        broken = [{**content[0], "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(b"xx").decode()}}]
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(messages=[{"role": "user", "content": broken}], **kwargs)
        assert err.value.body["param"] == "messages.0.content.0" and "not a decodable video" in str(err.value)
        resp = client.chat.completions.create(messages=[{"role": "user", "content": content}], **kwargs)
        assert resp.choices[0].token_ids == want


def test_text_generation_request_videos(llm, vlm):
    from petrel.text_request import TextGenerationRequest

    pytest.importorskip("av")
    clip = _encode(_frames(10, seed=70))
    video = llm.engine.mm_processor.load_video(clip, "video", 1 << 30)
    messages = [{"role": "user", "content": [{"type": "video_url"}, {"type": "text", "text": "What happens?"}]}]
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, messages[0]["content"][1]]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    out = llm.generate(TextGenerationRequest("v", messages=messages, videos=[clip], sampling_params=GREEDY))
    assert out.outputs[0].token_ids == _hf_video_tokens(vlm, llm, prompt, video, [])
    with pytest.raises(ValueError, match=r"1 <\|video_pad\|> placeholder\(s\) for 0 video"):
        llm.generate(TextGenerationRequest("none", messages=messages, sampling_params=GREEDY))


def test_speculative_decoding_with_images(vlm, llm):
    """Self-speculation's draft and verify passes take the same M-RoPE positions (index + rope delta)."""
    want = llm.generate(_mm(PROMPT2, [A, B]), GREEDY).outputs[0].token_ids
    spec = {"method": "self", "num_speculative_tokens": 2, "draft_num_layers": 1}
    with LLM(vlm.path, kv_cache_memory=1 << 22, speculative_config=spec) as speculative:
        assert speculative.generate(_mm(PROMPT2, [A, B]), GREEDY).outputs[0].token_ids == want


def test_lookahead_tree_nodes_take_the_rotary_positions_of_their_depths(vlm, llm):
    """A draft tree whose second branch holds the right continuation (the first a wrong one): its nodes' M-RoPE
    positions are those of their depths (after the images' rope delta), so the accepted ones, and the tokens after
    them, are plain decoding's."""
    from petrel.engine.draft_tree import DraftTree

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = list(llm.generate(_mm(PROMPT2, [A, B]), params).outputs[0].token_ids)
    vocab = llm.engine.model_config.vocab_size

    def tree(seq, budget):
        right = want[seq.num_output_tokens : seq.num_output_tokens + 3]
        draft = DraftTree()
        draft.add_path([(t + 1) % vocab for t in right], budget)
        draft.add_path(right, budget)
        return draft

    spec = {"method": "lookahead", "max_window_size": 4, "max_ngram_size": 3, "max_verification_set_size": 4}
    with LLM(vlm.path, kv_cache_memory=1 << 22, speculative_config=spec) as speculative:
        speculative.engine.call(lambda core: setattr(core.drafting.lookahead, "tree", tree))
        assert list(speculative.generate(_mm(PROMPT2, [A, B]), params).outputs[0].token_ids) == want
        accepted, steps = speculative.engine.call(lambda core: (core.num_accepted_tokens, core.iteration))
        assert accepted >= 12 and steps <= 10
