"""Qwen2-VL / Qwen2.5-VL prompts: each image through transformers' PIL Qwen2-VL image processor (smart resize within
min/max pixels, patches in merge order: the reference's numbers), each video's sampled frames resized and patched
the same way (petrel/multimodal/video.py decodes them); each <|image_pad|> / <|video_pad|> of the prompt repeated
once per merged patch, as the Hugging Face processor expands it, and the prompt's M-RoPE positions
(petrel/multimodal/mrope.py)."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import torch

from petrel.multimodal.inputs import MultiModalInputs, MultiModalItem
from petrel.multimodal.media import image_hash
from petrel.multimodal.mrope import VisionSpan, prompt_positions

IMAGE, VIDEO = "<|image_pad|>", "<|video_pad|>"
_NOT_KWARGS = {"image_processor_type", "processor_class", "feature_extractor_type", "auto_map", "video_processor_type"}
# transformers' Qwen2VLVideoProcessor defaults (its frames are resized to these pixel budgets, not the images')
VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS = 128 * 28 * 28, 768 * 28 * 28


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _image_processor_class():
    try:  # transformers 5: the PIL backend by name (the default one needs torchvision)
        from transformers import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil
    except ImportError:  # transformers 4: the only one is the PIL/numpy one
        from transformers import Qwen2VLImageProcessor

        return Qwen2VLImageProcessor


class Qwen2VLProcessor:
    kinds = ("image", "video")
    # an image is its placeholder rows given as embeddings (Executor), with the rotary table of its grid's positions
    # (Request.mrope_config): the rows alone cannot tell them
    takes_embeddings = True

    def __init__(self, path: str, tokenizer, config: dict):
        processor = _read_json(os.path.join(path, "processor_config.json"))
        kwargs = processor.get("image_processor") or _read_json(os.path.join(path, "preprocessor_config.json"))
        kwargs = {k: v for k, v in kwargs.items() if k not in _NOT_KWARGS}
        # transformers' order: processor_config.json's, video_preprocessor_config.json, else the image processor's
        video = processor.get("video_processor") or _read_json(os.path.join(path, "video_preprocessor_config.json"))
        video = video or kwargs
        self.image_processor = _image_processor_class()(**kwargs)
        self.tokenizer = tokenizer
        self.merge = self.image_processor.merge_size
        self.image_token_id = config.get("image_token_id", tokenizer.convert_tokens_to_ids(IMAGE))
        self.video_token_id = config.get("video_token_id", tokenizer.convert_tokens_to_ids(VIDEO))
        vision = config.get("vision_config") or {}
        qwen25 = (config.get("architectures") or [""])[0] == "Qwen2_5_VLForConditionalGeneration"
        # Qwen2.5-VL's video time scale (transformers' Qwen2_5_VLVisionConfig default when the config has none)
        self.tokens_per_second = vision.get("tokens_per_second", 4) if qwen25 else None
        size = video.get("size") or {}
        self.video_pixels = (
            video.get("min_pixels", size.get("shortest_edge", VIDEO_MIN_PIXELS)),
            video.get("max_pixels", size.get("longest_edge", VIDEO_MAX_PIXELS)),
        )
        self.video_fps = float(video.get("fps") or 2.0)  # frames sampled per second of video (vLLM's default)
        self.video_max_frames = int(video.get("max_frames") or 768)
        self.digest = hashlib.sha256(
            json.dumps([kwargs, self.video_pixels, self.video_fps], sort_keys=True, default=str).encode()
        ).digest()

    def load_video(self, value, name: str, max_pixels: int):
        """A caller's video (bytes, frames) decoded and sampled as this model's video processor would."""
        from petrel.multimodal.video import load_video

        return load_video(
            value, name, self.video_fps, self.image_processor.temporal_patch_size, self.video_max_frames, max_pixels
        )

    def _image(self, image) -> tuple[torch.Tensor, tuple[int, int, int]]:
        out = self.image_processor(images=[image], return_tensors="pt")
        t, h, w = (int(x) for x in out["image_grid_thw"][0])
        return out["pixel_values"].to(torch.float32).reshape(t, h, w, -1), (t, h, w)

    def _video(self, video) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """A decoded video's frames -> (patches [t, h, w, values], grid); the layout of transformers'
        Qwen2VLVideoProcessor: frames resized to one size (smart resize within the video pixel budget), rescaled and
        normalized, grouped temporal_patch_size at a time (the last frame repeated to fill the last group)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        ip = self.image_processor
        patch, merge, tp = ip.patch_size, ip.merge_size, ip.temporal_patch_size
        frames = [f.convert("RGB") for f in video.frames]
        width, height = frames[0].size
        h, w = smart_resize(height, width, patch * merge, *self.video_pixels)
        arrays = []
        for frame in frames:
            array = np.asarray(frame.resize((w, h), resample=3), dtype=np.float32)  # 3: PIL bicubic
            arrays.append(array.transpose(2, 0, 1) * ip.rescale_factor)
        data = (np.stack(arrays) - np.array(ip.image_mean, np.float32)[:, None, None]) / np.array(
            ip.image_std, np.float32
        )[:, None, None]
        if len(data) % tp:
            data = np.concatenate([data, np.repeat(data[-1:], tp - len(data) % tp, axis=0)])
        gt, gh, gw = len(data) // tp, h // patch, w // patch
        c = data.shape[1]
        x = data.reshape(gt, tp, c, gh // merge, merge, patch, gw // merge, merge, patch)
        x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (t, h/m, w/m, m, m, C, tp, P, P): the processor's order
        return torch.from_numpy(np.ascontiguousarray(x)).reshape(gt, gh, gw, -1), (gt, gh, gw)

    def process(
        self, prompt: str | list[int], images: list, videos: list = ()
    ) -> tuple[list[int], MultiModalInputs | None]:
        """(token ids, the media as MultiModalInputs, None without any) of a prompt (text, or its token ids) holding
        one <|image_pad|> per image and one <|video_pad|> per video, in prompt order. Each pad token becomes one
        per merged patch: the ids the Hugging Face processor's expanded text tokenizes to (special tokens)."""
        ids = self.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
        markers = [(i, t) for i, t in enumerate(ids) if t in (self.image_token_id, self.video_token_id)]
        for token, name, given in ((self.image_token_id, IMAGE, images), (self.video_token_id, VIDEO, videos)):
            found = sum(1 for _, t in markers if t == token)
            if found != len(given):
                kind = "image" if token == self.image_token_id else "video"
                raise ValueError(
                    f"prompt: it has {found} {name} placeholder(s) for {len(given)} {kind}(s); put one "
                    f"<|vision_start|>{name}<|vision_end|> where each {kind} goes"
                )
        out_ids, items, spans, at = [], [], [], 0
        pending = {self.image_token_id: iter(images), self.video_token_id: iter(videos)}
        for marker, token in markers:
            media = next(pending[token])
            if token == self.image_token_id:
                data, (t, h, w) = self._image(media)
                kind, digest, interval = "image", image_hash(media, self.digest), 1.0
            else:
                data, (t, h, w) = self._video(media)
                kind, digest = "video", media.hash(self.digest)
                interval = 1.0
                if self.tokens_per_second is not None:  # seconds per temporal patch
                    interval = self.tokens_per_second * self.image_processor.temporal_patch_size / media.fps
            out_ids += ids[at:marker]
            n = t * h * w // self.merge**2
            positions = tuple(range(len(out_ids), len(out_ids) + n))
            items.append(MultiModalItem(kind, digest, positions, data))
            spans.append(VisionSpan(len(out_ids), t, h // self.merge, w // self.merge, interval))
            out_ids += [token] * n
            at = marker + 1
        out_ids += ids[at:]
        if not items:
            return out_ids, None
        rope, delta = prompt_positions(len(out_ids), spans)
        return out_ids, MultiModalInputs(items, mrope_positions=rope, mrope_delta=delta)
