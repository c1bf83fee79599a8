"""Prompt-sized products on Intel's AMX tiles (Xeons from Sapphire Rapids on) through oneDNN, as torch ships it.

Why oneDNN and not petrel's own tile kernels (_tile_dpbf16ps, _tile_dpbssd): none of the machines petrel is developed
on has AMX, so tile code could not be tested there, and oneDNN is what the other CPU engines' AMX rates come from
(vLLM's and SGLang's CPU backends, torch's bfloat16 F.linear). oneDNN picks its tile kernels where the CPU has them,
asks Linux for the tile state itself (arch_prctl(ARCH_REQ_XCOMP_PERM)) and runs its AVX-512 kernels elsewhere.

What goes there, from min_rows() rows of x (AMX_MIN_ROWS: prompt steps); fewer rows (decode, memory-bound) keep
petrel's kernels. Each weight is packed once, at load (pack_model), into oneDNN's blocked layout (Tiles, beside the
weight petrel's kernels read: that much more memory), so no call reorders it:
  bfloat16 weights (quantization 'bf16', what dtype 'bfloat16' is on the CPU), where their products round x to
    bfloat16 (PETREL_BF16_ACTIVATIONS is not 0): x rounded to bfloat16, the sums float32 (mkldnn._linear_pointwise).
    Unlike petrel's kernels, the output is rounded to bfloat16 too (one more rounding, 2^-9 of each output at most):
    torch 2.13 has no CPU op of bfloat16 inputs and float32 output (mm / addmm / bmm with out_dtype are CUDA's;
    oneDNN refuses float32 x with bfloat16 weights), and float32 tensors with torch.backends.mkldnn.matmul.
    fp32_precision = 'bf16', whose output is float32, would keep the weights in float32 (twice the memory) and
    convert them every call, and oneDNN honours that mode on AMX CPUs only.
  float32 weights with EngineConfig.float32_matmul_precision 'medium' (torch's name for bfloat16 products of float32
    tensors): the same, the weights rounded to bfloat16 at load.
int8 weights (quantization 'int8', GGUF's blocks) stay on petrel's integer kernels: torch 2.13's oneDNN int8
product (onednn.qlinear_pointwise, weights from qlinear_prepack) takes one activation scale a call, so x rounded to
int8 a row at best (each row divided by its own scale before, multiplied back after), and on the default model that
drifts past the int8 test's bounds (16 prompts x 32 greedy tokens against the dequantized float products: top-1
agreement 485/512, the top token's logprob change mean 0.089, largest 1.55; petrel's 8-bit activations a group of
32: 501/512, 0.029, 0.23); on AVX-512 CPUs without AMX its signed int8 activations also fall to oneDNN's reference
kernel (5 s a 102 x 576 x 1536 product, Zen 4).
The LM head and the embedding are not packed: a step's logits are one row a sequence.

Switches, read when a model loads: PETREL_AMX=0 turns all of it off; PETREL_AMX=force runs it on any CPU where torch's
oneDNN runs bfloat16 products (a test and diagnostic knob: oneDNN's AVX-512 bfloat16 kernels, slower than petrel's
panels there); PETREL_AMX_MIN_ROWS sets the row threshold (for measuring it).
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from petrel.model import native
from petrel.model.quantization import QuantizedLinear, QuantizedWeight, unpack_panels

logger = logging.getLogger("petrel")

# From this many rows of x a product goes to oneDNN (and a step out of the one-call decoder stack: dense_kernels.
# LayerParts.max_rows). NOT MEASURED ON AN AMX CPU (none at hand): products measured on 2 cores of a Sapphire Rapids
# class Xeon had torch's oneDNN bfloat16 ahead of petrel's panels from 16 rows (2.2x there, 4.6x at 64). To set it:
# on an AMX machine run benchmarks/amx_products.py (the row count where the oneDNN column passes the panels column
# at every shape), then `petrel bench` W1 and W2 in bfloat16 with PETREL_AMX_MIN_ROWS at that count and twice it
# (whole steps: a step that leaves the one-call stack pays Python and a dispatch per operation).
AMX_MIN_ROWS = 32
PACK_BATCH_HINT = 512  # the rows oneDNN lays the weights out for (prompt chunks run hundreds); other counts read the
# same layout with no reorder a call (ONEDNN_VERBOSE=1 lists none, Zen 4; check it on an AMX CPU)

MODES = ("0", "1", "force")
PRECISIONS = ("highest", "medium")  # EngineConfig.float32_matmul_precision


def mode() -> str:
    """PETREL_AMX: '0' off, 'force' on any CPU oneDNN runs on, '1' (the default) where the CPU has AMX."""
    value = os.environ.get("PETREL_AMX", "1")
    if value not in MODES:
        raise ValueError(f"PETREL_AMX must be one of {list(MODES)}, got {value!r}")
    return value


def min_rows() -> int:
    """The rows from which products go to oneDNN: PETREL_AMX_MIN_ROWS, else AMX_MIN_ROWS."""
    text = os.environ.get("PETREL_AMX_MIN_ROWS", str(AMX_MIN_ROWS))
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"PETREL_AMX_MIN_ROWS must be a positive integer, got {text!r}")
    return int(text)


def onednn_runs_bf16() -> bool:
    """Whether this torch's oneDNN runs bfloat16 products on this CPU (AVX-512 BW/VL/DQ at least, or AMX)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def bf16_rows() -> int:
    """From how many rows bfloat16 products (bfloat16 weights, or float32 ones at float32_matmul_precision 'medium')
    run through oneDNN: min_rows() where the CPU has AMX's tiles and bfloat16 (or PETREL_AMX=force), 0 (never)
    elsewhere or under PETREL_AMX=0."""
    switch, rows = mode(), min_rows()  # both checked, whatever the CPU
    on = switch == "force" or (switch == "1" and native.cpu_has_amx("bf16"))
    return rows if on and onednn_runs_bf16() else 0


