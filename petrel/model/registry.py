"""Architecture name -> model class."""

from __future__ import annotations

from petrel.model.deepseek import DeepseekForCausalLM
from petrel.model.gemma3 import Gemma3ForCausalLM
from petrel.model.gpt_oss import GptOssForCausalLM
from petrel.model.idefics3 import Idefics3ForConditionalGeneration
from petrel.model.llama import LlamaForCausalLM
from petrel.model.moe import MoeForCausalLM
from petrel.model.qwen2_vl import Qwen2VLForConditionalGeneration

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,  # + qkv bias (ModelConfig.qkv_bias)
    "Qwen3ForCausalLM": LlamaForCausalLM,  # + per-head q/k norm (ModelConfig.qk_norm)
    "Phi3ForCausalLM": LlamaForCausalLM,  # checkpoint holds qkv_proj and gate_up_proj fused
    "Gemma3ForCausalLM": Gemma3ForCausalLM,  # Gemma 3 text (petrel/model/gemma3.py)
    # mixtures of experts (petrel/model/moe.py): Llama's attention, sparse MLPs
    "MixtralForCausalLM": MoeForCausalLM,
    "Qwen2MoeForCausalLM": MoeForCausalLM,  # + qkv bias, a gated shared expert, dense layers
    "Qwen3MoeForCausalLM": MoeForCausalLM,  # + per-head q/k norm
    # + sink logits, alternating windows, a router bias, biased experts, the clamped SwiGLU (petrel/model/gpt_oss.py)
    "GptOssForCausalLM": GptOssForCausalLM,
    # multi-head latent attention over a latent KV cache, DeepSeek's grouped router, shared experts
    # (petrel/model/deepseek.py)
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
    # vision-language: SigLIP tower + pixel-shuffle connector before a Llama text model (petrel/model/idefics3.py)
    "Idefics3ForConditionalGeneration": Idefics3ForConditionalGeneration,
    "SmolVLMForConditionalGeneration": Idefics3ForConditionalGeneration,
    # vision-language: dynamic-resolution tower before Qwen2 with multimodal rotary positions (petrel/model/qwen2_vl.py)
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
}


def model_class(architecture: str, where: str):
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise ValueError(
            f"{where}: architecture {architecture!r} is not supported; petrel supports "
            f"{', '.join(sorted(MODEL_CLASSES))}"
        ) from None
