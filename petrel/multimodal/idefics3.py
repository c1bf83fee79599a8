"""Idefics3 / SmolVLM prompts: each image through transformers' PIL image processor (resize, tiles, global view,
normalization: the reference's numbers), its <image> marker in the prompt expanded as the Hugging Face processor
expands it, then the whole text tokenized once."""

from __future__ import annotations

import hashlib
import json
import os

import torch

from petrel.multimodal.inputs import MultiModalInputs, MultiModalItem
from petrel.multimodal.media import image_hash

IMAGE = "<image>"
FAKE = "<fake_token_around_image>"
GLOBAL = "<global-img>"
_NOT_KWARGS = {"image_processor_type", "processor_class", "feature_extractor_type", "auto_map"}


def _image_processor_class():
    try:  # transformers 5: the PIL backend by name (the default switches to torchvision's when that is installed)
        from transformers import Idefics3ImageProcessorPil

        return Idefics3ImageProcessorPil
    except ImportError:  # transformers 4: the only one is the PIL/numpy one
        from transformers import Idefics3ImageProcessor

        return Idefics3ImageProcessor


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


class Idefics3Processor:
    kinds = ("image",)
    takes_embeddings = True  # an image is its placeholder rows alone: given embeddings can stand for it (Executor)

    def __init__(self, path: str | None, tokenizer, config: dict, processor: dict | None = None):
        """processor: processor_config.json's content when there is no directory (an mmproj GGUF's,
        petrel/model/mmproj.py)."""
        if processor is None:
            processor = _read_json(os.path.join(path, "processor_config.json"))
        kwargs = processor.get("image_processor") or _read_json(os.path.join(path, "preprocessor_config.json"))
        kwargs = {k: v for k, v in kwargs.items() if k not in _NOT_KWARGS}
        vision = config.get("vision_config", {})
        scale = config.get("scale_factor", 2)
        default_seq = (vision.get("image_size", 224) // vision.get("patch_size", 32)) ** 2 // (scale * scale)
        self.image_seq_len = int(processor.get("image_seq_len", default_seq))
        self.image_processor = _image_processor_class()(**kwargs)
        self.tokenizer = tokenizer
        self.image_token_id = config.get("image_token_id", tokenizer.convert_tokens_to_ids(IMAGE))
        self.digest = hashlib.sha256(
            json.dumps([kwargs, self.image_seq_len], sort_keys=True, default=str).encode()
        ).digest()

    def placeholder(self, rows: int, cols: int) -> str:
        """The text an image's <image> marker becomes: a tile per row and column, then the global view (Hugging
        Face's Idefics3Processor.replace_image_token)."""
        tokens = IMAGE * self.image_seq_len
        text = ""
        for r in range(rows):
            text += "".join(f"{FAKE}<row_{r + 1}_col_{c + 1}>{tokens}" for c in range(cols)) + "\n"
        return text + ("\n" if rows or cols else "") + f"{FAKE}{GLOBAL}{tokens}{FAKE}"

    def process(self, prompt: str | list[int], images: list) -> tuple[list[int], MultiModalInputs | None]:
        """(token ids, the images as MultiModalInputs, None without images) of a prompt (text, or its token
        ids) holding one <image> placeholder per image. Each placeholder becomes the image's expansion tokenized
        alone: it begins and ends with a special token, so these are the ids the whole expanded text tokenizes to
        (the Hugging Face processor's input_ids; tests/test_multimodal.py checks it)."""
        ids = self.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
        markers = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(markers) != len(images):
            raise ValueError(
                f"prompt: it has {len(markers)} {IMAGE} placeholder(s) for {len(images)} "
                f"image(s); put one {IMAGE} where each image goes"
            )
        out_ids, items, at = [], [], 0
        for image, marker in zip(images, markers):
            pixels = self.image_processor(images=[[image]], return_row_col_info=True, return_tensors="pt")
            expansion = self.tokenizer(
                self.placeholder(pixels["rows"][0][0], pixels["cols"][0][0]), add_special_tokens=False
            )["input_ids"]
            out_ids += ids[at:marker]
            positions = tuple(len(out_ids) + k for k, t in enumerate(expansion) if t == self.image_token_id)
            tiles = pixels["pixel_values"][0].to(torch.float32)
            if len(positions) != tiles.shape[0] * self.image_seq_len:
                raise ValueError(f"image_seq_len {self.image_seq_len} does not match the tokenizer's {IMAGE} token")
            items.append(MultiModalItem("image", image_hash(image, self.digest), positions, tiles))
            out_ids += expansion
            at = marker + 1
        return out_ids + ids[at:], MultiModalInputs(items) if items else None
