"""gpt-oss (transformers' GptOssForCausalLM, model_type gpt_oss) over a flat token batch.

petrel's mixture-of-experts decoder (petrel/model/moe.py, on Llama's layers) with:
  attention  biases on q, k, v and o; a learned logit per query head (`sink_logits`) that joins each softmax over the
             keys and is dropped from the output (petrel/model/attention.py), so a head may attend to nothing;
             sliding-window layers (window 128) alternating with full ones (`layer_types`), each kind in KV groups
             of its own (petrel/engine/kv_groups.py): the sliding layers keep only their window's blocks;
  rotary     YaRN-scaled, cos and sin times its attention factor (petrel/model/layers.py);
  MLP        every layer a mixture of experts: the router with a bias, the top-k logits then a softmax over those k,
             each expert's gate/up and down products with biases and the clamped SwiGLU between them,
             (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit).

Checkpoints: transformers' layout, every expert of a layer stacked as x @ W multiplies them (gate_up_proj [E, H, 2I]
with gate and up columns interleaved, gate_up_proj_bias [E, 2I] likewise, down_proj [E, I, H], down_proj_bias
[E, H]), turned here into petrel's rows with gate before up; the router is `mlp.router`, the sink logits
`self_attn.sinks`. The published checkpoints hold the experts in MXFP4 instead (quantization_config quant_method
mxfp4): gate_up_proj_blocks [E, 2I, H/32, 16] and gate_up_proj_scales [E, 2I, H/32] (rows interleaved gate/up), the
same for down_proj ([E, H, I/32, ...]); each byte holds elements 2j (low nibble) and 2j + 1 (high) of its block,
each scale is an E8M0 exponent. They are kept in MXFP4 (QuantizedWeight.mxfp4, one per expert and matrix: the
nibbles re-paired as GGUF pairs them, j and 16 + j), multiplied by quant_kernels.c with each block widened on the
fly. GGUF files (llama.cpp's gpt-oss layout) load through petrel/model/loader.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from petrel.model.config import ModelConfig
from petrel.model.llama import LlamaModel
from petrel.model.moe import MoeDecoderLayer, MoeForCausalLM
from petrel.model.parallel import SINGLE, ParallelLMHead, TensorParallel

# the MXFP4 experts of a layer: blocks or scales
_MXFP4 = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)_(blocks|scales)$")
# every expert's tensors of a layer, in transformers' layout (x @ W: inputs first)
_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj|gate_up_proj_bias|down_proj_bias)$")
# the experts' biases under petrel's names (loaded by moe.Experts): whole, or gate and up apart
_BIAS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_bias|down_bias|gate_bias|up_bias)$")
_BIAS_PART: dict[str, tuple[str, int | None]] = {
    "gate_up_bias": ("gate_up_bias", None),
    "down_bias": ("down_bias", None),
}
_BIAS_PART |= {"gate_bias": ("gate_up_bias", 0), "up_bias": ("gate_up_bias", 1)}


def gate_then_up(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved gate/up entries (gate 0, up 0, gate 1, ...) along `dim` as petrel holds them: every gate, then
    every up."""
    return torch.cat([t.unflatten(dim, (-1, 2)).select(dim + 1, p) for p in (0, 1)], dim)


def gguf_pairs(blocks: torch.Tensor) -> torch.Tensor:
    """MXFP4 blocks [..., 16] bytes with elements 2j, 2j + 1 in byte j (low nibble first: the checkpoints' order) as
    GGUF and petrel's 4-bit codes hold them: elements j and 16 + j in byte j."""
    elements = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., 32] in order
    return elements[..., :16] | (elements[..., 16:] << 4)


