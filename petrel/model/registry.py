"""Architecture name -> model class."""

from __future__ import annotations

from petrel.model.gemma3 import Gemma3ForCausalLM
from petrel.model.llama import LlamaForCausalLM

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,  # + qkv bias (ModelConfig.qkv_bias)
    "Qwen3ForCausalLM": LlamaForCausalLM,  # + per-head q/k norm (ModelConfig.qk_norm)
    "Phi3ForCausalLM": LlamaForCausalLM,  # checkpoint holds qkv_proj and gate_up_proj fused
    "Gemma3ForCausalLM": Gemma3ForCausalLM,  # Gemma 3 text (petrel/model/gemma3.py)
}


def model_class(architecture: str, where: str):
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise ValueError(
            f"{where}: architecture {architecture!r} is not supported; petrel supports "
            f"{', '.join(sorted(MODEL_CLASSES))}"
        ) from None
