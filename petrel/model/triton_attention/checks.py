"""Argument checks shared by the Triton attention kernels: a wrong shape, dtype or device is a clear ValueError
here rather than a wrong read inside a kernel."""

from __future__ import annotations

import torch

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Key and value caches: [num_blocks, block_size, kv_heads, head_dim] alike, head_dim contiguous."""
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key and value caches must both be [num_blocks, block_size, kv_heads, head_dim], "
            f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if key_cache.dtype not in DTYPES or value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"caches must be float16, bfloat16 or float32 alike, got {key_cache.dtype}, {value_cache.dtype}"
        )
    if key_cache.stride() != value_cache.stride() or key_cache.stride(-1) != 1:
        raise ValueError("key and value caches must have the same strides, head_dim contiguous")


def check_queries(q: torch.Tensor, key_cache: torch.Tensor, what: str) -> None:
    """Queries [rows, heads, head_dim] matching the cache: same dtype, device and head_dim, heads a multiple of
    kv_heads."""
    if q.dim() != 3:
        raise ValueError(f"q must be {what}, got shape {tuple(q.shape)}")
    kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    if q.shape[2] != head_dim or q.shape[1] % kv_heads:
        raise ValueError(f"q's heads x head_dim {tuple(q.shape[1:])} do not fit {kv_heads} KV heads of {head_dim}")
    if q.dtype != key_cache.dtype or q.device != key_cache.device:
        raise ValueError(f"q is {q.dtype} on {q.device}, the cache {key_cache.dtype} on {key_cache.device}")


def check_index(tensor: torch.Tensor, name: str, shape: tuple[int | None, ...], device: torch.device) -> None:
    """An int32 / int64 index tensor of the given shape (None: any size) on the given device."""
    fits = tensor.dim() == len(shape) and all(want in (None, got) for want, got in zip(shape, tensor.shape))
    if tensor.dtype not in (torch.int32, torch.int64) or not fits or tensor.device != device:
        raise ValueError(
            f"{name} must be int32 or int64 of shape {shape} on {device}, "
            f"got {tensor.dtype} of shape {tuple(tensor.shape)} on {tensor.device}"
        )
