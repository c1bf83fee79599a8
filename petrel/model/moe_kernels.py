"""The Python side of the experts' kernel (moe.c): a mixture-of-experts layer's experts as one call for a step's
rows, its threads split over (expert, column block) units so that a decode step reads each used expert's weights
once and no unused expert's.

experts() returns None where the kernel does not apply (not CPU float32 rows, a weight the kernels cannot take, no
kernels here, PETREL_MOE_KERNEL=0); petrel/model/moe.py's torch loop then computes the same sums."""

from __future__ import annotations

import ctypes
import os
import sys

import torch

from petrel.model import dense_kernels, gemm_kernels, native, quant_kernels
from petrel.model.gemm_kernels import GEMV_MAX_ROWS
from petrel.model.quantization import GEMM_MAX_ROWS as QUANT_GEMM_MAX_ROWS
from petrel.model.quantization import QuantizedWeight


def enabled() -> bool:
    """Whether the kernel may run: PETREL_MOE_KERNEL is not 0 (a switch for comparisons and tests)."""
    return os.environ.get("PETREL_MOE_KERNEL", "1") != "0"


def max_rows(weights) -> int:
    """The most tokens one call takes: any number where each expert product runs one kernel at every count of rows
    (weights in panels, or integer products from a few rows on), else the few-row kernels' limit (quantized ones':
    dequantized tiles above a few rows), as dense_kernels.LayerParts.max_rows."""
    if all(isinstance(w, QuantizedWeight) and (w.panels or w.integer_rows) for w in weights):
        return sys.maxsize
    quantized = any(isinstance(w, QuantizedWeight) for w in weights)
    return QUANT_GEMM_MAX_ROWS if quantized else GEMV_MAX_ROWS


def activation(module) -> dense_kernels.MoeAct | None:
    """The experts' biases and activation (an Experts module's) as moe.c takes them, or None where it cannot: biases
    not contiguous CPU float32 (the MoeAct points into them: the module keeps them alive)."""
    biases = [b for b in (module.gate_up_bias, module.down_bias) if b is not None]
    if not all(b.is_cpu and b.dtype is torch.float32 and b.is_contiguous() for b in biases):
        return None
    return dense_kernels.MoeAct(
        None if module.gate_up_bias is None else module.gate_up_bias.data_ptr(),
        None if module.down_bias is None else module.down_bias.data_ptr(),
        int(module.activation == "swiglu_clamped"),
        module.alpha,
        module.limit,
    )


class Described:
    """A layer's local experts described for the kernel (dense_kernels.Weight arrays), built once and kept with
    the module while its weights and the CPU switches they depend on stay the same."""

    def __init__(self, module):
        pairs = [module.expert_weights(e) for e in range(module.num_local)]
        gate_up = [dense_kernels.describe(g) for g, _ in pairs]
        down = [dense_kernels.describe(d) for _, d in pairs]
        self.ok = None not in gate_up and None not in down
        n = module.num_local
        self.gate_up = (dense_kernels.Weight * n)(*gate_up) if self.ok else None
        self.down = (dense_kernels.Weight * n)(*down) if self.ok else None
        self.max_rows = max_rows([w for pair in pairs for w in pair]) if pairs else 0
        self.keep = pairs  # the tensors the pointers above point into

    @staticmethod
    def key(module) -> tuple:
        held = module.held
        weights = id(held) if held is not None else (module.gate_up_proj.data_ptr(), module.down_proj.data_ptr())
        return (
            weights,
            gemm_kernels.f32_panels_isa(),
            gemm_kernels.bf16_panels(),
            gemm_kernels.bf16_pairs_rows(),
            quant_kernels.int8_compute(),
            native.cpu_has_avx512(),
        )


def experts(module, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
    """The layer's experts (an Experts module) over x [T, H] as one kernel call: out [T, H] float32, each token's
    sum over its picks on this rank's experts of weight * expert(x); ids, weights [T, k] (the router's). None where
    the kernel cannot run."""
    num_tokens, hidden = x.shape
    inter = module.local_intermediate
    if (
        not enabled()
        or (act := activation(module)) is None
        or x.dtype is not torch.float32
        or not x.is_cpu
        or hidden % 16
        or inter % 16
        or module.num_local == 0
        or (lib := dense_kernels.library()) is None
    ):
        return None
    cached = module.__dict__.get("_described")
    key = Described.key(module)
    if cached is None or cached[0] != key:
        cached = module.__dict__["_described"] = (key, Described(module))
    described = cached[1]
    if not described.ok or num_tokens > described.max_rows:
        return None
    x = x.contiguous()
    ids = ids.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    out = torch.empty(num_tokens, hidden, dtype=torch.float32)
    if lib.moe_experts(
        x.data_ptr(),
        num_tokens,
        hidden,
        inter,
        ids.shape[1],
        ids.data_ptr(),
        weights.data_ptr(),
        module.first,
        module.num_local,
        described.gate_up,
        described.down,
        ctypes.byref(act),
        out.data_ptr(),
        torch.get_num_threads(),
    ):
        raise native.out_of_memory("moe_experts")
    return out
