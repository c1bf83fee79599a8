"""A prompt with media (vLLM's form: {"prompt": text, "multi_modal_data": {"image": image or [images], "video": video
or [videos]}}) -> its token ids and MultiModalInputs, through the model's processor; every failure a ValueError naming
the field."""

from __future__ import annotations

import json
import os

from petrel.multimodal.inputs import MultiModalInputs
from petrel.multimodal.media import DEFAULT_MAX_IMAGE_BYTES, load_image

TEXT_ONLY = "this model takes no images (it is a text-only model)"


def load_processor(path: str | None, tokenizer, mmproj: str | None = None):
    """The model directory's multimodal processor (or an mmproj GGUF's, petrel/model/mmproj.py), or None for a
    text-only model."""
    if mmproj is not None:
        from petrel.model.mmproj import Mmproj

        _need_pillow("an mmproj")
        from petrel.multimodal.idefics3 import Idefics3Processor

        projector = Mmproj(mmproj)  # its config without the text model's part (the processor needs none)
        return Idefics3Processor(None, tokenizer, projector.hf_config({}), projector.processor_config())
    config_path = os.path.join(path or "", "config.json")
    if path is None or not os.path.isfile(config_path):
        return None
    with open(config_path) as f:
        config = json.load(f)
    architecture = (config.get("architectures") or [""])[0]
    if architecture in ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"):
        _need_pillow(architecture)
        from petrel.multimodal.idefics3 import Idefics3Processor

        return Idefics3Processor(path, tokenizer, config)
    if architecture in ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"):
        _need_pillow(architecture)
        from petrel.multimodal.qwen2_vl import Qwen2VLProcessor

        return Qwen2VLProcessor(path, tokenizer, config)
    return None


def _need_pillow(what: str) -> None:
    try:
        import PIL  # noqa: F401
    except ImportError:
        raise ValueError(f"{what} takes images, which need Pillow: pip install 'petrel[vision]'") from None


def as_images(value, name: str, limit: int | None, max_pixels: int, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> list:
    """One image or a list of them, each loaded and checked (load_image); at most `limit` of them."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if limit is not None and len(values) > limit:
        raise ValueError(f"{name}: {len(values)} images, over the limit of {limit} per prompt (limit_mm_per_prompt)")
    return [load_image(v, f"{name}[{i}]", max_pixels, max_bytes) for i, v in enumerate(values)]


def multi_modal_prompt(processor, prompt: dict, limits: dict | None, max_pixels: int):
    """(text, token ids, MultiModalInputs) of a prompt dict with multi_modal_data."""
    data = prompt["multi_modal_data"]
    if processor is None:
        raise ValueError(f"multi_modal_data: {TEXT_ONLY}")
    if not isinstance(data, dict):
        raise ValueError(f"multi_modal_data must be a dict of kind -> items, got {type(data).__name__}")
    for kind in data:
        if kind not in processor.kinds:
            raise ValueError(f"multi_modal_data.{kind}: this model takes {', '.join(processor.kinds)} only")
    text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
    if ids is None and not isinstance(text, str):
        raise ValueError("multi_modal_data needs 'prompt' (text) or 'prompt_token_ids', with one placeholder per image")
    if ids is not None and (not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids)):
        raise ValueError("prompt_token_ids must be a list of token ids")
    images = as_images(data.get("image", []), "multi_modal_data.image", (limits or {}).get("image"), max_pixels)
    media = {}
    if "video" in data:
        media["videos"] = as_videos(processor, data["video"], "multi_modal_data.video", limits, max_pixels)
    ids, mm = processor.process(list(ids) if ids is not None else text, images, **media)
    return text, ids, mm


def as_videos(processor, value, name: str, limits: dict | None, max_pixels: int) -> list:
    """One video or a list of them (a list of frames counts as one video only inside a list), each decoded and
    sampled by the model's processor; at most limits["video"] of them."""
    values = list(value) if isinstance(value, (list, tuple)) and _is_video_list(value) else [value]
    limit = (limits or {}).get("video")
    if limit is not None and len(values) > limit:
        raise ValueError(f"{name}: {len(values)} videos, over the limit of {limit} per prompt (limit_mm_per_prompt)")
    return [processor.load_video(v, f"{name}[{i}]", max_pixels) for i, v in enumerate(values)]


def _is_video_list(value) -> bool:
    """A list of videos (each bytes, a list of frames or an array of frames), not one video's list of frames."""
    return all(isinstance(v, (bytes, bytearray, list, tuple)) or len(getattr(v, "shape", ())) == 4 for v in value)


def processed_prompt(prompt: dict):
    """(text, token ids, MultiModalInputs) of a prompt its caller ran through the processor already:
    {"prompt_token_ids": expanded ids, "multi_modal_inputs": MultiModalInputs} (the server does, to count them)."""
    mm, ids = prompt["multi_modal_inputs"], prompt.get("prompt_token_ids")
    if not isinstance(mm, MultiModalInputs) or not isinstance(ids, (list, tuple)):
        raise ValueError("multi_modal_inputs must be a MultiModalInputs, with the expanded prompt_token_ids")
    if any(p >= len(ids) for item in mm.items for p in item.positions):
        raise ValueError("multi_modal_inputs: placeholder positions past the end of prompt_token_ids")
    return prompt.get("prompt"), list(ids), mm
