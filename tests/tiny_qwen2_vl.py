"""Tiny random-weight Qwen2-VL and Qwen2.5-VL (dynamic-resolution vision tower, Qwen2 text model with M-RoPE) built
with transformers' own classes and saved as Hugging Face directories, with the SmolLM2 tokenizer plus the family's
special tokens and the image processor's config (shared by tests/test_qwen2_vl.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tiny_llama import redraw_weights

SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|im_start|>", "<|im_end|>"]
MIN_PIXELS, MAX_PIXELS = 4 * 28 * 28, 16 * 28 * 28  # 4 to 16 merged tokens per image
# Qwen2-VL's published chat template, shortened to text, images and videos
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' %}"
    "<|vision_start|><|video_pad|><|vision_end|>{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class TinyQwenVL:
    path: str
    hf: torch.nn.Module  # transformers' Qwen2VLForConditionalGeneration / Qwen2_5_VLForConditionalGeneration
    processor: object  # transformers' Qwen2VLProcessor / Qwen2_5_VLProcessor over the PIL image processor

    def inputs(self, prompt: str, images: list):
        return self.processor(text=[prompt], images=images or None, return_tensors="pt")


def build_tiny_qwen_vl(path: str, seed: int = 0, qwen25: bool = False) -> TinyQwenVL:
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
        Qwen2VLProcessor,
    )

    from petrel.model.loader import resolve_model
    from petrel.model.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(None))
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.chat_template = CHAT_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    text = dict(
        vocab_size=49280,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )
    common = dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    if qwen25:
        vision = dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            window_size=56,  # 2 x 2 merged patches per window: the small images have several
            fullatt_block_indexes=[1],
            tokens_per_second=2,
            **common,
        )
        config_class, model_class = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
        processor_class = Qwen2_5_VLProcessor
    else:
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, **common)
        config_class, model_class, processor_class = Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor
    config = config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config._attn_implementation = "eager"  # a reference independent of SDPA
    torch.manual_seed(seed)
    hf = model_class(config)
    redraw_weights(hf, seed)
    hf = hf.float().eval()
    hf.save_pretrained(path)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    image_processor.save_pretrained(path)
    tok.save_pretrained(path)
    return TinyQwenVL(str(path), hf, _images_only(processor_class)(image_processor, tok))


def _images_only(processor_class):
    """transformers' processor without its video processor (which needs torchvision, not installed here): the
    image path and the placeholder expansion are the processor's own."""
    from transformers.processing_utils import ProcessorMixin

    class ImagesOnly(processor_class):
        def __init__(self, image_processor=None, tokenizer=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, **kwargs)

    return ImagesOnly
