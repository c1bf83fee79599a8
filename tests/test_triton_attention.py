"""petrel's Triton paged-attention kernels (petrel/model/triton_attention) in Triton's interpreter on the CPU.

Each kernel is checked against a float64 softmax over the K/V gathered plainly from the block table: decode with
GQA and MHA, head dims 64 / 128 / 40, block sizes 4 / 16 / 32, sliding windows, ragged context lengths with a
padding row of length 0, several splits of a context reduced together; prefill with several chunks in one call,
chunks after a cached prefix, windows reaching behind a chunk; float16 inputs (float32 accumulation); and KV
writes, in float32 and bfloat16, that skip negative slots. Blocks behind the window and slots past the context
are filled with NaN where a test shows they are never read. The step dispatch (attention.paged_attention handing
a step to the kernels, as on CUDA) must give what the PyTorch path gives for metadata built by the model runner.
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are defined: they then run on CPU tensors
pytest.importorskip("triton")

from petrel.engine.model_runner import ModelRunner, QuerySpan  # noqa: E402
from petrel.model import attention, triton_attention  # noqa: E402
from petrel.model.triton_attention import paged_decode_attention, paged_prefill_attention, write_kv  # noqa: E402

# bfloat16 attention is not checked here: Triton 3.9's interpreter keeps bfloat16 as its uint16 bits and tl.dot
# multiplies those as integers (its casts, loads and stores handle them: write_kv is checked in bfloat16).
TOLERANCES = {  # atol, rtol: float32 against the float64 reference; 16-bit inputs round q, k, v, p and the output
    torch.float32: (1e-4, 1e-4),
    torch.float16: (4e-3, 1e-2),
}


def reference(q, key_cache, value_cache, table, first_pos, scale, window=None):
    """Attention of the n queries q [n, heads, d] at positions first_pos .. first_pos+n-1 over the keys and values
    the block table holds, causal and windowed, in float64 (as [n, heads, d])."""
    n, heads, head_dim = q.shape
    kv_heads, length = key_cache.shape[2], first_pos + n
    if length == 0:
        return torch.zeros(n, heads, head_dim, dtype=torch.float64)
    k, v = (c[table].reshape(-1, kv_heads, head_dim)[:length].double() for c in (key_cache, value_cache))
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos, k_pos = torch.arange(first_pos, length).unsqueeze(1), torch.arange(length).unsqueeze(0)
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)


def decode_reference(q, cache, tables, lengths, scale, window=None):
    """Each row's one query, at position length - 1, against its context."""
    rows = [reference(q[r : r + 1], cache[0], cache[1], tables[r], n - 1, scale, window) for r, n in enumerate(lengths)]
    return torch.cat(rows)


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def paged_cache(lengths, kv_heads, head_dim, block_size, dtype, seed):
    """A cache [2, blocks, block_size, kv_heads, head_dim] of random values and a block table per sequence, its
    blocks scattered through the cache, padded with block 0 to one column past the longest."""
    g = torch.Generator().manual_seed(seed)
    needed = [math.ceil(n / block_size) for n in lengths]
    num_blocks = sum(needed) + 3
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(lengths), max(needed) + 1, dtype=torch.int64)
    for row, n in enumerate(needed):
        tables[row, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int64)
    return cache, tables


DECODE_CASES = [  # heads, kv_heads, head_dim, block_size, window, splits
    (4, 2, 64, 16, None, None),  # GQA
    (4, 1, 128, 32, None, None),
    (4, 2, 64, 16, 20, None),  # a window shorter than most contexts
    (4, 1, 64, 32, None, 3),  # split-K: three parts of each context, reduced
    (4, 2, 64, 16, 40, 2),  # ... of the window
    (2, 2, 40, 4, 7, None),  # MHA, head_dim not a power of two, small blocks
]


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,window,splits,dtype",
    [(*case, torch.float32) for case in DECODE_CASES] + [(*case, torch.float16) for case in DECODE_CASES[:4]],
    ids=str,
)
def test_decode_equals_float64_reference(heads, kv_heads, head_dim, block_size, window, splits, dtype):
    lengths = [0, 1, 5, block_size, block_size + 1, 3 * block_size - 1, 70, 133]  # 0: a padding row
    cache, tables = paged_cache(lengths, kv_heads, head_dim, block_size, dtype, seed=heads + head_dim)
    q = randn(len(lengths), heads + kv_heads, head_dim, seed=head_dim).to(dtype)[:, :heads]  # a slice, as given
    lens = torch.tensor(lengths, dtype=torch.int32)
    scale = head_dim**-0.5
    got = paged_decode_attention(q, cache[0], cache[1], tables.int(), lens, scale, window, splits)
    assert got.dtype == dtype and got.shape == q.shape
    expected = decode_reference(q, cache, tables, lengths, scale, window)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.double(), expected, atol=atol, rtol=rtol)
    assert not got[0].any()


