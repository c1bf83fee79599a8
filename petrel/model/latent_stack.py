"""DeepSeek's decoder layers for a step of decode rows as one kernel call (latent_layers.c): multi-head latent
attention over the latent cache (absorbed queries, the rows read in place), then a dense MLP or a mixture of experts
behind DeepSeek's router (moe.c), every layer in turn, without a return to Python between them.

LatentStack.build gathers every layer's pointers once; it returns None where the kernels cannot take a layer (a
projection with a bias or split over ranks, weights or caches of kinds they do not read, shapes their vectors do
not divide); the model's modules then run the step, computing the same sums."""

from __future__ import annotations

import ctypes

import torch

from petrel.model import dense_kernels, mla_kernels
from petrel.model.dense_kernels import MoeParts, Weight, products_max_rows
from petrel.model.layers import Linear, RMSNorm
from petrel.model.llama import LlamaMLP
from petrel.model.moe import SparseMoeBlock
from petrel.model.quantization import QuantizedLinear

_P = ctypes.c_void_p


class LatentLayer(ctypes.Structure):
    """A DeepSeek decoder layer as latent_decode_layers reads it (kernels.h's latent_layer, field for field)."""

    _fields_ = [
        ("norm1", _P),
        ("norm2", _P),
        ("q_a", Weight),
        ("q_a_norm", _P),
        ("q_b", Weight),
        ("kv_a", Weight),
        ("kv_a_norm", _P),
        ("w_uk", _P),
        ("w_uv", _P),
        ("o", Weight),
        ("gate_up", Weight),
        ("down", Weight),
        ("inter", ctypes.c_int64),
        ("moe", _P),
        ("cache", _P),
    ]


