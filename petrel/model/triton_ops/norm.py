"""rms_norm: RMS norm of each row, optionally after adding the residual stream (Llama's pre-norm), one program
per row with float32 accumulation."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    stride_x,
    stride_residual,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    mask = i < hidden
    x = tl.load(x_ptr + row * stride_x + i, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_residual + i, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded as the unfused add would be
        tl.store(new_residual_ptr + row * hidden + i, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    w = tl.load(weight_ptr + i, mask=mask, other=0.0).to(tl.float32)
    out = (xf * rstd).to(x.dtype).to(tl.float32) * w
    tl.store(out_ptr + row * hidden + i, out.to(x.dtype), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (rows may be strided), weight [H] of x's dtype. Without a residual: (norm(x) * weight, x). With
    one: s = x + residual, then (norm(s) * weight, s), both new [T, H] tensors of x's dtype."""
    if x.dim() != 2 or weight.shape != (x.shape[1],) or weight.dtype != x.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype} do not fit")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must be shaped and typed like x")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        residual_in, new_residual = x, x
    else:
        residual_in = residual if residual.stride(-1) == 1 else residual.contiguous()
        new_residual = torch.empty_like(out)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x,
            residual_in,
            weight,
            out,
            new_residual,
            x.stride(0),
            residual_in.stride(0),
            x.shape[1],
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(x.shape[1]),
        )
    return out, new_residual
