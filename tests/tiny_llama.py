"""A tiny random-weight Llama built with transformers and loaded through petrel's loader (shared by the tests)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from petrel.model.loader import load_model, resolve_model

VOCAB = 256
ATOL = 1e-4
RTOL = 1e-4
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# (num_key_value_heads, tie_word_embeddings): MHA/GQA x untied/tied heads
VARIANTS = [(4, False), (2, False), (4, True), (2, True)]
VARIANT_IDS = ["mha-untied", "gqa-untied", "mha-tied", "gqa-tied"]


@dataclass
class Tiny:
    hf: torch.nn.Module  # transformers reference
    model: torch.nn.Module  # petrel, loaded from the saved checkpoint
    cfg: object  # petrel ModelConfig
    path: str

    def hf_logits(self, token_ids: list[int]) -> torch.Tensor:
        """[len, vocab] reference logits of every position."""
        with torch.no_grad():
            return self.hf(torch.tensor([token_ids])).logits[0].float()


def _build_hf(
    kv_heads: int, tied: bool, rope_scaling: dict | None, seed: int, head_dim: int | None = None
) -> HFLlamaForCausalLM:
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
    )
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    if rope_scaling is not None:
        kwargs["rope_scaling"] = dict(rope_scaling)  # transformers 5 stores it as config.rope_parameters
    config = LlamaConfig(**kwargs)
    config._attn_implementation = "eager"  # a reference independent of petrel's SDPA calls
    torch.manual_seed(seed)
    hf = HFLlamaForCausalLM(config)
    redraw_weights(hf, seed)
    if tied:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return hf.float().eval()


def redraw_weights(hf: torch.nn.Module, seed: int) -> None:
    """Re-draw every weight, norms included (transformers initialises norms to 1, which would hide a
    misplaced norm), large enough that logits are peaked and greedy choices are not near-ties."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def tiny_factory(tmp_path_factory):
    cache: dict = {}

    def build(
        kv_heads: int = 4,
        tied: bool = False,
        rope_scaling: dict | None = None,
        seed: int = 0,
        head_dim: int | None = None,
    ) -> Tiny:
        key = (kv_heads, tied, json.dumps(rope_scaling, sort_keys=True), seed, head_dim)
        if key not in cache:
            hf = _build_hf(kv_heads, tied, rope_scaling, seed, head_dim)
            path = tmp_path_factory.mktemp("tiny-llama")
            hf.save_pretrained(path, safe_serialization=True)
            model, cfg = load_model(resolve_model(str(path)), torch.float32, "cpu")
            assert cfg.num_key_value_heads == kv_heads and cfg.tie_word_embeddings == tied
            cache[key] = Tiny(hf, model, cfg, str(path))
        return cache[key]

    return build


def projection_weight(module: torch.nn.Module) -> torch.Tensor:
    """A projection's [out, in] weight: an nn.Linear's, or a QuantizedLinear's read back (a float32 model's decoder
    projections are held in panels wherever the kernels run: quantization.hold_f32_panels)."""
    from petrel.model.quantization import QuantizedLinear

    return module.qweight.dequantize() if isinstance(module, QuantizedLinear) else module.weight.detach()


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()  # avoid bos/eos ids
