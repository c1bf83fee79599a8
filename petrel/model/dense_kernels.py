"""petrel's float32 CPU kernels (dense_kernels.c; the attention in decode_attention.c and prefill_attention.c): a
decode attention that reads the KV blocks in place, one-pass RMS norm, rotary embedding and SiLU-and-multiply, and
all of them as one call for a whole Llama decoder layer when a step has only decodes (its projections float32 or
quantized: see Weight).

Each function here returns None when its kernel does not apply (not a CPU float32 tensor of a supported shape, or
no kernels on this machine: see native.load; switch PETREL_DENSE_KERNELS=0); the caller then runs its torch path,
which computes the same thing."""

from __future__ import annotations

import ctypes
import os
import sys
from typing import NamedTuple

import torch

from petrel.model import gemm_kernels, native, quant_kernels
from petrel.model.gemm_kernels import GEMV_MAX_ROWS
from petrel.model.quantization import GEMM_MAX_ROWS as QUANT_GEMM_MAX_ROWS
from petrel.model.quantization import QuantizedWeight

_P = ctypes.c_void_p


class Weight(ctypes.Structure):
    """A projection's weight as decode_layer reads it (kernels.h's `weight`, field for field): float32 rows or
    panels (bits 32; panels, if not 0, the ISA of their blocks, gemm_kernels.f32_panels_isa(): a QuantizedWeight of
    quantization.hold_f32_panels), bfloat16 rows or panels (bits 16: a QuantizedWeight of quantization 'bf16';
    panels 1 for quantization.pack_panels' layout), or a QuantizedWeight's codes, scales and mins (bits 4 or 8,
    groups of 2**gshift), products by quant_kernels.c, and from integer_rows rows (0: never; see
    QuantizedWeight.integer_rows) in integers by int8_gemm.c (one scale a row) or group_gemm.c (groups) with the
    kernel integer_isa (quant_kernels.integer_isa)."""

    _fields_ = [
        ("data", _P),
        ("scale", _P),
        ("mins", _P),
        ("bits", ctypes.c_int32),
        ("gshift", ctypes.c_int32),
        ("integer_rows", ctypes.c_int32),
        ("integer_isa", ctypes.c_int32),
        ("panels", ctypes.c_int32),
    ]


class MoeAct(ctypes.Structure):
    """The experts' biases (pointers to float32 [local experts, 2I] and [local experts, H], or None) and activation
    (swiglu 1: gpt-oss's clamped SwiGLU with alpha and limit; 0: SiLU-and-multiply), as moe.c takes them (kernels.h's
    moe_act, field for field)."""

    _fields_ = [
        ("gate_up_bias", _P),
        ("down_bias", _P),
        ("swiglu", ctypes.c_int64),
        ("alpha", ctypes.c_float),
        ("limit", ctypes.c_float),
    ]


class MoeLayer(ctypes.Structure):
    """A mixture of experts in place of a layer's dense MLP, as decode_layer(s) take it (kernels.h's moe_layer, field
    for field): the float32 router, this rank's experts' Weight arrays, the int64 tokens-per-expert counter it adds
    to, and a shared expert (shared_inter 0: none); petrel/model/moe.py's SparseMoeBlock.kernel_parts builds it."""

    _fields_ = [
        ("router", _P),
        ("gate_up", _P),
        ("down", _P),
        ("routed", _P),
        ("experts", ctypes.c_int64),
        ("top_k", ctypes.c_int64),
        ("renormalize", ctypes.c_int64),
        ("first", ctypes.c_int64),
        ("num_local", ctypes.c_int64),
        ("inter", ctypes.c_int64),
        ("shared_gate_up", Weight),
        ("shared_down", Weight),
        ("shared_gate", Weight),
        ("shared_inter", ctypes.c_int64),
        ("router_bias", _P),
        ("topk_softmax", ctypes.c_int64),
        ("act", MoeAct),
        ("sigmoid", ctypes.c_int64),
        ("n_group", ctypes.c_int64),
        ("topk_group", ctypes.c_int64),
        ("group_top2", ctypes.c_int64),
        ("choice_bias", _P),
        ("routed_scaling", ctypes.c_float),  # > 0: DeepSeek's router (kernels.h); 0: the softmax / top-k ones
    ]


