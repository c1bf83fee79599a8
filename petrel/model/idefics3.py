"""Idefics3 / SmolVLM: a SigLIP vision tower and a pixel-shuffle connector in front of petrel's Llama text model.

The tower and the connector are transformers' own modules (Idefics3VisionTransformer / SmolVLMVisionTransformer and
their connectors), built from the checkpoint's config: the oracle's code, so the image embeddings are the
reference's by construction, and vision rows are large dense GEMMs torch already runs well. The text model is
petrel's (paged KV, batching, kernels); the image embeddings enter it through forward's input_embeds rows, which
petrel/engine/model_runner.py fills from the encoder cache (petrel/engine/encoder_cache.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from petrel.model.config import ModelConfig
from petrel.model.llama import LlamaForCausalLM
from petrel.model.parallel import SINGLE, TensorParallel
from petrel.model.vision_weights import copy_tower_weights

_TOWER_PREFIXES = ("vision_model.", "connector.")


def _hf_parts(architecture: str, config: dict):
    """(transformers config, vision tower class, connector class) of the architecture."""
    if architecture == "SmolVLMForConditionalGeneration":
        from transformers import SmolVLMConfig
        from transformers.models.smolvlm.modeling_smolvlm import SmolVLMConnector, SmolVLMVisionTransformer

        return SmolVLMConfig(**config), SmolVLMVisionTransformer, SmolVLMConnector
    from transformers import Idefics3Config
    from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector, Idefics3VisionTransformer

    return Idefics3Config(**config), Idefics3VisionTransformer, Idefics3Connector


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    """The Llama text model plus `vision_model` and `connector`; encode_images turns tiles into image-token rows."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        if tp.size > 1:
            raise ValueError(f"{cfg.architecture}: vision-language models run on one rank (tensor_parallel_size 1)")
        super().__init__(cfg, tp)
        hf, tower, connector = _hf_parts(cfg.architecture, cfg.multimodal_config or {})
        hf.vision_config._attn_implementation = "sdpa"
        self.vision_model = tower(hf.vision_config)
        self.connector = connector(hf)
        self.image_token_id = hf.image_token_id
        self.patch_size = hf.vision_config.patch_size

    def decoder_parameters(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.named_parameters() if not n.startswith(_TOWER_PREFIXES)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The published names: model.text_model.* (the Llama decoder), model.vision_model.*, model.connector.*,
        lm_head.weight."""
        tower: dict[str, torch.Tensor] = {}

        def text_weights():
            for name, tensor in weights:
                if name.startswith("model.text_model."):
                    yield "model." + name.removeprefix("model.text_model."), tensor
                elif name.startswith(tuple("model." + p for p in _TOWER_PREFIXES)):
                    tower[name.removeprefix("model.")] = tensor
                else:
                    yield name, tensor

        super().load_weights(text_weights())
        copy_tower_weights(self, _TOWER_PREFIXES, tower)

    @torch.inference_mode()
    def encode_images(self, tiles: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each image's tiles [n, 3, M, M] (as the image processor made them) -> its image-token embeddings
        [n * image_seq_len, hidden], in the order its <image> tokens take them. All tiles run as one batch; each
        tile is encoded on its own (no attention across tiles), so the result of an image never depends on the
        others in the batch."""
        counts = [t.shape[0] for t in tiles]
        norm = self.vision_model.post_layernorm.weight  # the tower's device and dtype (its linears may be quantized)
        pixels = torch.cat(tiles).to(device=norm.device, dtype=norm.dtype)
        side = pixels.shape[-1] // self.patch_size
        patches = torch.ones(pixels.shape[0], side, side, dtype=torch.bool, device=pixels.device)
        hidden = self.vision_model(pixel_values=pixels, patch_attention_mask=patches).last_hidden_state
        features = self.connector(hidden)  # [tiles, image_seq_len, text hidden]
        return [f.reshape(-1, f.shape[-1]) for f in features.split(counts)]
