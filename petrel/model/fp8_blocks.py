"""FP8 block-quantized checkpoints (DeepSeek-V3 / R1's published weights, `quantization_config` quant_method "fp8"):
each quantized `X.weight` is float8_e4m3 [out, in] beside `X.weight_scale_inv` [ceil(out / b), ceil(in / b)] float32,
one scale per b x b block (b = 128 in the published files); the value is weight * scale of its block. They are
dequantized to float32 as the checkpoint is read (a weight and its scale may come in either order, from different
shards), so the model holds them as it holds any float checkpoint (bfloat16 or int8 with the engine's options)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

SCALE_SUFFIX = "_scale_inv"


def _block(n: int, scales: int) -> int:
    """The block edge: the smallest power of two b with ceil(n / b) == scales (unique where it matters: when
    n > b, doubling b changes the count)."""
    b = 1
    while -(-n // b) > scales:
        b *= 2
    if -(-n // b) != scales:
        raise ValueError(f"{scales} scales do not cover {n} rows or columns in power-of-two blocks")
    return b


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """float32 [out, in] of an FP8 weight and its per-block scales."""
    if weight.dim() != 2 or scale_inv.dim() != 2:
        raise ValueError(f"{name}: FP8 weight {list(weight.shape)} and scales {list(scale_inv.shape)} must be 2-D")
    rows, cols = weight.shape
    try:
        br, bc = _block(rows, scale_inv.shape[0]), _block(cols, scale_inv.shape[1])
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    scales = scale_inv.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return weight.float() * scales


def dequantize_fp8_blocks(weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
    """The checkpoint's tensors with every float8 weight replaced by its float32 value (its scale consumed); other
    tensors pass as they are. ValueError for a float8 weight without its scale, or a scale without its weight."""
    waiting_weights: dict[str, torch.Tensor] = {}
    waiting_scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(SCALE_SUFFIX):
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"weight {name!r}: a block scale must be a tensor, got {type(tensor).__name__}")
            base = name.removesuffix(SCALE_SUFFIX)
            if base in waiting_weights:
                yield base, dequantize(waiting_weights.pop(base), tensor, base)
            else:
                waiting_scales[base] = tensor
            continue
        if isinstance(tensor, torch.Tensor) and tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            if name in waiting_scales:
                yield name, dequantize(tensor, waiting_scales.pop(name), name)
            else:
                waiting_weights[name] = tensor
            continue
        yield name, tensor
    if waiting_weights:
        raise ValueError(f"FP8 weight {sorted(waiting_weights)[0]!r} has no {SCALE_SUFFIX} beside it")
    if waiting_scales:
        raise ValueError(f"FP8 scale {sorted(waiting_scales)[0] + SCALE_SUFFIX!r} has no weight beside it")