class LayerExtras(ctypes.Structure):
    """What a layer holds beyond a plain Llama layer, as decode_layer(s) take it (kernels.h's layer_extras): per-head
    q and k norm weights, a MoeLayer, the qkv and o products' biases, the attention's sink logits (each None if
    none)."""

    _fields_ = [
        ("q_norm", _P),
        ("k_norm", _P),
        ("moe", _P),
        ("qkv_bias", _P),
        ("o_bias", _P),
        ("sink_logits", _P),
    ]


class MoeParts(NamedTuple):
    """A mixture of experts for decode_layer(s): its MoeLayer, the tensors and arrays its pointers point into (kept
    alive with it), and the most rows its products take in one call (moe_kernels.max_rows)."""

    layer: MoeLayer
    keep: tuple
    max_rows: int


class PromptChunk(ctypes.Structure):
    """A step's prompt chunk after its decode rows, as decode_layers takes them, an array in row order (kernels.h's
    prompt_chunk, field for field): rows from first_row to the next chunk's (the last one's to the step's end) are
    one prompt's positions p0, p0 + 1, ... through its block table `table`, attended as paged_prefill_attention
    does."""

    _fields_ = [("first_row", ctypes.c_int64), ("table", _P), ("p0", ctypes.c_int64)]


class KvGroup(ctypes.Structure):
    """A step as one KV group's layers see it, as decode_layers takes them, an array with each layer's index into it
    (kernels.h's kv_group, field for field): the rows' cache slots, the decode rows' block tables (max_blocks wide)
    and context lengths, and the prompt chunks (a PromptChunk array, the same rows in every group)."""

    _fields_ = [
        ("slots", _P),
        ("tables", _P),
        ("max_blocks", ctypes.c_int64),
        ("context_lens", _P),
        ("chunks", _P),
    ]


class StepGroup(NamedTuple):
    """A KV group's view of a step for DecoderStack: slots [T] int64; the decode rows' block_tables [decodes, width]
    and context_lens [decodes] ([0, width] and [0] where there are none); chunks, in row order: (first_row, its block
    table [>= its blocks] int64, p0) for each prompt chunk after the decode rows, its rows from first_row to the
    next chunk's (the last one's to T - 1), at positions p0, p0 + 1, ..."""

    slots: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    chunks: list[tuple[int, torch.Tensor, int]]


def describe(weight: torch.Tensor | QuantizedWeight) -> Weight | None:
    """A [out, in] float32 tensor or a QuantizedWeight as a Weight, or None where the kernels cannot take it."""
    if isinstance(weight, QuantizedWeight) and weight.bits == 32:  # float32 panels
        isa = gemm_kernels.f32_panels_isa() if weight.codes.is_cpu else 0
        return Weight(weight.codes.data_ptr(), None, None, 32, 0, 0, 0, isa) if isa else None
    if isinstance(weight, QuantizedWeight) and weight.bits == 16 and weight.panels:  # they need rounded x
        ok = weight.codes.is_cpu and gemm_kernels.bf16_panels()
        return Weight(weight.codes.data_ptr(), None, None, 16, 0, 0, 0, 1) if ok else None
    if isinstance(weight, QuantizedWeight) and weight.bits == 16:
        ok = weight.codes.is_cpu and weight.shape[1] % 16 == 0 and library() is not None
        return Weight(weight.codes.data_ptr(), None, None, 16, 0, gemm_kernels.bf16_pairs_rows(), 0) if ok else None
    if isinstance(weight, QuantizedWeight):
        codes = weight.codes
        if not codes.is_cpu or weight.shape[1] % 32 or quant_kernels.library() is None:
            return None
        mins = weight.mins
        return Weight(
            codes.data_ptr(),
            weight.scale.data_ptr(),
            None if mins is None else mins.data_ptr(),
            weight.bits,
            weight.group_shift,
            weight.integer_rows,
            quant_kernels.integer_isa(weight.bits),
        )
    if not (_is_cpu_f32(weight) and weight.is_contiguous()):
        return None
    return Weight(weight.data_ptr(), None, None, 32, 0, 0, 0)


