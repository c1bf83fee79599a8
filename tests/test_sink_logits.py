"""Sink logits (gpt-oss's: a learned logit per query head that joins each softmax and is dropped from the output) in
every attention path, each against a float64 reference: the C decode kernel (a context whole or split into parts
merged at the end, windows, float32 and bfloat16 caches), the C prefill kernel (AVX2's and AVX-512's inner steps,
PETREL_AVX512=0 forcing AVX2), the PyTorch path, the Triton kernels in Triton's interpreter (one split and several,
prefill chunks after a cached prefix), and the step dispatch of attention.paged_attention, StreamingLLM's attention
sinks (sink_token_length) included, which go with sink logits."""

from __future__ import annotations

import math
import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # read when the Triton kernels are defined: they then run on CPU tensors

from test_dense_kernels import _attention_kv_dtype, _paged_case, _prefill_case, prefill_isa  # noqa: E402, F401

from petrel.model import attention, dense_kernels, triton_attention  # noqa: E402
from petrel.model.attention import AttentionMetadata, DecodeGroup, PrefillChunk  # noqa: E402

pytestmark = pytest.mark.skipif(dense_kernels.library() is None, reason="no kernels here")

KV_KINDS = pytest.mark.parametrize("kv_kind", ["f32-cache", "bf16-cache"])


def sinks_for(heads: int, seed: int) -> torch.Tensor:
    """Sink logits around the scores' size, one far above them (its head attends almost to nothing) and one far
    below (almost no effect)."""
    s = 2.0 * torch.randn(heads, generator=torch.Generator().manual_seed(seed))
    s[0], s[-1] = 30.0, -30.0
    return s


