"""rotary_: rotate-half rotary embedding (layers.RotaryEmbedding's convention) of every head of a token, in place,
one program per token; cos and sin are the step's rows, gathered once per forward and shared by every layer."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    stride_xt,
    stride_xh,
    heads,
    HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_HEADS)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < heads) & (d < HALF)
    first = x_ptr + token * stride_xt + h * stride_xh + d
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    row = token * 2 * HALF + d
    cos1 = tl.load(cos_ptr + row, mask=d < HALF, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + row + HALF, mask=d < HALF, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + row, mask=d < HALF, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + row + HALF, mask=d < HALF, other=0.0).to(tl.float32)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(first, (a * cos1 - b * sin1).to(x1.dtype), mask=mask)
    tl.store(first + HALF, (b * cos2 + a * sin2).to(x1.dtype), mask=mask)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] (a strided view is fine: its last dim contiguous) in place by cos and sin
    [T, head_dim] (or [T, 1, head_dim]): x * cos + rotate_half(x) * sin. Returns x."""
    tokens, heads, head_dim = x.shape
    cos, sin = (t.reshape(tokens, head_dim).contiguous() for t in (cos, sin))
    if x.stride(-1) != 1 or head_dim % 2:
        raise ValueError(f"x {tuple(x.shape)} needs an even head_dim and a contiguous last dimension")
    if tokens and heads:
        half = head_dim // 2
        _rotary_kernel[(tokens,)](
            x,
            cos,
            sin,
            x.stride(0),
            x.stride(1),
            heads,
            HALF=half,
            BLOCK_HEADS=triton.next_power_of_2(heads),
            BLOCK_HALF=triton.next_power_of_2(half),
        )
    return x
