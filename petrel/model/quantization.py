"""Weights kept quantized in memory: QuantizedWeight (affine low-bit codes), QuantizedLinear, QuantizedEmbedding.

EngineConfig.quantization picks how a model's projections, LM head and embedding are held:
  none  the checkpoint dequantized to the engine dtype (the reference path).
  int8  every projection quantized after loading, int8 per output row, symmetric (any checkpoint).
  gguf  a GGUF's own blocks kept (Q4_0, Q4_1, Q4_K as 4-bit codes with a scale and a min per 32; Q8_0, Q5_0,
        Q5_1, Q5_K as 8-bit codes per 32; Q6_K as 8-bit codes per 16; MXFP4 as it is); other GGUF types load
        dequantized.
MXFP4 (OCP microscaling, gpt-oss's experts: E2M1 4-bit values with an E8M0 scale per 32) stays MXFP4 whatever the
option, from a GGUF or a checkpoint's *_blocks / *_scales: QuantizedWeight.mxfp4.
  bf16  every projection, the LM head and the embedding held as bfloat16 (rounded to nearest even), activations
        float32; what dtype='bfloat16' means on the CPU (EngineConfig, which then keeps a bfloat16 KV cache too:
        kv_cache_dtype). Where the CPU has AVX512_BF16, x is rounded to bfloat16 too and the products run dpbf16,
        twice the FMA's rate (bf16_pairs.c; prompt attention over a bfloat16 cache rounds q and its weights the
        same way: dense_kernels.prefill_attention), and the projections are held packed in panels of 32 columns
        (pack_panels, at load: every count of rows runs one register-blocked kernel, with no packing a call; the
        embedding's lookups gather their rows from the panels); elsewhere (or PETREL_BF16_ACTIVATIONS=0) each
        weight is widened to float32 exactly (a shift) for the float32 kernels' arithmetic from half the bytes
        (dense_kernels.c's bf16_gemv, gemm_avx512.c / gemm_avx2.c's bf16_gemm, which widen W as they pack it).
        gemm_kernels.bf16_product picks.
With none, a float32 model on the CPU holds its projections, LM head and embedding packed in panels wherever the
kernels run (hold_f32_panels: the same float32 weights, laid out for panels.c's f32_panels_product, whose blocks are
AVX-512's or AVX2's; PETREL_F32_PANELS=0 keeps rows).
Products run in quant_kernels.c (AVX2): weights are widened to float in registers and multiplied with float
activations, so a product equals the dequantized weight's up to the order of float additions. At batch 1 a
decode step reads every weight once, so fewer bytes per weight is what makes it faster. Many rows (prefill,
batched decode) are arithmetic-bound instead: there the weights multiply x's rows rounded to 16-bit integers in exact
integer sums, int8 per-row weights in int8_gemm.c and GGUF's groups in group_gemm.c (a float multiply-add per group),
from INT8_MIN_ROWS rows; PETREL_INT8_COMPUTE=0 keeps the float products.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from petrel.model import gemm_kernels, quant_kernels

QUANTIZATION_METHODS = ("none", "int8", "gguf", "bf16")
ROW_GROUP = 62  # group shift meaning "one group per row" (per-output-channel scales)
PANEL = 32  # columns of W a panel of pack_panels holds (bf16_pairs.c's PANEL)
GEMV_MAX_ROWS = 12  # up to this many rows of x the register kernel wins; beyond, dequantized tiles:
GEMM_MAX_ROWS = 256  # up to this many, 12-row tiles under the float32 decode kernel (one call, quant_kernels.gemm);
TILE_ELEMENTS = 1 << 18  # beyond, tiles of this many weights (1 MB of float32: stays in cache) and torch's GEMM
# int8 per-row weights past the register kernel: integer products at any count (int8_gemm.c; Zen 4, one thread, a
# busy machine: 1.3-2x the float tiles from 8 rows, about 1.5x float32 weights from 64; benchmarks/int8_gemm.py)
INT8_MIN_ROWS = GEMV_MAX_ROWS + 1
INTEGER_GROUP_SHIFTS = (4, 5)  # groups that multiply in integers (group_gemm.c): GGUF's 16 and 32
# twice each E2M1 value (MXFP4's nibbles: sign, two exponent bits, one mantissa bit): integers, as quant_kernels.c
# multiplies them (FP4_DOUBLED), the doubling undone by the scale 2^(e - 128) of an E8M0 byte e
FP4_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def e8m0_halves(exponents: torch.Tensor) -> torch.Tensor:
    """2^(e - 128) of E8M0 bytes e (uint8), float32, exact (e < 2: subnormals), as quant_kernels.c's fp4_scale."""
    e = exponents.to(torch.int32)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32) << e, (e - 1) << 23)
    return bits.view(torch.float32)


