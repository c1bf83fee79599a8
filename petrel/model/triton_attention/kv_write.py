"""write_kv: this step's keys and values scattered into their cache slots, one program per token.

A slot is block * block_size + offset; a negative slot (a padding row) is skipped."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from petrel.model.triton_attention.checks import check_cache, check_index


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    block_size,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    i = tl.arange(0, BLOCK)
    head, dim = i // HEAD_DIM, i % HEAD_DIM
    mask = i < tl.where(slot >= 0, KV_HEADS * HEAD_DIM, 0)  # a negative slot: nothing to write
    dst = (slot // block_size) * stride_cache_block + (slot % block_size) * stride_cache_slot
    dst += head * stride_cache_head + dim
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + dim, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + dim, mask=mask)
    tl.store(key_cache_ptr + dst, k, mask=mask)
    tl.store(value_cache_ptr + dst, v, mask=mask)


def write_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v [tokens, kv_heads, head_dim] into the caches [num_blocks, block_size, kv_heads, head_dim] at
    slot_mapping [tokens] (int32 or int64), in place; tokens whose slot is negative are skipped."""
    check_cache(key_cache, value_cache)
    if k.shape != v.shape or k.shape[1:] != key_cache.shape[2:]:
        raise ValueError(f"k and v {tuple(k.shape)}, {tuple(v.shape)} do not fit the cache {tuple(key_cache.shape)}")
    if {k.dtype, v.dtype} != {key_cache.dtype} or {k.device, v.device} != {key_cache.device}:
        raise ValueError(f"k and v must be {key_cache.dtype} on {key_cache.device} like the cache")
    check_index(slot_mapping, "slot_mapping", (k.shape[0],), key_cache.device)
    k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
    if k.shape[0] == 0:
        return
    _, block_size, kv_heads, head_dim = key_cache.shape
    _write_kv_kernel[(k.shape[0],)](
        k,
        v,
        key_cache,
        value_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_size,
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK=triton.next_power_of_2(kv_heads * head_dim),
    )
