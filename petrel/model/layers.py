"""Small building blocks of a decoder: RMS norm, rotary embedding, gated MLP activation.

On a device Triton serves (CUDA) each runs as one fused kernel of petrel/model/triton_ops; on the CPU, petrel's C
kernels (dense_kernels) or PyTorch."""

from __future__ import annotations

import math

import torch
from torch import nn

from petrel.model import dense_kernels, triton_ops


class Linear(nn.Linear):
    """nn.Linear with faster paths on CPU. In float32, up to dense_kernels.GEMV_MAX_ROWS rows (decode): petrel's
    kernel, which streams the weight once at memory bandwidth for a few rows (torch's BLAS reaches about half of it)
    and runs near the FMA peak at tens of rows; above (prefill), petrel's register-blocked AVX2 GEMM or torch's,
    whichever measured faster on the CPU's ISA (dense_kernels.prefill_gemm_is_petrels). Other dtypes, up to
    SMALL_BATCH rows: (W @ x^T)^T, with the weight as the left operand the CPU BLAS runs these skinny products
    15-30% faster."""

    SMALL_BATCH = 256

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.device.type != "cpu":
            return super().forward(x)
        if x.shape[0] > self.SMALL_BATCH:
            out = dense_kernels.gemm(x, self.weight) if dense_kernels.prefill_gemm_is_petrels() else None
            if out is None:
                return super().forward(x)
            return out if self.bias is None else out.add_(self.bias)
        out = dense_kernels.linear(x, self.weight)
        if out is None:
            if x.shape[0] < 2:
                return super().forward(x)
            out = torch.mm(self.weight, x.t()).t().contiguous()
        return out if self.bias is None else out.add_(self.bias)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if triton_ops.serves(x.device) and x.dtype == self.weight.dtype:
            return triton_ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps)[0].view(x.shape)
        if x.dim() == 2 and (out := dense_kernels.rms_norm(x, self.weight, self.eps)) is not None:
            return out
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # one fused op, same math
            return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): a pre-norm after the residual add, one kernel on a Triton device."""
        if triton_ops.serves(x.device) and x.dim() == 2 and x.dtype == residual.dtype == self.weight.dtype:
            return triton_ops.rms_norm(x, self.weight, self.eps, residual)
        residual = x + residual
        return self.forward(residual), residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if triton_ops.serves(gate_up.device) and gate_up.dim() == 2:
        return triton_ops.silu_and_mul(gate_up)
    if gate_up.dim() == 2 and (out := dense_kernels.silu_and_mul(gate_up)) is not None:
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies of rotary embedding, with Llama 3, linear or YaRN scaling when configured."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if kind == "freq_divisors":  # a GGUF's rope_freqs tensor (llama.cpp writes Llama 3's scaling so)
        divisors = torch.tensor(scaling["divisors"], dtype=torch.float64)
        if divisors.shape != inv_freq.shape:
            raise ValueError(f"rope_freqs has {divisors.numel()} values; head_dim {head_dim} needs {inv_freq.numel()}")
        return inv_freq / divisors
    if kind == "yarn":
        return _yarn_frequencies(inv_freq, head_dim, theta, scaling)
    if kind in (None, "default"):
        return inv_freq
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: linear, llama3, yarn)")


def _yarn_frequencies(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): frequencies that turn fewer than beta_slow times over the original context are
    interpolated (divided by factor), those that turn more than beta_fast times kept, a linear ramp between (over
    the dimensions, floored and ceiled to whole ones when `truncate`)."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(fast), dimension(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    kept = 1 - ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * (1 - kept) + inv_freq * kept


def rope_attention_factor(scaling: dict | None) -> float:
    """What YaRN multiplies cos and sin by (its attention_factor, else 0.1 ln(factor) + 1, or with mscale and
    mscale_all_dim the ratio of those two terms); 1 for every other scaling."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(factor: float, m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    factor = scaling["factor"]
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
    return mscale(factor)


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding (the Hugging Face Llama layout), cos/sin cached per position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = rope_inverse_frequencies(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        factor = rope_attention_factor(scaling)  # YaRN's: the tables carry it, so every kernel applies it
        self.register_buffer("cos", (emb.cos() * factor).float(), persistent=False)
        self.register_buffer("sin", (emb.sin() * factor).float(), persistent=False)

    def for_positions(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of a step's positions, [T, 1, head_dim] each: computed once per forward, used by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [T, heads, head_dim] (queries and keys together, to rotate both in one pass). On a Triton device x is
        rotated in place (and returned)."""
        cos, sin = cos_sin
        if triton_ops.serves(x.device) and x.dim() == 3 and x.stride(-1) == 1 and cos.shape[-1] == x.shape[-1]:
            return triton_ops.rotary_(x, cos, sin)
        if (out := dense_kernels.rotary(x, cos, sin)) is not None:
            return out
        return x * cos + _rotate_half(x) * sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, heads, head_dim], k: [T, kv_heads, head_dim]."""
        cos_sin = self.for_positions(positions, q.dtype)
        return self.rotate(q, cos_sin), self.rotate(k, cos_sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
