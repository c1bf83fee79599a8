"""DeepSeek's rotary embedding: YaRN-scaled frequencies and its two magnitude corrections, as transformers computes
them (modeling_rope_utils' _compute_yarn_parameters and yarn_apply_mscale).

With rope_scaling {"rope_type": "yarn", factor s, original_max_position_embeddings L, beta_fast, beta_slow, mscale,
mscale_all_dim} over a rotary dimension d and base theta:
  frequencies  each pair i's inverse frequency blends theta^(-2i/d) (extrapolated) and theta^(-2i/d) / s
               (interpolated) by a ramp between the dimensions where L / (beta_fast 2 pi) and L / (beta_slow 2 pi)
               rotations fall (rounded outwards), interpolated below the ramp, extrapolated above;
  rotary       cos and sin times attention_factor (given, or m(s, mscale) / m(s, mscale_all_dim) with
               m(s, k) = 0.1 k ln s + 1, or m(s, 1) when either is missing): 1 for DeepSeek's published configs;
  softmax      the attention scale times m(s, mscale_all_dim)^2 (MLA scales the whole q.k, not only its rotary part).
"""

from __future__ import annotations

import math

import torch

from petrel.model.layers import RotaryEmbedding, rope_inverse_frequencies


def mscale(factor: float, k: float = 1.0) -> float:
    """YaRN's m(s, k) = 0.1 k ln s + 1 (1 for s <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * k * math.log(factor) + 1.0


def _yarn(dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    factor = float(scaling["factor"])
    original = scaling["original_max_position_embeddings"]
    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    inv_freq = extrapolated / factor * ramp + extrapolated * (1 - ramp)
    return inv_freq, float(attention)


def rotary_parameters(dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2] float64, factor on cos and sin) of a DeepSeek rotary embedding."""
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "yarn":
        return _yarn(dim, theta, scaling)
    return rope_inverse_frequencies(dim, theta, scaling), 1.0


def softmax_scale(head_dim: int, scaling: dict | None) -> float:
    """head_dim^-0.5, times m(s, mscale_all_dim)^2 under YaRN with mscale_all_dim set (transformers' rule)."""
    scale = head_dim**-0.5
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind != "default" and scaling.get("mscale_all_dim"):
        m = mscale(float(scaling["factor"]), scaling["mscale_all_dim"])
        scale *= m * m
    return scale


class ScaledRotaryEmbedding(RotaryEmbedding):
    """Rotate-half rotary embedding over the given frequencies, cos and sin multiplied by `attention` (YaRN's)."""

    def __init__(self, dim: int, max_positions: int, theta: float, scaling: dict | None):
        torch.nn.Module.__init__(self)
        inv_freq, attention = rotary_parameters(dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * attention).float(), persistent=False)
        self.register_buffer("sin", (emb.sin() * attention).float(), persistent=False)