class QuantizedWeight(nn.Module):
    """A [out, in] weight as codes with float32 scale (and min) per group: w = scale * code + min.

    bits 4: codes [out, in/32, 16] uint8 (two codes a byte, see quant_kernels.c), groups of 32; without mins,
    MXFP4: each code an E2M1 value, scale [out, in/32] the E8M0 bytes, w = e2m1 * 2^(e - 127) (mxfp4).
    bits 8: codes [out, in] int8, groups of 2**group_shift (group_shift ROW_GROUP: one group per row).
    bits 16: codes [out, in] bfloat16, the weights themselves (no scale or min: w = code); with `panels`, packed
    instead as pack_panels lays them out for panels.c's bf16_panels_product.
    bits 32 (panels only): float32 weights themselves packed by pack_panels for panels.c's f32_panels_product (a
    float32 model's weights wherever the kernels run: hold_f32_panels).
    A module so that .to(device) moves it; its buffers keep their dtypes through model.to(dtype).
    tiles: a copy packed at load for oneDNN's products of prompt-sized x (petrel.model.amx.Tiles, AMX CPUs), or None;
    copies and pickles leave it out (oneDNN's packed tensors have no storage to copy) and run petrel's kernels."""

    tiles = None

    def __init__(
        self,
        codes: torch.Tensor,
        scale: torch.Tensor,
        mins: torch.Tensor | None,
        bits: int,
        group_shift: int,
        shape: tuple[int, int],
        kind: str,
        panels: bool = False,
    ):
        super().__init__()
        self.bits, self.group_shift, self.shape, self.kind = bits, group_shift, tuple(shape), kind
        self.panels = panels
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.register_buffer("mins", mins)

    def __getstate__(self):
        state = dict(super().__getstate__())
        state.pop("tiles", None)
        return state

    def _apply(self, fn, recurse=True):
        for name, buf in self._buffers.items():
            if buf is not None:
                self._buffers[name] = fn(buf).to(buf.dtype)
        return self

    def extra_repr(self) -> str:
        return f"{self.kind}, shape={self.shape}, bits={self.bits}, group={self.group_size}, panels={self.panels}"

    @property
    def group_size(self) -> int:
        return self.shape[1] if self.group_shift >= ROW_GROUP else 1 << self.group_shift

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values() if b is not None)

    # ---------------------------------------------------------------- building

    @classmethod
    def from_gguf(cls, type_name: str, raw: np.ndarray, rows: int, cols: int) -> QuantizedWeight:
        from petrel.model.gguf_quants import read_blocks

        codes, scale, mins, bits, shift = read_blocks(type_name, raw, rows, cols)
        return cls(
            torch.from_numpy(codes),
            torch.from_numpy(scale),
            None if mins is None else torch.from_numpy(mins),
            bits,
            shift,
            (rows, cols),
            type_name,
        )

    @classmethod
    def mxfp4(cls, codes: torch.Tensor, exponents: torch.Tensor) -> QuantizedWeight:
        """MXFP4 kept as it is: codes [out, in/32, 16] uint8 (element i of a block in the low nibble of byte i, 16 + i
        in the high one: GGUF's MXFP4 order), exponents [out, in/32] uint8 (E8M0: the block's scale 2^(e - 127))."""
        rows, blocks = exponents.shape
        if tuple(codes.shape) != (rows, blocks, 16) or codes.dtype != torch.uint8 or exponents.dtype != torch.uint8:
            raise ValueError(f"MXFP4 codes {tuple(codes.shape)} and exponents {tuple(exponents.shape)} do not match")
        return cls(codes.contiguous(), exponents.contiguous(), None, 4, 5, (rows, blocks * 32), "MXFP4")

    @property
    def fp4(self) -> bool:
        """MXFP4 codes (4-bit codes without mins, as quant_kernels.c tells them)."""
        return self.bits == 4 and self.mins is None

    @classmethod
    def int8_per_channel(cls, weight: torch.Tensor) -> QuantizedWeight:
        """Symmetric int8 with one scale per output row (absmax / 127)."""
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        codes = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
        return cls(codes, scale.contiguous(), None, 8, ROW_GROUP, tuple(w.shape), "int8")

    @classmethod
    def bfloat16(cls, weight: torch.Tensor, panels: bool = False) -> QuantizedWeight:
        """The weight rounded to bfloat16 (nearest even), kept as such: rows, or (panels) in pack_panels' layout."""
        codes = weight.detach().to(torch.bfloat16).contiguous()
        if panels:
            return cls(pack_panels(codes), None, None, 16, ROW_GROUP, tuple(codes.shape), "bf16", panels=True)
        return cls(codes, None, None, 16, ROW_GROUP, tuple(codes.shape), "bf16")

    @classmethod
    def float32_panels(cls, weight: torch.Tensor) -> QuantizedWeight:
        """The float32 weight itself, packed in pack_panels' layout."""
        codes = weight.detach().to(torch.float32)
        return cls(pack_panels(codes), None, None, 32, ROW_GROUP, tuple(codes.shape), "f32", panels=True)

    def permute_rows(self, order: np.ndarray) -> QuantizedWeight:
        index = torch.from_numpy(np.asarray(order, dtype=np.int64))
        pick = lambda t: None if t is None else t[index].contiguous()  # noqa: E731
        return QuantizedWeight(
            pick(self.codes), pick(self.scale), pick(self.mins), self.bits, self.group_shift, self.shape, self.kind
        )

    def as_int8(self, group_shift: int) -> QuantizedWeight:
        """The same weights as 8-bit codes in groups of 2**group_shift (a divisor of this one's group): exact."""
        rows, cols = self.shape
        codes = self.codes
        if self.fp4:  # twice the E2M1 values, times half the scales: exact
            nibbles = torch.cat([codes & 0x0F, codes >> 4], dim=-1).reshape(rows, cols).long()
            doubled = torch.tensor(FP4_DOUBLED, dtype=torch.int8)[nibbles]
            scale = e8m0_halves(self.scale).repeat_interleave(32 >> group_shift, dim=1)
            return QuantizedWeight(doubled, scale, torch.zeros_like(scale), 8, group_shift, self.shape, self.kind)
        if self.bits == 4:
            codes = torch.cat([codes & 0x0F, codes >> 4], dim=-1).reshape(rows, cols).to(torch.int8)
        repeat = self.group_size >> group_shift
        mins = self.mins if self.mins is not None else torch.zeros_like(self.scale)
        return QuantizedWeight(
            codes,
            self.scale.repeat_interleave(repeat, dim=1),
            mins.repeat_interleave(repeat, dim=1),
            8,
            group_shift,
            self.shape,
            self.kind,
        )

    @staticmethod
    def concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Row blocks (fused q/k/v or gate/up) as one weight; mixed formats meet as 8-bit codes in the smallest
        group."""
        if len(parts) == 1:
            return parts[0]
        assert not any(p.panels for p in parts), "panels are packed after fusing, not fused"
        cols = parts[0].shape[1]
        same = len({(p.bits, p.group_shift, p.mins is None) for p in parts}) == 1
        if not same:
            shift = min(min(p.group_shift for p in parts), 5)
            parts = [p.as_int8(shift) for p in parts]
        p0 = parts[0]
        mins = None if p0.mins is None else torch.cat([p.mins for p in parts])
        kinds = "+".join(dict.fromkeys(p.kind for p in parts))
        return QuantizedWeight(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scale for p in parts]),
            mins,
            p0.bits,
            p0.group_shift,
            (sum(p.shape[0] for p in parts), cols),
            kinds,
        )

    # ---------------------------------------------------------------- using

    def dequantize(self, rows: torch.Tensor | slice | None = None) -> torch.Tensor:
        """Float32 weight rows (all by default) with torch alone: the reference and the kernels' fallback."""
        sel = slice(None) if rows is None else rows
        if self.bits >= 16:
            return (panel_rows(self.codes, self.shape, rows) if self.panels else self.codes[sel]).float()
        codes, scale = self.codes[sel], self.scale[sel]
        n = codes.shape[0]
        if self.fp4:
            nibbles = torch.cat([codes & 0x0F, codes >> 4], dim=-1).long()  # [n, groups, 32]
            doubled = torch.tensor(FP4_DOUBLED, dtype=torch.float32)[nibbles]
            return (doubled * e8m0_halves(scale).unsqueeze(-1)).view(n, self.shape[1])
        if self.bits == 4:
            q = torch.cat([codes & 0x0F, codes >> 4], dim=-1).float()  # [n, groups, 32]
        else:
            q = codes.float().view(n, scale.shape[1], -1)  # [n, groups, group]
        w = q * scale.unsqueeze(-1)
        if self.mins is not None:
            w += self.mins[sel].unsqueeze(-1)
        return w.view(n, self.shape[1])

    @property
    def integer_rows(self) -> int:
        """From how many rows of x products run in integers, 0 for never: int8 codes with one scale a row
        (quantization='int8', int8_gemm.c) and GGUF's groups (group_gemm.c) from INT8_MIN_ROWS, unless
        PETREL_INT8_COMPUTE=0."""
        per_row_int8 = self.bits == 8 and self.group_shift >= ROW_GROUP and self.mins is None
        grouped = self.group_shift in INTEGER_GROUP_SHIFTS and not self.fp4  # MXFP4: the float products
        return INT8_MIN_ROWS if (per_row_int8 or grouped) and quant_kernels.int8_compute() else 0

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] -> x @ W^T, float32 [M, out]."""
        out_features, in_features = self.shape
        x = x.to(torch.float32).contiguous()
        if self.tiles is not None and x.shape[0] >= self.tiles.min_rows:  # oneDNN's (AMX CPUs: petrel.model.amx)
            return self.tiles(x)
        if self.bits == 32:
            out = gemm_kernels.f32_panels_product(x, self.codes, out_features)
            return out if out is not None else x @ self.dequantize().t()
        if self.bits == 16:
            if self.panels:
                out = gemm_kernels.bf16_panels_product(x, self.codes, out_features)
            else:
                out = gemm_kernels.bf16_product(x, self.codes)
            return out if out is not None else x @ self.dequantize().t()
        lib = quant_kernels.library() if x.device.type == "cpu" and in_features % 32 == 0 else None
        mins = self.mins
        if lib is not None and 0 < self.integer_rows <= x.shape[0]:
            if self.group_shift >= ROW_GROUP:
                return quant_kernels.int8_gemm(lib, x, self.codes, self.scale)
            return quant_kernels.group_gemm(lib, self.bits, x, self.codes, self.scale, mins, self.group_shift)
        if lib is not None and x.shape[0] <= GEMM_MAX_ROWS:
            product = quant_kernels.gemv if x.shape[0] <= GEMV_MAX_ROWS else quant_kernels.gemm
            return product(lib, self.bits, x, self.codes, self.scale, mins, self.group_shift, out_features)
        tile = max(16, TILE_ELEMENTS // in_features)
        out_t = torch.empty(out_features, x.shape[0], dtype=torch.float32, device=x.device)
        buffer = torch.empty(min(tile, out_features), in_features, dtype=torch.float32, device=x.device)
        for n0 in range(0, out_features, tile):
            n1 = min(out_features, n0 + tile)
            if lib is not None:
                quant_kernels.dequantize_rows(
                    lib, self.bits, in_features, self.codes, self.scale, mins, self.group_shift, buffer, n0, n1
                )
                weights = buffer[: n1 - n0]
            else:
                weights = self.dequantize(slice(n0, n1))
            torch.mm(weights, x.t(), out=out_t[n0:n1])
        return out_t.t().contiguous()


class QuantizedLinear(nn.Module):
    """A projection whose weight stays quantized; computes in float32, returns the input's dtype. `marker` is an
    empty buffer that follows model.to(dtype, device), for whoever needs the model's dtype (LoRA slots)."""

    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.qweight = qweight
        self.out_features, self.in_features = qweight.shape
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.register_buffer("marker", torch.empty(0, dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.qweight.matmul(x.reshape(-1, self.in_features))
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class QuantizedEmbedding(nn.Module):
    """Token embeddings read from a QuantizedWeight (shared with a tied LM head): only the looked-up rows are
    dequantized. `marker` is an empty buffer that follows model.to(dtype): the dtype the embeddings come out in."""

    def __init__(self, qweight: QuantizedWeight, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.qweight = qweight
        self.num_embeddings, self.embedding_dim = qweight.shape
        self.register_buffer("marker", torch.empty(0, dtype=dtype), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.qweight.dequantize(ids.reshape(-1))
        return rows.to(self.marker.dtype).reshape(*ids.shape, self.embedding_dim)


# ---------------------------------------------------------------- putting them in a model


def pack_panels(codes: torch.Tensor) -> torch.Tensor:
    """Weights [N, K] as panels.c reads them: panels of PANEL columns, each K steps of PANEL elements of 32 bits,
    [ceil(N / PANEL), K, PANEL, 1] for float32; for bfloat16 (K even) K / 2 steps of PANEL pairs (two consecutive k
    of one column), [ceil(N / PANEL), K / 2, PANEL, 2]. Columns past N zero."""
    n, k = codes.shape
    panels, per_element = -(-n // PANEL), 4 // codes.element_size()
    padded = torch.zeros(panels * PANEL, k, dtype=codes.dtype)
    padded[:n] = codes
    return padded.view(panels, PANEL, k // per_element, per_element).transpose(1, 2).contiguous()


def unpack_panels(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """pack_panels undone: the [N, K] rows."""
    n, k = shape
    return packed.transpose(1, 2).reshape(-1, k)[:n]


def panel_rows(packed: torch.Tensor, shape: tuple[int, int], rows: torch.Tensor | slice | None) -> torch.Tensor:
    """Rows of a weight packed by pack_panels (all of them for None): an embedding's lookups gather only theirs."""
    if rows is None or isinstance(rows, slice):
        return unpack_panels(packed, shape)[rows if rows is not None else slice(None)]
    rows = rows.reshape(-1)
    return packed[rows // PANEL, :, rows % PANEL].reshape(len(rows), shape[1])


def _replace(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


class QuantizedLoads:
    """Quantized checkpoint tensors gathered while a model loads (by parameter name and fused shard), then put in
    place: each projection whose shards all came quantized becomes a QuantizedLinear, the embedding a
    QuantizedEmbedding (and a tied LM head a QuantizedLinear over the same weight); any other quantized tensor
    (a fused projection with a shard stored dense, say) is dequantized into its dense parameter."""

    def __init__(self):
        self.pending: dict[str, tuple[int, dict[int, tuple[int, QuantizedWeight]]]] = {}

    def add(self, name: str, shard: int, num_shards: int, row_offset: int, qweight: QuantizedWeight) -> None:
        self.pending.setdefault(name, (num_shards, {}))[1][shard] = (row_offset, qweight)

    def install(self, model: nn.Module) -> None:
        params = dict(model.named_parameters(remove_duplicate=False))
        embed = model.model.embed_tokens
        tied = getattr(model.lm_head, "weight", None) is getattr(embed, "weight", False)
        for name, (num_shards, shards) in self.pending.items():
            path = name.removesuffix(".weight")
            module = model.get_submodule(path)
            whole = len(shards) == num_shards and name.endswith(".weight")
            if whole and isinstance(module, nn.Linear):
                qweight = QuantizedWeight.concat([shards[i][1] for i in range(num_shards)])
                _replace(model, path, QuantizedLinear(qweight, module.bias))
            elif whole and isinstance(module, nn.Embedding):
                qweight = shards[0][1]
                _replace(model, path, QuantizedEmbedding(qweight, module.weight.dtype))
                if tied:
                    model.lm_head = QuantizedLinear(qweight)
            else:
                for offset, qweight in shards.values():
                    params[name].data[offset : offset + qweight.shape[0]].copy_(qweight.dequantize())


def _hold(model: nn.Module, make: Callable[[torch.Tensor], QuantizedWeight]) -> None:
    """Every nn.Linear of a loaded model -> a QuantizedLinear of make(its weight), and each expert's matrices of a
    mixture of experts (petrel/model/moe.py's Experts) make(matrix); the embedding too (rows are its output
    channels), one weight for both where the LM head is tied to it. A MoE router is no nn.Linear: it stays float32."""
    embed = model.model.embed_tokens
    tied = getattr(model.lm_head, "weight", None) is getattr(embed, "weight", False)
    for path, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and not (tied and path == "lm_head"):
            _replace(model, path, QuantizedLinear(make(module.weight), module.bias))
        elif hasattr(module, "hold_experts"):  # a mixture of experts' matrices, each expert's held alike
            module.hold_experts(make)
    if isinstance(embed, nn.Embedding):
        qweight = make(embed.weight)
        model.model.embed_tokens = QuantizedEmbedding(qweight, embed.weight.dtype)
        if tied:
            model.lm_head = QuantizedLinear(qweight)


def quantize_int8(model: nn.Module) -> None:
    """The projections, LM head and embedding as int8 per-row codes (quantization 'int8')."""
    _hold(model, QuantizedWeight.int8_per_channel)


def hold_bf16(model: nn.Module) -> None:
    """The projections, LM head and embedding in bfloat16 (quantization 'bf16'), packed in panels where bfloat16
    products run dpbf16 (gemm_kernels.bf16_panels; the embedding's lookups gather their rows from them)."""
    panels = gemm_kernels.bf16_panels()

    def make(weight: torch.Tensor) -> QuantizedWeight:
        return QuantizedWeight.bfloat16(weight, panels=panels and weight.shape[1] % 2 == 0)

    _hold(model, make)


def hold_f32_panels(model: nn.Module) -> None:
    """A float32 model's projections, LM head and embedding held packed in panels (QuantizedWeight.float32_panels,
    one weight for a tied head and the embedding, whose lookups gather their rows across panels; load_model does it
    where gemm_kernels.f32_panels says so): every count of rows then runs f32_panels_product with no packing a call
    (Zen 4, 2 threads: 1.3-1.5x the row kernel from 4 to 256 rows, level at one). The weights stay float32, the
    products the same sums in another order."""
    _hold(model, QuantizedWeight.float32_panels)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters and quantized weights (their oneDNN copies too), each tensor counted once (tied
    ones too)."""
    seen, total = set(), 0
    for tensor in [
        *model.parameters(),
        *(m.codes for m in model.modules() if isinstance(m, QuantizedWeight)),
        *(t for m in model.modules() if isinstance(m, QuantizedWeight) for t in (m.scale, m.mins)),
    ]:
        if tensor is not None and tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    tiles = {id(m.tiles): m.tiles for m in model.modules() if isinstance(m, QuantizedWeight) and m.tiles is not None}
    return total + sum(t.nbytes for t in tiles.values())