def reference(q, keys, values, q_pos, k_pos, scale, window=None, sinks=None, sink_tokens=0):
    """float64 attention of queries q [n, heads, d] at positions q_pos [n] over keys, values [L, kv_heads, d] at
    k_pos [L]: causal, within `window` (or one of the first sink_tokens positions), each head's sink logit joining
    its softmax and dropped. [n, heads, d]."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    k, v = (t.double().repeat_interleave(heads // kv_heads, dim=1) for t in (keys, values))
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= (k_pos[None, :] > q_pos[:, None] - window) | (k_pos[None, :] < sink_tokens)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        column = sinks.double().view(-1, 1, 1).expand(heads, q.shape[0], 1)
        weights = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
    else:
        weights = scores.softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


def decode_reference(q, cache, tables, lens, scale, window=None, sinks=None):
    kv_heads, head_dim = cache.shape[3], cache.shape[4]
    rows = []
    for s, n in enumerate(lens.tolist()):
        k, v = (cache[i][tables[s]].reshape(-1, kv_heads, head_dim)[:n] for i in (0, 1))
        rows.append(reference(q[s : s + 1], k, v, torch.tensor([n - 1]), torch.arange(n), scale, window, sinks))
    return torch.cat(rows)


# ---------------------------------------------------------------- the C kernels


@pytest.mark.parametrize("isa", ["default", "avx2"])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,window,lens",
    [
        (4, 2, 64, 16, None, [1, 5, 17, 70, 133] * 4),  # many sequences: a context a work item
        (8, 1, 64, 4, 12, [3, 30, 9]),  # gpt-oss's heads per KV head, a sliding layer's window
        (4, 2, 32, 16, None, [1100, 3]),  # few long contexts: split into parts, merged with the sinks
        (6, 2, 32, 8, 500, [2000]),  # ... the parts within a window
    ],
)
@KV_KINDS
def test_c_decode_kernel_equals_float64_reference(
    heads, kv_heads, head_dim, block_size, window, lens, kv_kind, isa, monkeypatch
):
    if isa == "avx2":
        monkeypatch.setenv("PETREL_AVX512", "0")
    kv_dtype, _ = _attention_kv_dtype(kv_kind, monkeypatch)
    q, cache, tables, lens_t = _paged_case(len(lens), heads, kv_heads, head_dim, block_size, lens, 7, kv_dtype)
    sinks, scale = sinks_for(heads, 1), head_dim**-0.5
    got = dense_kernels.decode_attention(q, cache[0], cache[1], tables, lens_t, scale, window, sinks)
    assert got is not None
    expected = decode_reference(q, cache.float(), tables, lens_t, scale, window, sinks)
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=1e-4)
    plain = dense_kernels.decode_attention(q, cache[0], cache[1], tables, lens_t, scale, window)
    assert (plain - got).abs().max() > 0.1  # the sinks change the result


@pytest.mark.parametrize(
    "n,first_pos,heads,kv_heads,head_dim,block_size,window",
    [
        (40, 0, 8, 2, 64, 16, None),  # a whole prompt
        (37, 100, 4, 2, 64, 16, None),  # a chunk after a cached prefix
        (1, 50, 4, 1, 64, 16, 12),  # one token, a window
        (300, 700, 8, 2, 64, 16, 128),  # gpt-oss's window, key blocks wholly behind some groups' windows
    ],
)
@KV_KINDS
def test_c_prefill_kernel_equals_float64_reference(
    n,
    first_pos,
    heads,
    kv_heads,
    head_dim,
    block_size,
    window,
    kv_kind,
    prefill_isa,
    monkeypatch,  # noqa: F811
):
    kv_dtype, _ = _attention_kv_dtype(kv_kind, monkeypatch)
    q, cache, table = _prefill_case(n, first_pos, heads, kv_heads, head_dim, block_size, n + head_dim, kv_dtype)
    sinks, scale = sinks_for(heads, 2), head_dim**-0.5
    got = dense_kernels.prefill_attention(q, cache[0], cache[1], table, first_pos, scale, window, sinks)
    assert got is not None
    ctx = first_pos + n
    k, v = (cache[i].float()[table].reshape(-1, kv_heads, head_dim)[:ctx] for i in (0, 1))
    q_pos = torch.arange(first_pos, ctx)
    expected = reference(q, k, v, q_pos, torch.arange(ctx), scale, window, sinks)
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=1e-4)


def test_c_kernels_decline_malformed_sink_logits():
    q, cache, tables, lens_t = _paged_case(2, 4, 2, 32, 4, [5, 9], seed=4)
    for bad in (torch.zeros(3), torch.zeros(4, dtype=torch.float64), torch.zeros(8)[::2]):
        assert dense_kernels.decode_attention(q, cache[0], cache[1], tables, lens_t, 1.0, None, bad) is None
        assert dense_kernels.prefill_attention(q, cache[0], cache[1], tables[0], 3, 1.0, None, bad) is None


# ---------------------------------------------------------------- the PyTorch path and the step dispatch


def _step(lens_decode, chunks, heads, kv_heads, head_dim, block_size, seed):
    """A step's metadata, queries, fresh keys and values, and a cache: decode rows of the given context lengths, then
    prompt chunks (first_pos, n), every sequence's blocks scattered through the cache, the old positions filled."""
    g = torch.Generator().manual_seed(seed)
    lengths = list(lens_decode) + [p + n for p, n in chunks]
    width = max(math.ceil(n / block_size) for n in lengths) + 1
    num_blocks = len(lengths) * width + 2
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g)
    order = torch.randperm(num_blocks, generator=g)
    tables = order[: len(lengths) * width].view(len(lengths), width).clone()
    new_pos = [n - 1 for n in lens_decode] + [p for p, n in chunks for p in range(p, p + n)]
    owners = list(range(len(lens_decode))) + [len(lens_decode) + i for i, (_, n) in enumerate(chunks) for _ in range(n)]
    slots = torch.tensor(
        [int(tables[s, p // block_size]) * block_size + p % block_size for s, p in zip(owners, new_pos)]
    )
    rows = len(new_pos)
    q = torch.randn(rows, heads, head_dim, generator=g)
    k, v = torch.randn(rows, kv_heads, head_dim, generator=g), torch.randn(rows, kv_heads, head_dim, generator=g)
    meta = AttentionMetadata(slot_mapping=slots)
    if lens_decode:
        d = len(lens_decode)
        span = torch.arange(width * block_size).unsqueeze(0)
        lens_t = torch.tensor(lens_decode)
        meta.decode_groups.append(DecodeGroup(0, d, tables[:d], span < lens_t.unsqueeze(1), list(lens_decode), lens_t))
    row = len(lens_decode)
    for i, (p, n) in enumerate(chunks):
        table = tables[len(lens_decode) + i]
        mask = None if p == 0 else torch.arange(p + n).unsqueeze(0) <= torch.arange(p, p + n).unsqueeze(1)
        meta.prefills.append(PrefillChunk(row, n, p + n, table, mask))
        row += n
    return meta, q, k, v, cache, tables, lengths, owners, new_pos


def _step_reference(q, k, v, cache, tables, lengths, owners, new_pos, scale, window, sinks, sink_tokens=0):
    block_size, kv_heads, head_dim = cache.shape[2], cache.shape[3], cache.shape[4]
    full = cache.clone()
    for r, (s, p) in enumerate(zip(owners, new_pos)):
        full[0, tables[s, p // block_size], p % block_size] = k[r]
        full[1, tables[s, p // block_size], p % block_size] = v[r]
    out = torch.empty(q.shape, dtype=torch.float64)
    for r, (s, p) in enumerate(zip(owners, new_pos)):
        keys, values = (full[i][tables[s]].reshape(-1, kv_heads, head_dim)[: lengths[s]] for i in (0, 1))
        q_pos, k_pos = torch.tensor([p]), torch.arange(lengths[s])
        out[r] = reference(q[r : r + 1], keys, values, q_pos, k_pos, scale, window, sinks, sink_tokens)[0]
    return out


@pytest.mark.parametrize("path", ["kernels", "torch"])
@pytest.mark.parametrize("window,sink_tokens", [(None, 0), (12, 0), (9, 3)], ids=["full", "window", "streaming"])
def test_paged_attention_with_sink_logits_equals_float64_reference(path, window, sink_tokens, monkeypatch):
    """A step of decodes and prompt chunks (one whole, one after a cached prefix) through attention.paged_attention:
    the C kernels, or the PyTorch path (the kernels switched off); with a sliding window; and with StreamingLLM's
    attention sinks beside the window (the first 3 positions always seen), which run the PyTorch path."""
    if path == "torch":
        monkeypatch.setattr(dense_kernels, "library", lambda: None)
    heads, kv_heads, head_dim, block_size = 8, 2, 32, 4
    meta, q, k, v, cache, tables, lengths, owners, new_pos = _step(
        [5, 40, 17], [(0, 23), (26, 9)], heads, kv_heads, head_dim, block_size, seed=5
    )
    sinks, scale = sinks_for(heads, 3), head_dim**-0.5
    expected = _step_reference(q, k, v, cache, tables, lengths, owners, new_pos, scale, window, sinks, sink_tokens)
    got = attention.paged_attention(q, k, v, cache, meta, scale, window, sink_tokens, sinks)
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=1e-4)


# ---------------------------------------------------------------- Triton, in its interpreter


@pytest.fixture
def interpreted():
    pytest.importorskip("triton")


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window", [None, 12])
def test_triton_decode_equals_float64_reference(splits, window, interpreted):
    heads, kv_heads, head_dim, block_size, lens = 8, 2, 32, 16, [1, 40, 200, 333]
    q, cache, tables, lens_t = _paged_case(len(lens), heads, kv_heads, head_dim, block_size, lens, seed=9)
    sinks, scale = sinks_for(heads, 4), head_dim**-0.5
    got = triton_attention.paged_decode_attention(
        q, cache[0], cache[1], tables, lens_t, scale, window, num_splits=splits, sink_logits=sinks
    )
    expected = decode_reference(q, cache, tables, lens_t, scale, window, sinks)
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 12])
def test_triton_prefill_and_dispatch_equal_float64_reference(window, interpreted, monkeypatch):
    """Two chunks in one varlen call (one after a cached prefix), and a whole step handed to the kernels as on
    CUDA (attention.paged_attention with the CPU among the Triton devices)."""
    heads, kv_heads, head_dim, block_size = 8, 2, 32, 4
    meta, q, k, v, cache, tables, lengths, owners, new_pos = _step(
        [5, 40], [(0, 23), (26, 9)], heads, kv_heads, head_dim, block_size, seed=6
    )
    sinks, scale = sinks_for(heads, 5), head_dim**-0.5
    expected = _step_reference(q, k, v, cache, tables, lengths, owners, new_pos, scale, window, sinks)
    monkeypatch.setattr(triton_attention, "DEVICE_TYPES", ("cpu",))
    got = attention.paged_attention(q, k, v, cache.clone(), meta, scale, window, 0, sinks)
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-4)
