"""Mixture-of-experts decoders over a flat token batch: Mixtral, Qwen2-MoE and Qwen3-MoE (and gpt-oss's layers:
petrel/model/gpt_oss.py).

Each is petrel's Llama decoder (petrel/model/llama.py; Qwen2-MoE with bias on q, k, v, Qwen3-MoE with per-head q/k
norms) whose sparse layers replace the MLP by a SparseMoeBlock, the one MoE layer all three use:
  router   logits = x @ W_router^T, softmax, the top-k experts of each token (their probabilities renormalised to sum
           1 where the family says so: Mixtral always, the Qwens with norm_topk_prob), all in float32 whatever the
           weights' dtype (Router keeps its weight float32 through model.to(dtype));
  experts  the step's rows grouped by expert (a count and an offset per expert, one gather of x), each used expert's
           gate/up product, SiLU-and-multiply and down product over its rows, and each result scaled by its routing
           weight and added back into its token's row (Experts);
  shared   Qwen2-MoE only: a dense MLP every token takes, scaled by sigmoid(shared_expert_gate(x)).
gpt-oss's variant (ModelConfig's router_bias, routing, expert_bias, expert_activation): a bias on the router's
logits, the top-k logits taken first and a softmax over those k, a bias after each expert's gate/up and down
products, and the clamped SwiGLU in place of SiLU-and-multiply.
Qwen2-MoE's dense layers (mlp_only_layers, decoder_sparse_step) keep Llama's MLP.

Checkpoints: the published layout with one tensor per expert and projection (Mixtral's block_sparse_moe.experts.E.w1
/ w3 / w2, the Qwens' mlp.experts.E.gate_proj / up_proj / down_proj) and the fused 3-D layout transformers 5 holds
and writes with save_pretrained(save_original_format=False) (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.
down_proj [E, H, I]); GGUF files through petrel/model/loader.py.

On the CPU a step's decoder stack runs as one kernel call (dense_kernels.DecoderStack, moe.c's moe_mlp for the MoE
layers: the router, top-k and the experts in C) where every layer is plain (no biases, one rank); otherwise each
layer runs its modules, its experts in moe_kernels' one call per layer (the torch loop below where the kernels
cannot run: the same sums).
"""

from __future__ import annotations

import ctypes
import re
import sys
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from petrel.model import dense_kernels, moe_kernels
from petrel.model.config import ModelConfig
from petrel.model.layers import Linear, RMSNorm, silu_and_mul
from petrel.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from petrel.model.parallel import SINGLE, ParallelLMHead, TensorParallel, partition
from petrel.model.quantization import QuantizedLinear


