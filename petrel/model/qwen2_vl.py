"""Qwen2-VL / Qwen2.5-VL: a dynamic-resolution vision tower in front of petrel's Qwen2 text model with multimodal
rotary positions (M-RoPE).

The tower is transformers' own module (Qwen2VisionTransformerPretrainedModel / Qwen2_5_VisionTransformerPretrained
Model, patch merger included), built from the checkpoint's config: the oracle's code, so the image and video
embeddings are the reference's by construction. The text model is petrel's Llama path with q/k/v biases; its rotary
embedding takes a [3, T] position tensor (temporal, height, width streams, petrel/multimodal/mrope.py), each stream
rotating its own section of the head's frequencies (`mrope_section`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from petrel.model.config import ModelConfig
from petrel.model.layers import RotaryEmbedding
from petrel.model.llama import LlamaForCausalLM
from petrel.model.parallel import SINGLE, TensorParallel
from petrel.model.vision_weights import copy_tower_weights

QWEN_VL_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")


class MRotaryEmbedding(RotaryEmbedding):
    """Rotary embedding over three position streams: frequency j of section i (mrope_section splits the head_dim / 2
    frequencies) turns with stream i's position. Positions [T] (one stream) act as three equal streams."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, section: list[int], scaling: dict | None):
        super().__init__(head_dim, max_positions, theta, scaling)
        if sum(section) != head_dim // 2:
            raise ValueError(f"mrope_section {section} must sum to head_dim / 2 = {head_dim // 2}")
        half = torch.cat([torch.full((n,), i) for i, n in enumerate(section)])
        self.register_buffer("stream", torch.cat([half, half]), persistent=False)  # [head_dim]: stream of each dim

    def for_positions(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().for_positions(positions, dtype)
        index = self.stream.view(1, 1, -1).expand(1, positions.shape[1], -1)
        cos = self.cos[positions].gather(0, index).squeeze(0)  # [3, T, D] -> [T, D], each dim from its stream
        sin = self.sin[positions].gather(0, index).squeeze(0)
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)


def _vision_tower(architecture: str, config: dict):
    """(transformers config, the vision tower module) of the architecture, built from its config (random weights)."""
    if architecture == "Qwen2_5_VLForConditionalGeneration":
        from transformers import Qwen2_5_VLConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        hf, tower = Qwen2_5_VLConfig(**config), Qwen2_5_VisionTransformerPretrainedModel
    else:
        from transformers import Qwen2VLConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        hf, tower = Qwen2VLConfig(**config), Qwen2VisionTransformerPretrainedModel
    hf.vision_config._attn_implementation = "sdpa"
    return hf, tower(hf.vision_config)


class Qwen2VLForConditionalGeneration(LlamaForCausalLM):
    """The Qwen2 text model with M-RoPE plus `visual`; encode_images turns patch grids into image-token rows."""

    uses_mrope = True  # the model runner passes [3, T] positions

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        if tp.size > 1:
            raise ValueError(f"{cfg.architecture}: vision-language models run on one rank (tensor_parallel_size 1)")
        super().__init__(cfg, tp)
        if not cfg.mrope_section:
            raise ValueError(f"{cfg.architecture}: the config has no mrope_section (rope_scaling / rope_parameters)")
        self.model.rotary = MRotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, list(cfg.mrope_section), cfg.rope_scaling
        )
        hf, self.visual = _vision_tower(cfg.architecture, cfg.multimodal_config or {})
        self.merge_size = hf.vision_config.spatial_merge_size

    def decoder_parameters(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.named_parameters() if not n.startswith("visual.")}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Both published layouts: visual.* / model.* / lm_head.* (the Qwen checkpoints, and what transformers 5
        still writes) and model.visual.* / model.language_model.* / lm_head.* (transformers' module names)."""
        tower: dict[str, torch.Tensor] = {}

        def text_weights():
            for name, tensor in weights:
                if name.startswith("model.visual."):
                    tower[name.removeprefix("model.")] = tensor
                elif name.startswith("visual."):
                    tower[name] = tensor
                elif name.startswith("model.language_model."):
                    yield "model." + name.removeprefix("model.language_model."), tensor
                else:
                    yield name, tensor

        super().load_weights(text_weights())
        copy_tower_weights(self, ("visual.",), tower)

    @torch.inference_mode()
    def encode_images(self, grids: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each image's or video's patches as [t, h, w, patch values] (the image processor's pixel_values in grid
        shape) -> its token embeddings [t * h * w / merge^2, hidden], in the order its placeholder tokens take them.
        All run as one call; attention stays inside each item (the tower's cu_seqlens), so an item's result never
        depends on the others in the batch."""
        weight = self.visual.patch_embed.proj.weight  # the tower's device and dtype
        thw = torch.tensor([g.shape[:3] for g in grids], dtype=torch.long, device=weight.device)
        pixels = torch.cat([g.reshape(-1, g.shape[-1]) for g in grids]).to(device=weight.device, dtype=weight.dtype)
        out = self.visual(pixels, grid_thw=thw)
        merged = out.pooler_output if hasattr(out, "pooler_output") else out
        return list(merged.split([g.shape[:3].numel() // self.merge_size**2 for g in grids]))
