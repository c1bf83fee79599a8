"""A tiny random-weight Idefics3 (SigLIP tower, pixel-shuffle connector, Llama text model) built with transformers'
own classes and saved in the published layout, with the SmolLM2 tokenizer plus the family's special tokens and the
Hugging Face processor files (shared by the multimodal tests)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from tiny_llama import redraw_weights

SPECIAL = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)
]
# SmolVLM's published chat template (transformers' smolvlm DEFAULT_CHAT_TEMPLATE, shortened to text and images)
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
IMAGE_SEQ_LEN = 16  # (image_size / patch_size)^2 / scale_factor^2 = (64 / 8)^2 / 4


@dataclass
class TinyVLM:
    path: str
    hf: torch.nn.Module  # transformers' Idefics3ForConditionalGeneration
    processor: object  # transformers' Idefics3Processor over the PIL image processor: the oracle's inputs

    def inputs(self, prompt: str, images: list):
        return self.processor(text=[prompt], images=[images] if images else None, return_tensors="pt")


def image(width: int, height: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


def build_tiny_idefics3(path: str, seed: int = 0, smolvlm: bool = False) -> TinyVLM:
    """smolvlm: SmolVLM's classes (SmolVLMForConditionalGeneration, same weight names); the inputs still come from
    Idefics3Processor, whose strings SmolVLM's processor shares (its own needs torchvision for videos)."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from petrel.model.loader import resolve_model
    from petrel.model.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(None))
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    config_class, model_class = (SmolVLMConfig, SmolVLMForConditionalGeneration)
    if not smolvlm:
        config_class, model_class = (Idefics3Config, Idefics3ForConditionalGeneration)
    config = config_class(
        text_config=dict(
            model_type="llama",
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
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=64,
            patch_size=8,
        ),
        scale_factor=2,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
    )
    config._attn_implementation = "eager"  # a reference independent of SDPA
    torch.manual_seed(seed)
    hf = model_class(config)
    redraw_weights(hf, seed)
    with torch.no_grad():  # SigLIP's position and patch embeddings at the scale of its inputs
        for name, p in hf.named_parameters():
            if "vision_model.embeddings" in name:
                p.mul_(0.5)
    hf = hf.float().eval()
    hf.save_pretrained(path)
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": 128}, max_image_size={"longest_edge": 64})
    tok.chat_template = CHAT_TEMPLATE
    processor = Idefics3Processor(
        image_processor=image_processor, tokenizer=tok, image_seq_len=IMAGE_SEQ_LEN, chat_template=CHAT_TEMPLATE
    )
    processor.save_pretrained(path)
    return TinyVLM(str(path), hf, processor)
