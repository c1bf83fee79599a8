"""The Python side of the experts' kernel (moe.c): one call per MoE layer for a step's rows."""

from __future__ import annotations

import torch


def experts(module, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
    """The layer's experts over x as one kernel call, or None where the kernel cannot run (the caller's torch
    loop then)."""
    return None