class LatentShape(ctypes.Structure):
    """The shapes every layer shares (kernels.h's latent_shape, field for field)."""

    _fields_ = [
        ("heads", ctypes.c_int64),
        ("nope", ctypes.c_int64),
        ("rope", ctypes.c_int64),
        ("v_dim", ctypes.c_int64),
        ("rank", ctypes.c_int64),
        ("q_lora", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("latent_eps", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]


def _weight(module) -> torch.Tensor | object | None:
    """A projection's weight as the kernels take it (a QuantizedLinear's QuantizedWeight), or None where they cannot:
    a bias, a split over ranks, a module of another kind."""
    if type(module) is QuantizedLinear:
        return module.qweight if module.bias is None else None
    tp = getattr(module, "tp", None)
    if not isinstance(module, Linear) or module.bias is not None or (tp is not None and tp.size != 1):
        return None
    return module.weight


def _vector(t: torch.Tensor) -> bool:
    return t.is_cpu and t.dtype is torch.float32 and t.is_contiguous()


class LatentStack:
    """Every layer's LatentLayer, the shapes they share, and what their pointers point into (kept alive here)."""

    def __init__(self, lib, layers, shape: LatentShape, caches, kv_bf16: int, max_rows: int, keep: list):
        self.lib, self.layers, self.shape = lib, layers, shape
        self.caches, self.kv_bf16, self.max_rows, self.keep = caches, kv_bf16, max_rows, keep

    @classmethod
    def build(cls, layers: list, kv_caches: list[torch.Tensor]) -> LatentStack | None:
        """The stack for these DeepseekDecoderLayers and their caches ([1, blocks, block_size, 1, rank + rope] each),
        or None where one call cannot run them."""
        if (lib := dense_kernels.library()) is None:
            return None
        first = layers[0].self_attn
        caches = [c[0] for c in kv_caches]
        if len({tuple(c.shape) for c in caches}) != 1 or (kv_bf16 := dense_kernels._kv_bf16(*caches)) is None:
            return None
        described, keep, limits = [], [], []
        for layer, cache in zip(layers, caches):
            parts = _layer_parts(layer, first)
            if parts is None:
                return None
            weights, vectors, moe = parts
            descriptions = [Weight() if w is None else dense_kernels.describe(w) for w in weights]
            if None in descriptions:
                return None
            q_a, q_b, kv_a, o, gate_up, down = descriptions
            norm1, norm2, q_a_norm, kv_a_norm, w_uk, w_uv = vectors
            inter = 0 if weights[5] is None else weights[5].shape[1]
            described.append(
                LatentLayer(
                    norm1.data_ptr(),
                    norm2.data_ptr(),
                    q_a,
                    None if q_a_norm is None else q_a_norm.data_ptr(),
                    q_b,
                    kv_a,
                    kv_a_norm.data_ptr(),
                    w_uk.data_ptr(),
                    w_uv.data_ptr(),
                    o,
                    gate_up,
                    down,
                    inter,
                    None if moe is None else ctypes.addressof(moe.layer),
                    cache.data_ptr(),
                )
            )
            keep += [weights, vectors, moe]
            limits.append(products_max_rows(weights, moe))
        shape = LatentShape(
            first.num_heads,
            first.nope,
            first.rope,
            first.v_dim,
            first.rank,
            first.q_b_proj.in_features if hasattr(first, "q_a_proj") else 0,
            layers[0].input_layernorm.eps,
            first.kv_a_layernorm.eps,
            first.scale,
        )
        hidden = layers[0].input_layernorm.weight.shape[0]
        inters = [layer.inter for layer in described]
        if not _shapes_fit(shape, hidden, inters, caches[0].shape[1]):
            return None
        return cls(lib, (LatentLayer * len(described))(*described), shape, caches, kv_bf16, min(limits), keep)

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor | None:
        """x [T, hidden] (T decode rows) through every layer, or None where the call cannot take this step: cos, sin
        [T, 1, rope] (or [T, rope]) float32; slots [T], block_tables [T, width], context_lens [T] int64."""
        rows, rope = x.shape[0], self.shape.rope
        if (
            rows > self.max_rows
            or not dense_kernels._is_cpu_f32(x, cos, sin)
            or cos.numel() != rows * rope
            or sin.numel() != rows * rope
            or any(t.dtype != torch.int64 for t in (slots, block_tables, context_lens))
        ):
            return None
        x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
        slots, block_tables, context_lens = slots.contiguous(), block_tables.contiguous(), context_lens.contiguous()
        out = torch.empty_like(x)
        if self.lib.latent_decode_layers(
            len(self.layers),
            self.layers,
            ctypes.byref(self.shape),
            x.data_ptr(),
            out.data_ptr(),
            rows,
            x.shape[1],
            cos.data_ptr(),
            sin.data_ptr(),
            self.kv_bf16,
            slots.data_ptr(),
            block_tables.data_ptr(),
            block_tables.shape[1],
            context_lens.data_ptr(),
            self.caches[0].shape[1],
            torch.get_num_threads(),
        ):
            raise MemoryError("latent_decode_layers: no memory for its scratch")
        return out


def _shapes_fit(s: LatentShape, hidden: int, inters: list[int], block_size: int) -> bool:
    """Whether the kernels take these shapes: latent_attention.c's (an even count of heads, rows of a multiple of 8,
    a rank of a multiple of 32, blocks of at most MAX_BLOCK_SIZE), the rotation's (an even rope) and the
    products' (inputs of a multiple of 16)."""
    return (
        s.heads % 2 == 0
        and (s.rank + s.rope) % 8 == 0
        and s.rank % 32 == 0
        and s.rope % 2 == 0
        and block_size <= mla_kernels.MAX_BLOCK_SIZE
        and hidden % 16 == 0
        and s.q_lora % 16 == 0
        and (s.heads * s.v_dim) % 16 == 0
        and all(i % 16 == 0 for i in inters)
    )


def _layer_parts(layer, first) -> tuple[list, list, MoeParts | None] | None:
    """A DeepseekDecoderLayer's (weights: q_a, q_b, kv_a, o, gate_up, down, each None where absent; vectors: norm1,
    norm2, q_a_norm, kv_a_norm, w_uk, w_uv; the MoeParts of its experts or None), or None where the kernels cannot
    take it or it differs in shape from the first layer's attention."""
    attn, mlp = layer.self_attn, layer.mlp
    lora = hasattr(attn, "q_a_proj")
    norms = [layer.input_layernorm, layer.post_attention_layernorm, attn.kv_a_layernorm]
    norms += [attn.q_a_layernorm] if lora else []
    if (
        any(type(n) is not RMSNorm for n in norms)
        or layer.input_layernorm.eps != layer.post_attention_layernorm.eps
        or attn.kv_a_layernorm.eps != first.kv_a_layernorm.eps
        or (lora and attn.q_a_layernorm.eps != attn.kv_a_layernorm.eps)
        or lora != hasattr(first, "q_a_proj")
        or (attn.num_heads, attn.nope, attn.rope, attn.v_dim, attn.rank, attn.scale)
        != (first.num_heads, first.nope, first.rope, first.v_dim, first.rank, first.scale)
    ):
        return None
    projections: list = [attn.q_a_proj, attn.q_b_proj] if lora else [None, attn.q_proj]
    projections += [attn.kv_a_proj_with_mqa, attn.o_proj]
    moe = None
    if isinstance(mlp, SparseMoeBlock):  # DeepseekMoE: its router's fields in its kernel_parts
        if (moe := mlp.kernel_parts()) is None:
            return None
        projections += [None, None]
    elif type(mlp) is LlamaMLP:
        projections += [mlp.gate_up_proj, mlp.down_proj]
    else:
        return None
    weights = [None if m is None else _weight(m) for m in projections]
    if any(w is None for w, m in zip(weights, projections) if m is not None):
        return None
    vectors = [
        layer.input_layernorm.weight,
        layer.post_attention_layernorm.weight,
        attn.q_a_layernorm.weight if lora else None,
        attn.kv_a_layernorm.weight,
        attn.kv_b_proj.w_uk,
        attn.kv_b_proj.w_uv,
    ]
    if not all(_vector(v) for v in vectors if v is not None):
        return None
    return weights, vectors, moe