_MAX_GROUP, _MAX_HEAD_DIMS = 64, 16384  # query heads per KV head; query heads x head_dim (decode_attention.c)
_MAX_BLOCK_SIZE = 256
_MAX_PREFILL_HEAD_DIM = 256  # MAX_D in prefill_attention.c


def library() -> ctypes.CDLL | None:
    return gemm_kernels.library()


def _is_cpu_f32(*tensors: torch.Tensor) -> bool:
    for t in tensors:  # a plain loop: called several times per layer, where every microsecond shows at one row
        if not t.is_cpu or t.dtype is not torch.float32:
            return False
    return True


def _kv_bf16(*caches: torch.Tensor) -> int | None:
    """The attention kernels' kv_bf16 argument for these contiguous CPU caches (decode's and prefill's alike): 0
    float32; bfloat16 _bf16_cache_kind(); None for any other cache (another dtype or device, caches that differ, a
    strided view)."""
    dtype = caches[0].dtype
    if dtype is not torch.float32 and dtype is not torch.bfloat16:
        return None
    for c in caches:
        if not c.is_cpu or c.dtype is not dtype or not c.is_contiguous():
            return None
    return _bf16_cache_kind() if dtype is torch.bfloat16 else 0


def _bf16_cache_kind() -> int:
    """kv_bf16 for a bfloat16 cache: 2 where products round x to bfloat16 (gemm_kernels.bf16_pairs_rows: AVX512_BF16,
    neither PETREL_AVX512 nor PETREL_BF16_ACTIVATIONS 0) and the CPU has AVX512VL: the attention kernels' dpbf16
    loops, which round the queries and the softmax weights to bfloat16 too; else 1 (each value widened to float32,
    the float32 arithmetic)."""
    return 2 if gemm_kernels.bf16_pairs_rows() and native.cpu_has("avx512vl") else 1