def mxfp4_experts(base: str, kind: str, blocks: torch.Tensor, scales: torch.Tensor) -> Iterator[tuple[str, object]]:
    """A layer's MXFP4 experts of one kind (gate_up_proj or down_proj: blocks [E, rows, K/32, 16], scales [E, rows,
    K/32]) as one QuantizedWeight per expert and matrix, named as the per-expert checkpoints name them (gate and up
    apart, rows de-interleaved)."""
    from petrel.model.quantization import QuantizedWeight

    if blocks.dim() != 4 or blocks.shape[-1] != 16 or tuple(scales.shape) != tuple(blocks.shape[:3]):
        raise ValueError(
            f"{base}.{kind}_blocks {tuple(blocks.shape)} and _scales {tuple(scales.shape)} are not MXFP4 experts"
        )
    codes, exponents = gguf_pairs(blocks.to(torch.uint8)), scales.to(torch.uint8)
    for e in range(codes.shape[0]):
        if kind == "down_proj":
            yield f"{base}.{e}.down_proj.weight", QuantizedWeight.mxfp4(codes[e], exponents[e])
            continue
        for part, name in ((0, "gate_proj"), (1, "up_proj")):
            yield f"{base}.{e}.{name}.weight", QuantizedWeight.mxfp4(codes[e, part::2], exponents[e, part::2])


class GptOssDecoderLayer(MoeDecoderLayer):
    """A mixture-of-experts layer whose decode steps run as one kernel call with their biases and sink logits
    (dense_kernels.decode_layer: LayerParts' biases and sink_logits, moe.c's biased experts and clamped SwiGLU)."""

    attention_biases_in_kernels = True


class GptOssForCausalLM(MoeForCausalLM):
    """gpt-oss: MoeForCausalLM whose config sets the sink logits, the windows, the router's bias and top-k-then-
    softmax routing, the experts' biases and the clamped SwiGLU (ModelConfig.from_hf_config)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        torch.nn.Module.__init__(self)
        self.config = cfg
        self.model = LlamaModel(cfg, tp, layer_class=GptOssDecoderLayer)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._petrel_layout(weights))

    def _petrel_layout(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors under petrel's names and layouts: the sink logits of this rank's heads, the
        router as `mlp.gate`, the experts' stacks transposed to rows with gate before up."""
        cfg = self.config
        mxfp4: dict[tuple[str, str], dict[str, torch.Tensor]] = {}  # (experts, kind) -> blocks and scales so far
        for name, tensor in weights:
            if (m := _MXFP4.match(name)) is not None:
                held = mxfp4.setdefault((m.group(1), m.group(2)), {})
                held[m.group(3)] = tensor
                if len(held) == 2:
                    del mxfp4[(m.group(1), m.group(2))]
                    yield from mxfp4_experts(m.group(1), m.group(2), held["blocks"], held["scales"])
                continue
            if name.endswith(".self_attn.sinks"):
                if tuple(tensor.shape) != (cfg.num_attention_heads,):
                    raise ValueError(
                        f"weight {name!r} has shape {tuple(tensor.shape)}, expected ({cfg.num_attention_heads},)"
                    )
                attn = self.get_submodule(name.removesuffix(".sinks"))
                lo, hi = attn.head_range
                yield name.removesuffix("sinks") + "sink_logits", tensor[lo:hi]
                continue
            name = name.replace(".mlp.router.", ".mlp.gate.")
            m = _EXPERTS.match(name) if isinstance(tensor, torch.Tensor) and tensor.dim() in (2, 3) else None
            if m is None:
                yield name, tensor
                continue
            base, kind = m.group(1), m.group(2)
            if kind == "gate_up_proj":  # [E, H, 2I] -> [E, 2I, H]
                yield f"{base}.gate_up_proj", gate_then_up(tensor.transpose(1, 2), 1)
            elif kind == "down_proj":  # [E, I, H] -> [E, H, I]
                yield f"{base}.down_proj", tensor.transpose(1, 2)
            elif kind == "gate_up_proj_bias":
                yield f"{base}.gate_up_bias", gate_then_up(tensor, 1)
            else:
                yield f"{base}.down_bias", tensor
        for base, kind in mxfp4:
            raise ValueError(f"checkpoint has {base}.{kind}_blocks or _scales without the other")

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        """The experts' biases into their layer's Experts (piece (None, part): every expert's, gate and up together
        or apart); the rest as MoeForCausalLM's."""
        if (m := _BIAS.match(name)) is not None:
            kind, part = _BIAS_PART[m.group(2)]
            return f"{m.group(1)}.{kind}", (None, part)
        return super().checkpoint_target(name)
