"""The Python side of latent_attention.c: decode rows of multi-head latent attention over the latent paged cache,
the blocks read in place by one C call per layer and step (petrel/model/mla.py's decode path).

latent_decode_attention() returns None where the kernel does not apply (not CPU float32 queries, a cache of another
dtype or layout, shapes it does not take, no kernels here, PETREL_MLA_KERNEL=0); mla.py's torch path then computes
the same sums."""

from __future__ import annotations

import os

import torch

from petrel.model import dense_kernels

MAX_BLOCK_SIZE = 256


def enabled() -> bool:
    """Whether the kernel may run: PETREL_MLA_KERNEL is not 0 (a switch for comparisons and tests)."""
    return os.environ.get("PETREL_MLA_KERNEL", "1") != "0"


def latent_decode_attention(
    query: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    rank: int,
    scale: float,
) -> torch.Tensor | None:
    """query [S, heads, W] (absorbed: W = rank + rope); cache [blocks, block_size, 1, W]; block_tables [S, width]
    int64; context_lens [S] int64. Returns [S, heads, rank] (each head's softmax-weighted sum of its rows' latents),
    or None."""
    rows, heads, width = query.shape
    block_size = cache.shape[1]
    if (
        not enabled()
        or heads % 2
        or width % 8
        or rank % 32
        or cache.shape[2:] != (1, width)
        or block_size > MAX_BLOCK_SIZE
        or block_tables.dtype != torch.int64
        or context_lens.dtype != torch.int64
        or not dense_kernels._is_cpu_f32(query)
        or (kv_bf16 := dense_kernels._kv_bf16(cache)) is None
        or (lib := dense_kernels.library()) is None
    ):
        return None
    query = query.contiguous()
    block_tables, context_lens = block_tables.contiguous(), context_lens.contiguous()
    out = torch.empty(rows, heads, rank, dtype=torch.float32)
    if lib.paged_latent_decode_attention(
        query.data_ptr(),
        heads * width,
        cache.data_ptr(),
        kv_bf16,
        block_tables.data_ptr(),
        block_tables.shape[1],
        context_lens.data_ptr(),
        rows,
        heads,
        width,
        rank,
        block_size,
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    ):
        raise MemoryError("paged_latent_decode_attention: no memory for its scratch")
    return out