class Tiles:
    """A weight [N, K] rounded to bfloat16 and packed once in oneDNN's layout, and its products from min_rows rows of
    x (QuantizedWeight.matmul calls it): x [M, K] float32 -> x @ W^T [M, N] float32, x rounded to bfloat16, the sums
    float32 and rounded to bfloat16 (see the module docstring)."""

    def __init__(self, packed: torch.Tensor, shape: tuple[int, int], rows: int):
        self.packed, self.shape, self.min_rows = packed, shape, rows

    @classmethod
    def bf16(cls, weight: torch.Tensor, rows: int) -> Tiles:
        """The weight [N, K] (any float dtype: rounded to bfloat16, nearest even) packed for bfloat16 products."""
        codes = weight.detach().to(torch.bfloat16).contiguous()
        packed = torch.ops.mkldnn._reorder_linear_weight(codes, PACK_BATCH_HINT)
        return cls(packed, tuple(codes.shape), rows)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), self.packed, None, "none", [], "")
        return y.float()


def tiles_for(qweight: QuantizedWeight, float32_matmul_precision: str = "highest") -> Tiles | None:
    """The oneDNN copy a projection's weight gets at load, or None where its products stay on petrel's kernels (see
    the module docstring)."""
    if not qweight.codes.is_cpu:
        return None
    if qweight.bits == 16 and os.environ.get("PETREL_BF16_ACTIVATIONS", "1") != "0" and (rows := bf16_rows()):
        codes = unpack_panels(qweight.codes, qweight.shape) if qweight.panels else qweight.codes
        return Tiles.bf16(codes, rows)
    if qweight.bits == 32 and float32_matmul_precision == "medium" and (rows := bf16_rows()):
        return Tiles.bf16(unpack_panels(qweight.codes, qweight.shape), rows)
    return None


def pack_model(model: nn.Module, float32_matmul_precision: str = "highest") -> int:
    """A loaded CPU model's projections (QuantizedLinear modules but the LM head) given their oneDNN copies where
    tiles_for says so; returns how many. Where float32_matmul_precision is 'medium' and no float32 weight got one,
    one WARNING says why (their products then stay float32), where the model has float32 weights."""
    packed = medium = 0
    float32 = False  # whether the model multiplies any float32 weights (float32_matmul_precision's concern)
    for path, module in model.named_modules():
        if isinstance(module, nn.Linear) and path != "lm_head":
            float32 = float32 or module.weight.dtype == torch.float32
        if not isinstance(module, QuantizedLinear) or path == "lm_head":
            continue
        float32 = float32 or module.qweight.bits == 32
        if module.qweight.tiles is None and (tiles := tiles_for(module.qweight, float32_matmul_precision)):
            module.qweight.tiles = tiles
            packed, medium = packed + 1, medium + (module.qweight.bits == 32)
    if float32_matmul_precision == "medium" and float32 and not medium:
        if mode() == "0":
            why = "PETREL_AMX=0"
        elif not bf16_rows():
            why = "this CPU has no AMX (amx_tile, amx_bf16)"
        else:
            why = "the float32 weights are not held in panels (PETREL_F32_PANELS=0, tensor parallelism or no kernels)"
        logger.warning("float32_matmul_precision 'medium': %s, so float32 products stay float32", why)
    if packed:
        logger.info(
            "%d projections packed for oneDNN's products from %d rows (PETREL_AMX=%s)", packed, min_rows(), mode()
        )
    return packed
