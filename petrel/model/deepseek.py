"""DeepSeek-V2 and DeepSeek-V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`) over a flat token batch.

A decoder layer is norm -> multi-head latent attention (petrel/model/mla.py, the KV cache holding one latent row per
token) -> residual -> norm -> MLP -> residual. The MLP is dense in the first layers (first_k_dense_replace) and a
mixture of experts after: petrel's Experts (petrel/model/moe.py: grouped by expert, gate/up, SiLU, down, weighted
sum; moe_kernels' one call per layer) behind DeepSeek's router, plus shared experts every token takes, ungated.

The router (float32, DeepseekRouter): scores softmax(x W^T) (V2) or sigmoid(x W^T) (V3); for choosing, V3 adds
e_score_correction_bias; with groups the experts are split into n_group groups, each scored by its best expert
(V2's group_limited_greedy) or the sum of its best two (V3's noaux_tc), and only the topk_group best groups' experts
compete; the top-k by those scores are taken. Their weights are the unbiased scores, renormalised to sum 1 with
norm_topk_prob, times routed_scaling_factor.

Checkpoints: Hugging Face's names (transformers' DeepseekV2/V3 classes; experts one tensor each or fused 3-D),
kv_b_proj split at load into W_UK and W_UV (or GGUF's attn_k_b / attn_v_b, or its older attn_kv_b), the rotary rows
of q_b_proj / q_proj and kv_a_proj_with_mqa de-interleaved from consecutive pairs to rotate-half order, the
multi-token-prediction layers past num_hidden_layers (V3's layer 61) skipped, and FP8 block-quantized weights
(DeepSeek-V3's published format: float8_e4m3 with a weight_scale_inv per 128 x 128 block) dequantized as they load.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from petrel.model import mla_kernels, triton_attention
from petrel.model.config import ModelConfig
from petrel.model.latent_stack import LatentStack
from petrel.model.layers import RMSNorm
from petrel.model.llama import LlamaMLP, _step_group
from petrel.model.mla import MLAttention
from petrel.model.moe import Experts, MoeForCausalLM, Router, SparseMoeBlock
from petrel.model.parallel import SINGLE, ParallelLMHead, TensorParallel, VocabParallelEmbedding
from petrel.model.yarn import ScaledRotaryEmbedding


class DeepseekRouter(Router):
    """DeepSeek's router (the module's docstring): its weight, and V3's e_score_correction_bias, kept float32."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.num_experts, cfg.hidden_size)
        self.scoring, self.method = cfg.scoring_func, cfg.topk_method
        self.n_group, self.topk_group, self.scaling = cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor
        if self.method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if hasattr(self, "e_score_correction_bias"):
            bias = fn(self.e_score_correction_bias.data).to(torch.float32)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
        return self

    def route(self, x: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)
        scores = torch.softmax(logits, dim=-1) if self.scoring == "softmax" else torch.sigmoid(logits)
        choice = scores + self.e_score_correction_bias if hasattr(self, "e_score_correction_bias") else scores
        if self.method != "greedy" and self.n_group > 1:
            grouped = choice.view(choice.shape[0], self.n_group, -1)
            if self.method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            else:
                group_scores = grouped.max(dim=-1).values
            best = group_scores.topk(self.topk_group, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)
        ids = choice.topk(top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling


class DeepseekMoE(SparseMoeBlock):
    """The routed experts behind DeepseekRouter and the shared experts (n_shared_experts of them as one MLP)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        nn.Module.__init__(self)
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = DeepseekRouter(cfg)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, tp)
        self.tp = tp
        if cfg.shared_expert_intermediate_size:
            self.shared_experts = LlamaMLP(replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size), tp)
        self.register_buffer("routed", torch.zeros(cfg.num_experts, dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate.route(x, self.top_k, self.renormalize)
        out, counts = self.experts(x, ids, weights)
        self.routed += counts.to(self.routed.device)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)
        return out

    def _shared_modules(self) -> tuple:
        """The shared experts' gate/up and down projections, ungated; () without them."""
        if hasattr(self, "shared_experts"):
            return (self.shared_experts.gate_up_proj, self.shared_experts.down_proj, None)
        return ()

    def _router_fields(self) -> dict | None:
        """DeepseekRouter's choices as moe.c's DeepSeek router makes them (kernels.h's moe_layer), or None where it
        cannot: a scoring function or group split it does not know."""
        gate = self.gate
        grouped = gate.method != "greedy" and gate.n_group > 1
        bias = getattr(gate, "e_score_correction_bias", None)
        if (
            gate.scoring not in ("softmax", "sigmoid")
            or gate.scaling <= 0
            or (grouped and gate.weight.shape[0] % gate.n_group)
            or (bias is not None and not (bias.is_cpu and bias.dtype is torch.float32 and bias.is_contiguous()))
        ):
            return None
        return dict(
            sigmoid=int(gate.scoring == "sigmoid"),
            n_group=gate.n_group if grouped else 0,
            topk_group=gate.topk_group if grouped else 0,
            group_top2=int(gate.method == "noaux_tc"),
            choice_bias=None if bias is None else bias.data_ptr(),
            routed_scaling=float(gate.scaling),
        )


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DeepseekMoE(cfg, tp) if cfg.is_moe_layer(layer) else LlamaMLP(cfg, tp)

    def forward(self, x, cos_sin, kv_cache, meta):
        attended = self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta)
        normed, x = self.post_attention_layernorm.add_and_norm(attended, x)
        return x + self.mlp(normed)


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary = ScaledRotaryEmbedding(
            cfg.qk_rope_head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, i, tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_ROTARY_ROWS = (
    ".self_attn.q_b_proj.weight",
    ".self_attn.q_proj.weight",
    ".self_attn.kv_a_proj_with_mqa.weight",
    ".self_attn.kv_a_proj_with_mqa.bias",
)


class DeepseekForCausalLM(MoeForCausalLM):
    """DeepSeek-V2 and V3 (the config says which router, which layers are dense, the rotary scaling)."""

    supports_prompt_tuning = True
    fused_shards = {".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1)}  # q/k/v stay apart

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        nn.Module.__init__(self)
        self.config = cfg
        self.model = DeepseekModel(cfg, tp)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _step_in_one_call(self, x, cos_sin, kv_caches, meta, layers):
        """A step of decode rows only, one KV block table per sequence: every layer in one kernel call
        (latent_stack.LatentStack); None otherwise (prompt chunks decompress the latent: the layers' modules)."""
        if triton_attention.serves(x.device) or (group := _step_group(meta)) is None or group.chunks:
            return None
        stack = self._one_call_stack(
            layers,
            kv_caches,
            lambda: LatentStack.build(list(layers), kv_caches[: len(layers)]),
            mla_kernels.enabled(),  # PETREL_MLA_KERNEL=0: the layers' modules
        )
        if stack is None:
            return None
        return stack(x, cos_sin[0], cos_sin[1], group.slots, group.block_tables, group.context_lens)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._checkpoint_tensors(weights))

    def _checkpoint_tensors(self, weights) -> Iterator[tuple[str, object]]:
        """The checkpoint's tensors as this model's parameters take them (see the module's docstring)."""
        from petrel.model.fp8_blocks import dequantize_fp8_blocks

        cfg = self.config
        heads, nope, rope, v_dim = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        for name, tensor in dequantize_fp8_blocks(weights):
            layer = _LAYER.match(name)
            if layer is not None and int(layer.group(1)) >= cfg.num_hidden_layers:
                continue  # multi-token prediction layers: petrel predicts one token a step
            if name.endswith(".self_attn.kv_b_proj.weight"):
                kv_b = _dense(tensor).view(heads, nope + v_dim, -1)
                yield name.replace(".weight", ".w_uk"), kv_b[:, :nope].contiguous()
                yield name.replace(".weight", ".w_uv"), kv_b[:, nope:].contiguous()
                continue
            if name.endswith(".self_attn.k_b_proj.weight"):  # GGUF's attn_k_b: [heads, rank, nope]
                yield name.replace("k_b_proj.weight", "kv_b_proj.w_uk"), _dense(tensor).transpose(1, 2).contiguous()
                continue
            if name.endswith(".self_attn.v_b_proj.weight"):  # GGUF's attn_v_b: [heads, v, rank]
                yield name.replace("v_b_proj.weight", "kv_b_proj.w_uv"), _dense(tensor).contiguous()
                continue
            if cfg.rope_interleave and name.endswith(_ROTARY_ROWS):
                tensor = _deinterleave_rotary(name, tensor, heads, nope, rope)
            yield name, tensor


def _dense(tensor) -> torch.Tensor:
    """A float tensor of a checkpoint tensor (a GGUF's blocks dequantized)."""
    return tensor if isinstance(tensor, torch.Tensor) else tensor.dequantize()


def _deinterleave_rotary(name: str, tensor, heads: int, nope: int, rope: int):
    """The rows of a query projection (each head's nope rows, then its rope rows) or of kv_a_proj_with_mqa (the
    latent's rows, then the rotary key's) with every rope slice's consecutive pairs (x0, x1), (x2, x3), ...
    reordered to rotate-half's (x0, x2, ..., x1, x3, ...)."""
    rows = tensor.shape[0]
    order = torch.arange(rows)
    pairs = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    if "kv_a_proj_with_mqa" in name:
        order[rows - rope :] = rows - rope + pairs
    else:
        qk = nope + rope
        for h in range(heads):
            order[h * qk + nope : (h + 1) * qk] = h * qk + nope + pairs
    if isinstance(tensor, torch.Tensor):
        return tensor[order].contiguous()
    return tensor.permute_rows(order.numpy())