def test_decode_splits_a_long_context_by_default():
    lengths = [600, 0, 300]  # few sequences, the longest holding several splits' worth of keys
    cache, tables = paged_cache(lengths, 1, 64, 32, torch.float32, seed=1)
    q = randn(3, 2, 64, seed=2)
    got = paged_decode_attention(q, cache[0], cache[1], tables, torch.tensor(lengths), 0.125)
    expected = decode_reference(q, cache, tables, lengths, 0.125)
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_never_reads_behind_the_window_or_past_the_context(splits):
    """Blocks wholly behind the window (given back, read through block 0 or anything) and the table's padding
    must not matter: filling them with NaN leaves the result unchanged."""
    block_size, window, lengths = 4, 8, [30, 9, 17]
    cache, tables = paged_cache(lengths, 2, 32, block_size, torch.float32, seed=3)
    q, lens = randn(3, 4, 32, seed=3), torch.tensor(lengths)
    held = [math.ceil(n / block_size) for n in lengths]
    spare = next(b for b in range(cache.shape[1]) if b not in tables.flatten().tolist())
    unseen = [spare]
    for row, n in enumerate(lengths):
        tables[row, held[row] :] = spare  # the table's padding
        unseen += tables[row, : (n - window) // block_size].tolist()
    clean = paged_decode_attention(q, cache[0], cache[1], tables, lens, 0.2, window, splits)
    for row, n in enumerate(lengths):
        if n % block_size:  # the last block's slots past the context
            cache[:, tables[row, n // block_size], n % block_size :] = float("nan")
    cache[:, unseen] = float("nan")
    got = paged_decode_attention(q, cache[0], cache[1], tables, lens, 0.2, window, splits)
    assert len(set(unseen)) > 4 and not got.isnan().any()
    torch.testing.assert_close(got, clean)


CHUNKS = [(20, 0), (7, 33), (1, 50), (70, 10)]  # (queries, cached prefix): a whole prompt, chunks after a prefix


def prefill_case(chunks, heads, kv_heads, head_dim, block_size, dtype, seed):
    """Queries of several chunks back to back and a cache whose blocks hold each chunk's context."""
    cache, tables = paged_cache([p + n for n, p in chunks], kv_heads, head_dim, block_size, dtype, seed)
    tokens = sum(n for n, _ in chunks)
    q = randn(tokens, heads + kv_heads, head_dim, seed=seed).to(dtype)[:, :heads]
    starts = torch.tensor([0, *itertools.accumulate(n for n, _ in chunks)])
    lens = torch.tensor([p + n for n, p in chunks])
    return q, cache, tables, starts, lens


def prefill_reference(q, cache, tables, chunks, scale, window):
    rows, parts = 0, []
    for s, (n, prefix) in enumerate(chunks):
        parts.append(reference(q[rows : rows + n], cache[0], cache[1], tables[s], prefix, scale, window))
        rows += n
    return torch.cat(parts)


PREFILL_CASES = [  # heads, kv_heads, head_dim, block_size, window
    (4, 2, 64, 16, None),  # GQA
    (4, 1, 128, 32, None),
    (4, 2, 64, 16, 20),  # windows reaching behind a chunk, and inside one prompt
    (2, 2, 40, 4, 7),  # MHA, head_dim not a power of two, small blocks
]


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,window,dtype",
    [(*case, torch.float32) for case in PREFILL_CASES] + [(*case, torch.float16) for case in PREFILL_CASES[::2]],
    ids=str,
)
def test_prefill_equals_float64_reference(heads, kv_heads, head_dim, block_size, window, dtype):
    q, cache, tables, starts, lens = prefill_case(CHUNKS, heads, kv_heads, head_dim, block_size, dtype, seed=head_dim)
    scale = head_dim**-0.5
    got = paged_prefill_attention(q, cache[0], cache[1], tables, starts, lens, scale, window)
    assert got.dtype == dtype and got.shape == q.shape
    atol, rtol = TOLERANCES[dtype]
    expected = prefill_reference(q, cache, tables, CHUNKS, scale, window)
    torch.testing.assert_close(got.double(), expected, atol=atol, rtol=rtol)


def test_prefill_never_reads_behind_the_window_or_past_the_context():
    chunks, block_size, window = [(10, 27), (12, 0)], 4, 8
    q, cache, tables, starts, lens = prefill_case(chunks, 4, 2, 32, block_size, torch.float32, seed=7)
    clean = paged_prefill_attention(q, cache[0], cache[1], tables, starts.int(), lens.int(), 0.2, window)
    behind = tables[0, : (27 - window + 1) // block_size].tolist()  # wholly behind the first query's window
    used = set(tables[:, :-1].flatten().tolist())
    cache[:, [b for b in range(cache.shape[1]) if b not in used] + behind] = float("nan")
    for s, (n, prefix) in enumerate(chunks):
        end = n + prefix
        if end % block_size:  # the last block's slots past the context
            cache[:, tables[s, end // block_size], end % block_size :] = float("nan")
    got = paged_prefill_attention(q, cache[0], cache[1], tables, starts.int(), lens.int(), 0.2, window)
    assert len(behind) >= 4 and not got.isnan().any()
    torch.testing.assert_close(got, clean)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_write_kv_scatters_and_skips_negative_slots(dtype):
    cache = randn(2, 5, 4, 2, 40, seed=5).to(dtype)
    k, v = randn(6, 2, 80, seed=6).to(dtype)[:, :, :40], randn(6, 2, 40, seed=7).to(dtype)  # k strided: a slice
    slots = torch.tensor([3, -1, 17, 0, -1, 19])
    expected = cache.clone()
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[0, slot // 4, slot % 4], expected[1, slot // 4, slot % 4] = k[token], v[token]
    write_kv(cache[0], cache[1], k, v, slots)
    assert torch.equal(cache, expected)


def test_bad_arguments_are_refused_clearly():
    cache, tables = paged_cache([5, 9], 2, 32, 4, torch.float32, seed=4)
    q, lens = torch.randn(2, 4, 32), torch.tensor([5, 9])
    with pytest.raises(ValueError, match="KV heads"):
        paged_decode_attention(torch.randn(2, 3, 32), cache[0], cache[1], tables, lens, 1.0)
    with pytest.raises(ValueError, match="float16"):
        paged_decode_attention(q.double(), cache[0].double(), cache[1].double(), tables, lens, 1.0)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(q, cache[0], cache[1], tables.float(), lens, 1.0)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(q, cache[0], cache[1], tables, torch.tensor([0, 2]), lens, 1.0)
    with pytest.raises(ValueError, match="like the cache"):
        write_kv(cache[0], cache[1], torch.randn(2, 2, 32).half(), torch.randn(2, 2, 32), torch.tensor([0, 1]))


def test_available_needs_cuda_or_the_interpreter(monkeypatch):
    assert triton_attention.available("cpu") and triton_attention.available("cuda")
    assert not triton_attention.serves(torch.device("cpu"))  # CPU steps stay on the PyTorch / C path
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not triton_attention.available("cpu") and triton_attention.available("cuda")


def step_metadata(spans, block_size):
    """The model runner's own metadata for these spans (decodes first), in decode groups of at most 2 rows."""
    runner = SimpleNamespace(
        block_size=block_size,
        device=torch.device("cpu"),
        decode_group_size=2,
        sink_blocks=0,  # no attention sinks
        _tensor=lambda data, dtype=torch.long: torch.tensor(data, dtype=dtype),
    )
    return ModelRunner._metadata(runner, spans, lambda span: span.block_table)


@pytest.mark.parametrize("window", [None, 12])
def test_paged_attention_dispatch_equals_the_pytorch_path(monkeypatch, window):
    block_size, heads, kv_heads, head_dim = 4, 4, 2, 32
    # (cached tokens, new tokens): three decodes, then a chunk after a cached prefix and a whole prompt
    steps = [(9, 1), (22, 1), (3, 1), (14, 6), (0, 11)]
    g = torch.Generator().manual_seed(11)
    order = torch.randperm(40, generator=g).tolist()
    spans = []
    for cached, new in steps:
        table = [order.pop() for _ in range(math.ceil((cached + new) / block_size))]
        spans.append(QuerySpan([0] * new, cached, table))
    meta = step_metadata(spans, block_size)
    assert len(meta.decode_groups) == 2 and len(meta.prefills) == 2
    tokens = sum(new for _, new in steps)
    cache = torch.randn(2, 40, block_size, kv_heads, head_dim, generator=g)
    q = torch.randn(tokens, heads, head_dim, generator=g)
    k, v = torch.randn(2, tokens, kv_heads, head_dim, generator=g)
    torch_cache = cache.clone()
    expected = attention.paged_attention(q, k, v, torch_cache, meta, 0.3, window)
    monkeypatch.setattr(triton_attention, "DEVICE_TYPES", ("cpu",))
    got = attention.paged_attention(q, k, v, cache, meta, 0.3, window)
    assert "triton_prefill" in meta.kernel_inputs  # the Triton path ran
    torch.testing.assert_close(cache, torch_cache)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_importing_attention_does_not_import_triton():
    code = "import petrel, petrel.model.attention, sys; print('triton' in sys.modules)"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