def _attention_fits(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> bool:
    """Whether paged_decode_attention (alone or inside decode_layer) takes these heads, blocks and index tensors."""
    return (
        head_dim % 8 == 0
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= _MAX_GROUP
        and num_heads * head_dim <= _MAX_HEAD_DIMS
        and block_size <= _MAX_BLOCK_SIZE
        and block_tables.dtype == torch.int64
        and context_lens.dtype == torch.int64
    )


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] @ weight[N, K]^T for M <= GEMV_MAX_ROWS, or None."""
    m, k = x.shape
    if (
        m > GEMV_MAX_ROWS
        or k % 16
        or not _is_cpu_f32(x, weight)
        or not weight.is_contiguous()
        or (lib := library()) is None
    ):
        return None
    x = x.contiguous()
    y = torch.empty(m, weight.shape[0], dtype=torch.float32)
    lib.f32_gemv(x.data_ptr(), m, k, weight.data_ptr(), y.data_ptr(), weight.shape[0], torch.get_num_threads())
    return y


def prefill_gemm_is_petrels() -> bool:
    """Whether products of more than Linear.SMALL_BATCH rows run petrel's GEMM (gemm) or torch's: petrel's unless
    PETREL_GEMM=torch. Measured (benchmarks/where_time_goes.py gemm, Zen 4, 2 threads, docs/benchmarks-history.md,
    2026-12-02):
    at the default model's shapes 1.1-1.3x torch's; at a Llama-1B's, since K is sliced and W packed a chunk at a
    time (gemm_driver.h), 1.1-1.4x (before: 0.50-0.75x, when torch's took these products on AVX-512 CPUs); on AVX2
    CPUs level with torch's or ahead."""
    return os.environ.get("PETREL_GEMM", "") != "torch"


def gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] @ weight[N, K]^T for many rows (prefill) with the register-blocked kernel of this CPU's widest vectors:
    gemm_avx512.c where native.cpu_has_avx512 says so, else gemm_avx2.c; None where neither runs (no kernel
    library, not CPU float32)."""
    if not (_is_cpu_f32(x, weight) and weight.is_contiguous()) or (lib := library()) is None:
        return None
    x = x.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    gemm_kernels.widest_gemm(lib, x, weight, y)
    return y


def decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One query per sequence against its paged context. q [S, heads, d]; key/value_cache [blocks, block_size,
    kv_heads, d]; block_tables [S, width] int64; context_lens [S] int64 (this step's token included); sink_logits
    [heads] float32, each head's logit joining its softmax (or None). Returns [S, heads, d], or None. A float32
    cache goes through AVX-512F's loops where native.cpu_has_avx512 says so (and head_dim is a multiple of 16),
    else AVX2's; a bfloat16 cache where bfloat16 products round x goes through dpbf16 with q and the softmax weights
    rounded to bfloat16 too (_bf16_cache_kind), as prefill_attention's."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if (
        not _attention_fits(num_heads, num_kv_heads, head_dim, block_size, block_tables, context_lens)
        or not _sinks_fit(sink_logits, num_heads)
        or not _is_cpu_f32(q)
        or (kv_bf16 := _kv_bf16(key_cache, value_cache)) is None
        or (lib := library()) is None
    ):
        return None
    if q.stride(2) != 1 or q.stride(1) != head_dim:  # heads must be contiguous within a row; rows may be apart
        q = q.contiguous()
    block_tables, context_lens = block_tables.contiguous(), context_lens.contiguous()
    out = torch.empty(q.shape, dtype=torch.float32)
    lib.paged_decode_attention(
        q.data_ptr(),
        q.stride(0),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        kv_bf16,
        block_tables.data_ptr(),
        block_tables.shape[1],
        context_lens.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        sliding_window or 0,
        scale,
        None if sink_logits is None else sink_logits.data_ptr(),
        out.data_ptr(),
        int(native.cpu_has_avx512()),
        torch.get_num_threads(),
    )
    return out


def _sinks_fit(sink_logits: torch.Tensor | None, num_heads: int) -> bool:
    """No sink logits, or a contiguous CPU float32 [num_heads] of them."""
    return sink_logits is None or (
        _is_cpu_f32(sink_logits) and sink_logits.is_contiguous() and tuple(sink_logits.shape) == (num_heads,)
    )


def prefill_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    first_pos: int,
    scale: float,
    sliding_window: int | None,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """A prompt chunk's queries against every key they see (causal; windowed when sliding_window is set), read
    from the paged cache, which already holds the chunk's own keys and values. q [n, heads, d] at positions
    first_pos .. first_pos+n-1; key/value_cache [blocks, block_size, kv_heads, d]; block_table [>= blocks of the
    context] int64; sink_logits as decode_attention's. Returns [n, heads, d], or None. A bfloat16 cache where
    bfloat16 products round x goes through dpbf16 with q and the softmax weights rounded to bfloat16 too
    (_bf16_cache_kind)."""
    n, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if (
        head_dim % 16
        or head_dim > _MAX_PREFILL_HEAD_DIM
        or num_heads % num_kv_heads
        or not _sinks_fit(sink_logits, num_heads)
        or block_table.dtype != torch.int64
        or not _is_cpu_f32(q)
        or (kv_bf16 := _kv_bf16(key_cache, value_cache)) is None
        or (lib := library()) is None
    ):
        return None
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    block_table = block_table.contiguous()
    window, threads = sliding_window or 0, torch.get_num_threads()
    workspace = torch.empty(lib.prefill_attention_workspace(n, first_pos, window, num_kv_heads, head_dim))
    out = torch.empty(q.shape, dtype=torch.float32)
    lib.paged_prefill_attention(
        q.data_ptr(),
        q.stride(0),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        kv_bf16,
        block_table.data_ptr(),
        n,
        first_pos,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        window,
        scale,
        None if sink_logits is None else sink_logits.data_ptr(),
        out.data_ptr(),
        workspace.data_ptr(),
        int(native.cpu_has_avx512()),
        threads,
    )
    return out


def _rows(x: torch.Tensor) -> bool:
    """A CPU float32 matrix whose rows are contiguous (any row stride)."""
    return x.dim() == 2 and x.stride(1) == 1 and _is_cpu_f32(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x [T, H] -> x / sqrt(mean(x^2) + eps) * weight, or None."""
    if not (_rows(x) and _is_cpu_f32(weight) and weight.is_contiguous()) or (lib := library()) is None:
        return None
    out = torch.empty(x.shape, dtype=torch.float32)
    lib.rms_norm(
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        x.stride(0),
        weight.data_ptr(),
        eps,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x [T, heads, D] (heads contiguous, any row stride), cos/sin [T, 1, D] -> rotate-half rotary, or None."""
    num_tokens, heads, dim = x.shape
    if (
        dim % 16
        or x.stride(2) != 1
        or x.stride(1) != dim
        or not _is_cpu_f32(x, cos, sin)
        or not (cos.is_contiguous() and sin.is_contiguous())
        or cos.numel() != num_tokens * dim
        or (lib := library()) is None
    ):
        return None
    out = torch.empty(x.shape, dtype=torch.float32)
    lib.rotary(
        x.data_ptr(),
        num_tokens,
        heads,
        dim,
        x.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """x [T, 2I] (gate, up) -> silu(gate) * up [T, I], or None."""
    if not (_rows(x) and x.is_contiguous()) or x.shape[1] % 16 or (lib := library()) is None:
        return None
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=torch.float32)
    lib.silu_and_mul(x.data_ptr(), x.shape[0], x.shape[1] // 2, out.data_ptr(), torch.get_num_threads())
    return out


def greedy_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per row of logits [rows, vocab]: the first maximum's index (the first NaN's where there is one: torch's
    argmax) and its log-softmax (NaN where a NaN or an infinite maximum leaves none: torch's log_softmax), or
    None."""
    rows, vocab = logits.shape
    if not _rows(logits) or vocab == 0 or (lib := library()) is None:
        return None
    tokens, logprobs = torch.empty(rows, dtype=torch.int64), torch.empty(rows, dtype=torch.float32)
    lib.greedy_rows(
        logits.data_ptr(),
        rows,
        vocab,
        logits.stride(0),
        tokens.data_ptr(),
        logprobs.data_ptr(),
        torch.get_num_threads(),
    )
    return tokens, logprobs


class LayerParts(NamedTuple):
    """A Llama decoder layer as decode_layer takes it: norms (input, post-attention RMS norm weights) and their eps;
    weights (float32 tensors or QuantizedWeights): qkv [(NH + 2 KVH) D, hidden], o [hidden, NH D], gate_up [2 I,
    hidden], down [hidden, I] (None, None with moe); heads (NH, KVH, D); the attention's scale and sliding window;
    qk_norms: the per-head q and k RMS norm weights [D] (Qwen3), or None; moe: a mixture of experts (MoeParts) in
    place of the dense MLP, or None; biases: the qkv and o products' (each a tensor or None), or None; sink_logits:
    the attention's [NH] (gpt-oss's), or None."""

    norms: tuple[torch.Tensor, torch.Tensor]
    eps: float
    weights: tuple[torch.Tensor | QuantizedWeight | None, ...]
    heads: tuple[int, int, int]
    scale: float
    sliding_window: int | None
    qk_norms: tuple[torch.Tensor, torch.Tensor] | None = None
    moe: MoeParts | None = None
    biases: tuple[torch.Tensor | None, torch.Tensor | None] | None = None
    sink_logits: torch.Tensor | None = None

    def _vectors(self) -> tuple:
        """The float32 vectors the kernels read in place: norms, q/k norms, biases, sink logits."""
        return (*self.norms, *(self.qk_norms or ()), *(b for b in self.biases or () if b is not None)) + (
            (self.sink_logits,) if self.sink_logits is not None else ()
        )

    @property
    def max_rows(self) -> int:
        """The most rows its products take in one call: any number where each product runs one kernel at every
        count of rows (weights in panels, or integer products from a few rows on), else the few-row kernels' limit
        (quantized ones': dequantized tiles above a few rows); the experts' likewise; and fewer than the rows from
        which a weight's products go to oneDNN (QuantizedWeight.tiles, AMX CPUs: petrel.model.amx), which the C call
        cannot reach."""
        return products_max_rows(self.weights, self.moe)

    @property
    def intermediate(self) -> int:
        """The dense MLP's width I (0 with a mixture of experts)."""
        return self.weights[3].shape[1] if self.weights[3] is not None else 0

    def fits(self, rows: int) -> bool:
        """Whether the kernels take this layer for a step of `rows` rows (its weights apart: see describe)."""
        head_dim = self.heads[2]
        norms = self._vectors()
        return (
            rows <= self.max_rows
            and self.weights[0].shape[1] % 16 == 0
            and self.intermediate % 16 == 0
            and head_dim % 16 == 0  # the products', rotary's
            and _is_cpu_f32(*norms)
            and all(t.is_contiguous() for t in norms)
        )

    def extras(self) -> LayerExtras | None:
        """The layer's LayerExtras for the kernels (None for a plain Llama layer)."""
        if self.qk_norms is None and self.moe is None and self.biases is None and self.sink_logits is None:
            return None
        q_norm, k_norm = (t.data_ptr() for t in self.qk_norms) if self.qk_norms is not None else (None, None)
        qkv_bias, o_bias = (None if b is None else b.data_ptr() for b in self.biases or (None, None))
        return LayerExtras(
            q_norm,
            k_norm,
            ctypes.addressof(self.moe.layer) if self.moe is not None else None,
            qkv_bias,
            o_bias,
            None if self.sink_logits is None else self.sink_logits.data_ptr(),
        )


def products_max_rows(weights, moe: MoeParts | None) -> int:
    """The most rows a one-call layer's products take (LayerParts.max_rows says why) for its weights (None: absent)
    and its mixture of experts."""
    weights = [w for w in weights if w is not None]
    limit = moe.max_rows if moe is not None else sys.maxsize
    if not all(isinstance(w, QuantizedWeight) and (w.panels or w.integer_rows) for w in weights):
        quantized = any(isinstance(w, QuantizedWeight) for w in weights)
        limit = min(limit, QUANT_GEMM_MAX_ROWS if quantized else GEMV_MAX_ROWS)
    tiled = [w.tiles.min_rows for w in weights if isinstance(w, QuantizedWeight) and w.tiles is not None]
    return min(limit, min(tiled) - 1) if tiled else limit


def describe_layer(parts: LayerParts) -> list[Weight] | None:
    """The layer's four weights for the kernels (a mixture of experts' absent dense MLP as empty Weights), or None
    where one of them cannot be taken."""
    described = [describe(w) if w is not None else Weight() for w in parts.weights]
    return None if None in described else described


def _step_fits(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    heads: tuple[int, int, int],
) -> bool:
    """Whether a decode step's rows, rotary tables and index tensors, and its cache's shape, are what
    decode_layer(s) take (the cache's kind: _kv_bf16, which the callers ask once)."""
    return (
        cos.numel() == x.shape[0] * heads[2]
        and slots.dtype == torch.int64
        and _attention_fits(*heads, kv_cache.shape[2], block_tables, context_lens)
        and _is_cpu_f32(x, cos, sin)
        and x.is_contiguous()
        and cos.is_contiguous()
        and sin.is_contiguous()
    )


def decode_layer(
    x: torch.Tensor,
    layer: LayerParts,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor | None:
    """A whole Llama decoder layer for T decode rows (see decode_layer in dense_kernels.c), or None.

    x [T, hidden]; cos/sin [T, 1, D]; kv_cache [2, blocks, block_size, KVH, D]; slots [T]; block_tables [T, width];
    context_lens [T]. With quantized weights, up to quantization.GEMM_MAX_ROWS rows."""
    num_heads, num_kv_heads, head_dim = layer.heads
    if (
        not layer.fits(x.shape[0])
        or not _step_fits(x, cos, sin, kv_cache, slots, block_tables, context_lens, layer.heads)
        or (kv_bf16 := _kv_bf16(kv_cache)) is None
        or (described := describe_layer(layer)) is None
        or (lib := library()) is None
    ):
        return None
    w_qkv, w_o, w_gate_up, w_down = (ctypes.byref(w) for w in described)
    extras = layer.extras()
    block_tables, context_lens = block_tables.contiguous(), context_lens.contiguous()
    out = torch.empty_like(x)
    if lib.decode_layer(
        x.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        x.shape[1],
        layer.norms[0].data_ptr(),
        layer.norms[1].data_ptr(),
        layer.eps,
        w_qkv,
        w_o,
        w_gate_up,
        w_down,
        layer.intermediate,
        num_heads,
        num_kv_heads,
        head_dim,
        cos.data_ptr(),
        sin.data_ptr(),
        kv_cache[0].data_ptr(),
        kv_cache[1].data_ptr(),
        kv_bf16,
        int(native.cpu_has_avx512()),
        slots.data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1],
        context_lens.data_ptr(),
        kv_cache.shape[2],
        layer.sliding_window or 0,
        layer.scale,
        ctypes.byref(extras) if extras is not None else None,
        None,
        0,
        torch.get_num_threads(),
    ):
        raise native.out_of_memory("decode_layer")
    return out


class DecoderStack:
    """A model's plain decoder layers as one decode_layers call (dense_kernels.c): the pointers to every layer's
    norms, weights and cache, gathered once (build), then a step's rows through all of them: decode rows, and prompt
    chunks after them (a short prompt's forward layer by layer spends a third of its time in Python and in waking
    OpenMP's threads for each of its ~300 kernel calls; a step of long ones, a tenth in the operations between the
    products)."""

    def __init__(self, lib, layers: list[LayerParts], kv_caches: list[torch.Tensor], kv_bf16: int, weights):
        n = len(layers)
        self.lib, self.first = lib, layers[0]
        self.kv_caches = kv_caches  # kept alive with the pointers below
        pointers = ctypes.c_void_p * n
        self.norm1 = pointers(*(p.norms[0].data_ptr() for p in layers))
        self.norm2 = pointers(*(p.norms[1].data_ptr() for p in layers))
        self.weights = (Weight * (4 * n))(*weights)
        self.key_caches = pointers(*(c[0].data_ptr() for c in kv_caches))
        self.value_caches = pointers(*(c[1].data_ptr() for c in kv_caches))
        self.kv_bf16 = kv_bf16
        self.windows = (ctypes.c_int64 * n)(*(p.sliding_window or 0 for p in layers))
        self.max_rows = min(p.max_rows for p in layers)
        self.intermediate = max(p.intermediate for p in layers)  # the dense layers' (0: every one a MoE)
        extras = [p.extras() for p in layers]
        self.extras = (
            None if all(e is None for e in extras) else (LayerExtras * n)(*(e or LayerExtras() for e in extras))
        )
        self.layers = layers  # what the extras point into (q/k norms, MoeParts)

    @classmethod
    def build(cls, layers: list[LayerParts], kv_caches: list[torch.Tensor]) -> DecoderStack | None:
        """The stack, or None where one call cannot run it: a layer the kernels do not take, layers that differ
        in shape, eps or scale, caches of another shape or of kinds the kernels do not read (_kv_bf16), or no
        kernels here."""
        first = layers[0]
        same = all(
            p.heads == first.heads
            and p.eps == first.eps
            and p.scale == first.scale
            and p.weights[0].shape == first.weights[0].shape
            for p in layers
        )
        if (
            not same
            or len({p.intermediate for p in layers} - {0}) > 1  # one width for every dense MLP
            or not all(p.fits(1) for p in layers)
            or (lib := library()) is None
            or len({tuple(c.shape) for c in kv_caches}) != 1
            or (kv_bf16 := _kv_bf16(*kv_caches)) is None
            or None in (described := [describe_layer(p) for p in layers])
        ):
            return None
        return cls(lib, layers, kv_caches, kv_bf16, [w for four in described for w in four])

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        groups: list[StepGroup],
        layer_groups: list[int] | None = None,
    ) -> torch.Tensor | None:
        """x [T, hidden] through every layer (see decode_layer for cos and sin), or None. groups: the step as each
        KV group's layers see it (StepGroup), layer_groups each layer's index into them (None: one group for all
        layers); every group has the same decode rows and the same chunks' rows."""
        first, num_tokens = self.first, x.shape[0]
        num_heads, num_kv_heads, head_dim = first.heads
        if num_tokens > self.max_rows or not all(
            _step_fits(x, cos, sin, self.kv_caches[0], g.slots, g.block_tables, g.context_lens, first.heads)
            for g in groups
        ):
            return None
        chunks = groups[0].chunks
        if chunks and (
            head_dim > _MAX_PREFILL_HEAD_DIM or any(t.dtype != torch.int64 for g in groups for _, t, _ in g.chunks)
        ):
            return None
        keep = []  # the contiguous index tensors and chunk arrays, alive through the call
        described = (KvGroup * len(groups))()
        for g, group in zip(described, groups):
            tables = [t.contiguous() for _, t, _ in group.chunks]
            prompts = (PromptChunk * len(tables))(
                *(PromptChunk(row, t.data_ptr(), p0) for (row, _, p0), t in zip(group.chunks, tables))
            )
            slots, block_tables = group.slots.contiguous(), group.block_tables.contiguous()
            context_lens = group.context_lens.contiguous()
            keep += [tables, prompts, slots, block_tables, context_lens]
            g.slots, g.tables, g.max_blocks = slots.data_ptr(), block_tables.data_ptr(), block_tables.shape[1]
            g.context_lens, g.chunks = context_lens.data_ptr(), ctypes.addressof(prompts)
        layer_index = None if layer_groups is None else (ctypes.c_int64 * len(layer_groups))(*layer_groups)
        out = torch.empty_like(x)
        if self.lib.decode_layers(
            len(self.windows),
            x.data_ptr(),
            out.data_ptr(),
            num_tokens,
            x.shape[1],
            self.norm1,
            self.norm2,
            first.eps,
            self.weights,
            self.intermediate,
            num_heads,
            num_kv_heads,
            head_dim,
            cos.data_ptr(),
            sin.data_ptr(),
            self.key_caches,
            self.value_caches,
            self.kv_bf16,
            int(native.cpu_has_avx512()),
            described,
            layer_index,
            self.kv_caches[0].shape[2],
            self.windows,
            first.scale,
            self.extras,
            len(chunks),
            torch.get_num_threads(),
        ):
            raise native.out_of_memory("decode_layers")
        return out
