"""Fused elementwise Triton kernels for the CUDA step: residual add + RMS norm (norm.py), SiLU-and-multiply
(activation.py) and rotate-half rotary embedding in place (rotary.py), each one pass over its rows where PyTorch
runs several kernels and round-trips through memory between them.

layers.py hands these ops to the kernels on the devices triton_attention serves (CUDA; PETREL_TRITON=0 turns both
off; tests add "cpu" to run them in Triton's interpreter). Like triton_attention, importing this package does not
import Triton: each function loads its module on first use.
"""

from __future__ import annotations

import torch

from petrel.model import triton_attention

_HOMES = {"rms_norm": "norm", "silu_and_mul": "activation", "rotary_": "rotary"}


def serves(device: torch.device) -> bool:
    """Whether layers.py should hand an op on `device` to these kernels: the same switch as paged attention's."""
    return triton_attention.serves(device)


__getattr__ = triton_attention.lazy_functions(__name__, _HOMES)