class Router(nn.Module):
    """The router's weight [experts, hidden] (and bias [experts], gpt-oss's), float32 through model.to(dtype): routing
    (softmax and top-k, discrete choices) is computed in float32 whatever the rest of the model holds. routing:
    "softmax_topk" (a softmax over every expert, then the top k) or "topk_softmax" (the top k logits, then a softmax
    over those k: gpt-oss)."""

    def __init__(self, num_experts: int, hidden_size: int, bias: bool = False, routing: str = "softmax_topk"):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False) if bias else None
        self.routing = routing

    def _apply(self, fn, recurse=True):
        self.weight = nn.Parameter(fn(self.weight.data).to(torch.float32), requires_grad=False)
        if self.bias is not None:
            self.bias = nn.Parameter(fn(self.bias.data).to(torch.float32), requires_grad=False)
        return self

    def route(self, x: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, top_k] int64, routing weights [T, top_k] float32) of each row of x [T, hidden]."""
        logits = F.linear(x.float(), self.weight, self.bias)
        if self.routing == "topk_softmax":
            top, ids = torch.topk(logits, top_k, dim=-1)
            return ids, torch.softmax(top, dim=-1)
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights


class Experts(nn.Module):
    """The experts of one MoE layer: gate_up_proj [E, 2I, H] (each expert's gate rows, then its up rows) and
    down_proj [E, H, I], this rank's share of them (tp: every expert's slice of I; with tp.expert_parallel: whole
    experts, E / ranks of them, from `first`).

    After loading, the weights may be held per expert as QuantizedWeights (`held`, a list of [gate_up, down] pairs;
    the dense parameters then go): a GGUF's quantized blocks, a checkpoint's MXFP4 blocks, or what
    quantization.hold_f32_panels, hold_bf16 and quantize_int8 make of each expert's matrices (hold_experts).

    bias (gpt-oss): gate_up_bias [E, 2I] (this rank's columns, as gate_up_proj's rows) added after the gate/up
    product, down_bias [E, H] after the down product (kept by one rank only where the ranks split I: their partial
    sums are added up). activation: "silu" (silu(gate) * up) or "swiglu_clamped" (ModelConfig's)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        tp: TensorParallel = SINGLE,
        bias: bool = False,
        activation: str = "silu",
        alpha: float = 1.702,
        limit: float = 7.0,
    ):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.tp = tp
        self.activation, self.alpha, self.limit = activation, alpha, limit
        if getattr(tp, "expert_parallel", False):
            self.first, last = partition(num_experts, tp.size, tp.rank)
            self.columns = (0, intermediate_size)
        else:
            self.first, last = 0, num_experts
            self.columns = partition(intermediate_size, tp.size, tp.rank)
        self.num_local = last - self.first
        inter = self.columns[1] - self.columns[0]
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_local, 2 * inter, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(self.num_local, hidden_size, inter), requires_grad=False)
        self.gate_up_bias = self.down_bias = None
        if bias:
            self.gate_up_bias = nn.Parameter(torch.zeros(self.num_local, 2 * inter), requires_grad=False)
            self.down_bias = nn.Parameter(torch.zeros(self.num_local, hidden_size), requires_grad=False)
        self.held: nn.ModuleList | None = None
        self._quantized: dict = {}  # (kind, local expert, part) -> QuantizedWeight, while loading

    def __getstate__(self):
        """Copies and pickles leave out the kernel's cached description (raw pointers into these weights)."""
        state = dict(super().__getstate__())
        state.pop("_described", None)
        return state

    @property
    def local_intermediate(self) -> int:
        return self.columns[1] - self.columns[0]

    # ---------------------------------------------------------------- loading

    def piece_keys(self, kind: str) -> list[str]:
        """What a full load of parameter `kind` consists of: every expert's gate and up (their matrices or biases), or
        every expert's down."""
        if kind in ("gate_up_proj", "gate_up_bias"):
            return [f"{e}.{p}" for e in range(self.num_experts) for p in (0, 1)]
        return [str(e) for e in range(self.num_experts)]

    def load(self, kind: str, tensor, piece: tuple[int | None, int | None], name: str) -> list[str]:
        """Load a checkpoint tensor of `kind` (gate_up_proj or down_proj): piece (expert, part) says which, expert
        None for all of them stacked on a first dimension, part 0 / 1 for gate / up alone (None: gate_up whole, or
        down). Keeps this rank's experts and columns; returns the piece keys loaded (piece_keys)."""
        from petrel.model.quantization import QuantizedWeight

        expert, part = piece
        experts = range(self.num_experts) if expert is None else [expert]
        parts = ([0, 1] if part is None else [part]) if kind in ("gate_up_proj", "gate_up_bias") else [None]
        keys = [f"{e}.{p}" if p is not None else str(e) for e in experts for p in parts]
        inter, hidden = self.intermediate_size, self.hidden_size
        rows = {
            "gate_up_proj": (inter * len(parts), hidden),
            "down_proj": (hidden, inter),
            "gate_up_bias": (inter * len(parts),),
            "down_bias": (hidden,),
        }[kind]
        expected = rows if expert is not None else (self.num_experts, *rows)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
        split = self.tp.size > 1 and not getattr(self.tp, "expert_parallel", False)
        if isinstance(tensor, QuantizedWeight) and split:  # each rank keeps its columns of the dequantized matrix
            tensor = tensor.dequantize()
        if isinstance(tensor, QuantizedWeight):  # one expert's matrix, kept as it is until every piece is in
            if expert is None:
                raise ValueError(f"weight {name!r}: quantized experts load one expert at a time")
            if self.local(expert) is not None:
                self._quantized[(kind, self.local(expert), part)] = tensor
            return keys
        stacked = tensor if expert is not None else None
        for e in experts:
            local = self.local(e)
            if local is None:
                continue
            matrix = stacked if stacked is not None else tensor[e]
            self._copy(kind, local, part, matrix.to(torch.float32))
        return keys

    def local(self, expert: int) -> int | None:
        """This rank's index of a global expert, or None where another rank holds it."""
        local = expert - self.first
        return local if 0 <= local < self.num_local else None

    def _copy(self, kind: str, local: int, part: int | None, matrix: torch.Tensor) -> None:
        c0, c1 = self.columns
        inter = self.intermediate_size
        if kind == "down_proj":
            self.down_proj.data[local].copy_(matrix[:, c0:c1])
            return
        if kind == "down_bias":  # added once: by the first rank where the ranks' partial sums are added up
            split = self.tp.size > 1 and not getattr(self.tp, "expert_parallel", False)
            self.down_bias.data[local].copy_(matrix if not split or self.tp.rank == 0 else torch.zeros_like(matrix))
            return
        target = self.gate_up_proj if kind == "gate_up_proj" else self.gate_up_bias
        width = c1 - c0
        for p, rows in zip([0, 1] if part is None else [part], matrix.split(inter) if part is None else [matrix]):
            target.data[local, p * width : (p + 1) * width].copy_(rows[c0:c1])

    def finish_loading(self) -> None:
        """After every tensor is in: quantized experts held as they came (each expert's gate and up fused), where
        every piece of every local expert came quantized; otherwise any quantized piece dequantized into the dense
        parameters."""
        from petrel.model.quantization import QuantizedWeight

        pending, self._quantized = self._quantized, {}
        if not pending:
            return
        needed = [(k, e, p) for e in range(self.num_local) for k, p in (("gate_up_proj", 0), ("gate_up_proj", 1))]
        needed += [("down_proj", e, None) for e in range(self.num_local)]
        if all(key in pending for key in needed) and self.tp.size == 1:
            held = [
                nn.ModuleList(
                    [
                        QuantizedWeight.concat([pending[("gate_up_proj", e, 0)], pending[("gate_up_proj", e, 1)]]),
                        pending[("down_proj", e, None)],
                    ]
                )
                for e in range(self.num_local)
            ]
            self._set_held(held)
            return
        for (kind, e, part), qweight in pending.items():
            self._copy(kind, e, part, qweight.dequantize())

    def hold_experts(self, make) -> None:
        """Each expert's gate_up and down matrices as make(matrix) (a QuantizedWeight: quantization.py's _hold);
        experts already held (a GGUF's blocks) stay as they are."""
        if self.held is not None:
            return
        self._set_held(
            [nn.ModuleList([make(self.gate_up_proj[e]), make(self.down_proj[e])]) for e in range(self.num_local)]
        )

    def _set_held(self, held: list[nn.ModuleList]) -> None:
        self.held = nn.ModuleList(held)
        del self.gate_up_proj, self.down_proj

    # ---------------------------------------------------------------- computing

    def expert_weights(self, local: int) -> tuple:
        """(gate_up, down) of a local expert: QuantizedWeights when held, else the dense [2I, H] and [H, I] rows."""
        if self.held is not None:
            pair = self.held[local]
            return pair[0], pair[1]
        return self.gate_up_proj[local], self.down_proj[local]

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H]; ids, weights [T, k] (the router's). Returns (this rank's sum over each token's experts of
        weight * expert(x) [T, H] in x's dtype, tokens per expert [E] int64 over all experts)."""
        flat = ids.reshape(-1)
        counts = torch.bincount(flat, minlength=self.num_experts)
        out = moe_kernels.experts(self, x, ids, weights)
        if out is not None:
            return out, counts
        return self._forward_torch(x, flat, weights.reshape(-1), counts, ids.shape[1]), counts

    def _forward_torch(self, x, flat, weights, counts, top_k) -> torch.Tensor:
        """The grouped computation in torch operations, one expert after another (the kernels' fallback)."""
        order = torch.argsort(flat, stable=True)  # the step's (token, pick) slots grouped by expert
        ends = torch.cumsum(counts, 0).tolist()
        lo, hi = (ends[self.first - 1] if self.first else 0), ends[self.first + self.num_local - 1]
        order = order[lo:hi]  # this rank's experts' slots
        tokens = order // top_k
        xs = x[tokens]  # one gather
        ys = torch.empty_like(xs)
        row = 0
        for local, n in enumerate(counts[self.first : self.first + self.num_local].tolist()):
            if n:
                ys[row : row + n] = self.expert(local, xs[row : row + n])
                row += n
        ys.mul_(weights[order].unsqueeze(1).to(ys.dtype))
        return torch.zeros_like(x).index_add_(0, tokens, ys)

    def expert(self, local: int, x: torch.Tensor) -> torch.Tensor:
        """One local expert over its rows: down(silu(gate(x)) * up(x)) (or the clamped SwiGLU, and the biases), in x's
        dtype."""
        gate_up, down = self.expert_weights(local)
        h = gate_up.matmul(x) if not isinstance(gate_up, torch.Tensor) else x @ gate_up.t()
        if self.gate_up_bias is not None:
            h = h + self.gate_up_bias[local].to(h.dtype)
        act = self.activate(h.contiguous())
        y = down.matmul(act) if not isinstance(down, torch.Tensor) else act.to(x.dtype) @ down.t()
        if self.down_bias is not None:
            y = y + self.down_bias[local].to(y.dtype)
        return y.to(x.dtype)

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[rows, 2I] gate then up -> [rows, I]: silu(gate) * up, or the clamped SwiGLU (gpt-oss's)."""
        if self.activation == "silu":
            return silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class SparseMoeBlock(nn.Module):
    """The MoE layer (see the module's docstring): router, experts and Qwen2-MoE's gated shared expert. Each call
    adds its rows' picks to `routed` (int64 tokens per expert, for the engine's statistics: MoeForCausalLM.
    take_expert_load reads and clears them; the one-call decoder stack adds to the same buffer)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Router(cfg.num_experts, cfg.hidden_size, cfg.router_bias, cfg.routing)
        self.experts = Experts(
            cfg.num_experts,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            tp,
            cfg.expert_bias,
            cfg.expert_activation,
            cfg.swiglu_alpha,
            cfg.swiglu_limit,
        )
        self.tp = tp
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size), tp)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)
        self.register_buffer("routed", torch.zeros(cfg.num_experts, dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate.route(x, self.top_k, self.renormalize)
        out, counts = self.experts(x, ids, weights)
        self.routed += counts.to(self.routed.device)
        out = self.tp.all_reduce(out)  # each rank's experts (or slices of every expert): partial sums
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def __getstate__(self):
        """Copies and pickles leave out the kernels' cached description (raw pointers into these weights)."""
        state = dict(super().__getstate__())
        state.pop("_kernel_parts", None)
        return state

    def kernel_parts(self) -> dense_kernels.MoeParts | None:
        """The block as the one-call decoder layer and stack take it in place of a dense MLP (dense_kernels.
        MoeParts: router, experts as moe_kernels describes them, the routed counter, the shared expert), or None
        where they cannot: split over ranks, on another device, a bias, weights the kernels do not take. Built
        once and kept while the weights and the CPU switches they depend on stay the same."""
        shared = self._shared_modules()
        biases = [b for b in (self.gate.bias, self.experts.gate_up_bias, self.experts.down_bias) if b is not None]
        key = (
            moe_kernels.enabled(),  # PETREL_MOE_KERNEL=0: the experts in torch, decode steps too
            moe_kernels.Described.key(self.experts),
            self.routed.data_ptr(),
            self.gate.weight.data_ptr(),
            shared,
            tuple((b.data_ptr(), b.dtype) for b in biases),
        )
        cached = self.__dict__.get("_kernel_parts")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_kernel_parts"] = (key, self._build_kernel_parts(shared))
        return cached[1]

    def _shared_modules(self) -> tuple:
        """The shared expert's gate/up and down projections and its gate (None: added ungated); () without one."""
        if hasattr(self, "shared_expert"):
            return (self.shared_expert.gate_up_proj, self.shared_expert.down_proj, self.shared_expert_gate)
        return ()

    def _router_fields(self) -> dict | None:
        """MoeLayer's fields for a router other than Router's softmax / top-k ones (none here), or None where the
        kernels cannot route as this block does."""
        return {}

    def _build_kernel_parts(self, shared: tuple) -> dense_kernels.MoeParts | None:
        experts, router, router_bias = self.experts, self.gate.weight, self.gate.bias
        if (
            (router_bias is not None and not (router_bias.is_cpu and router_bias.dtype is torch.float32))
            or (act := moe_kernels.activation(experts)) is None
            or self.tp.size > 1
            or not (router.is_cpu and router.dtype is torch.float32 and router.is_contiguous())
            or not self.routed.is_cpu
            or experts.local_intermediate % 16
            or not moe_kernels.enabled()
            or dense_kernels.library() is None
        ):
            return None
        described = moe_kernels.Described(experts)
        router_fields = self._router_fields()
        if router_fields is None or not described.ok or any(getattr(m, "bias", None) is not None for m in shared):
            return None
        shared_weights = [
            None if m is None else m.qweight if isinstance(m, QuantizedLinear) else m.weight for m in shared
        ]
        shared_described = [dense_kernels.Weight() if w is None else dense_kernels.describe(w) for w in shared_weights]
        if None in shared_described:
            return None
        inter = shared[1].in_features if shared else 0
        if inter % 16:
            return None
        layer = dense_kernels.MoeLayer(
            router.data_ptr(),
            ctypes.addressof(described.gate_up),
            ctypes.addressof(described.down),
            self.routed.data_ptr(),
            experts.num_experts,
            self.top_k,
            int(self.renormalize),
            experts.first,
            experts.num_local,
            experts.local_intermediate,
            *(shared_described or [dense_kernels.Weight()] * 3),
            inter,
            None if router_bias is None else router_bias.data_ptr(),
            int(self.gate.routing == "topk_softmax"),
            act,
            **router_fields,
        )
        present = [w for w in shared_weights if w is not None]
        max_rows = min(described.max_rows, moe_kernels.max_rows(present) if present else sys.maxsize)
        keep = (described, self.gate, router_bias, experts.gate_up_bias, experts.down_bias, self.routed, *present)
        return dense_kernels.MoeParts(layer, keep, max_rows)


class MoeDecoderLayer(LlamaDecoderLayer):
    """Llama's decoder layer with a SparseMoeBlock as its MLP, unless the config keeps this layer dense."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel = SINGLE):
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoeBlock(cfg, tp) if cfg.is_moe_layer(layer) else LlamaMLP(cfg, tp)

    def one_call_parts(self) -> dense_kernels.LayerParts | None:
        """A MoE layer as one kernel call: Llama's attention and the block's kernel_parts, or None."""
        if not isinstance(self.mlp, SparseMoeBlock):
            return super().one_call_parts()
        if (moe := self.mlp.kernel_parts()) is None or (parts := self._one_call_parts(())) is None:
            return None
        return parts._replace(moe=moe)


# checkpoint names of one expert's matrices -> (petrel parameter, part: 0 gate, 1 up, None whole)
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_PART = {
    "w1": ("gate_up_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "w3": ("gate_up_proj", 1),
    "up_proj": ("gate_up_proj", 1),
    "w2": ("down_proj", None),
    "down_proj": ("down_proj", None),
}
# every expert's matrices stacked [E, ...]: transformers' fused layout, and GGUF's separate gate and up
_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|gate_proj|up_proj|down_proj)$")
_STACKED_PART = {"gate_up_proj": None, "gate_proj": 0, "up_proj": 1, "down_proj": None}


class MoeForCausalLM(LlamaForCausalLM):
    """Mixtral, Qwen2-MoE and Qwen3-MoE (the config says which layers are sparse, whether there is a shared expert,
    how routing weights are normalised; the attention's biases and norms are Llama's flags)."""

    supports_prompt_tuning = True

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        nn.Module.__init__(self)
        self.config = cfg
        self.model = LlamaModel(cfg, tp, layer_class=MoeDecoderLayer)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _step_in_one_call(self, x, cos_sin, kv_caches, meta, layers):
        """Llama's one-call decoder stack, its MoE layers' experts in C too; not with the experts' kernel switched
        off (PETREL_MOE_KERNEL=0: every layer's modules, the experts in the torch loop)."""
        return super()._step_in_one_call(x, cos_sin, kv_caches, meta, layers) if moe_kernels.enabled() else None

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        """Experts' tensors into their layer's Experts (piece: (expert or None, part)); Mixtral's block_sparse_moe
        is the others' mlp; everything else as Llama's."""
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if (m := _EXPERT.match(name)) is not None:
            kind, part = _EXPERT_PART[m.group(3)]
            return f"{m.group(1)}.{kind}", (int(m.group(2)), part)
        if (m := _STACKED.match(name)) is not None:
            kind = "down_proj" if m.group(2) == "down_proj" else "gate_up_proj"
            return f"{m.group(1)}.{kind}", (None, _STACKED_PART[m.group(2)])
        return super().checkpoint_target(name)

    def load_weights(self, weights) -> None:
        super().load_weights(weights)
        for module in self.modules():
            if isinstance(module, Experts):
                module.finish_loading()

    def moe_blocks(self) -> list[SparseMoeBlock | None]:
        """Each layer's MoE block (None for a dense layer)."""
        return [layer.mlp if isinstance(layer.mlp, SparseMoeBlock) else None for layer in self.model.layers]

    def take_expert_load(self) -> dict[int, list[int]] | None:
        """Tokens routed to each expert of each MoE layer (by layer index) by the forwards since the last call,
        which clears them; None when none routed a token. With tensor or expert parallelism every rank routes every
        token, so rank 0's counts are the whole model's."""
        blocks = [(i, b) for i, b in enumerate(self.moe_blocks()) if b is not None]
        load = {i: b.routed.tolist() for i, b in blocks}
        if not any(any(counts) for counts in load.values()):
            return None
        for _, b in blocks:
            b.routed.zero_()
        return load
