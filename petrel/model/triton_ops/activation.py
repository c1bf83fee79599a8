"""silu_and_mul: a gated MLP's activation, silu(gate) * up from the fused [T, 2I] projection, in one pass."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns of one program


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < inter
    gate = tl.load(gate_up_ptr + row * stride_in + i, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + inter + i, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # rounded as the unfused silu would be
    tl.store(out_ptr + row * inter + i, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate, then up; rows may be strided) -> silu(gate) * up, a new [T, I] of its dtype."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [tokens, 2 * intermediate], not {tuple(gate_up.shape)}")
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows and inter:
        block = min(BLOCK, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0), inter, BLOCK=block)
    return out
