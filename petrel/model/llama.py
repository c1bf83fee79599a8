"""Llama-family decoder over a flat token batch.

Llama 2/3, SmolLM2 and Mistral (sliding window included), and the families that differ from Llama only by a
config flag: Qwen2 / Qwen2.5 (bias on q, k, v), Qwen3 (RMS norm on each q and k head before rotary). Phi-3 is
Llama with q/k/v and gate/up stored fused in the checkpoint, as petrel holds them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from petrel.model import dense_kernels, triton_attention
from petrel.model.attention import AttentionMetadata, paged_attention, per_layer
from petrel.model.config import ModelConfig
from petrel.model.layers import RMSNorm, RotaryEmbedding, silu_and_mul
from petrel.model.parallel import (
    SHARDED_LAYERS,
    SINGLE,
    AttentionHeads,
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
)
from petrel.model.quantization import QuantizedLinear


class LlamaAttention(nn.Module):
    norm_class = RMSNorm  # of the per-head q/k norms (cfg.qk_norm); Gemma's scales by 1 + weight

    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.sliding_window = cfg.sliding_window(layer)
        self.attention_sinks = cfg.attention_sinks if self.sliding_window is not None else 0  # StreamingLLM's sinks
        heads = AttentionHeads(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, tp)  # this rank's
        self.num_heads, self.num_kv_heads, self.head_dim = heads.num_heads, heads.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, heads.qkv_pieces, heads.qkv_shards, bias=cfg.attention_bias or cfg.qkv_bias
        )
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * cfg.head_dim, heads.o_columns, cfg.hidden_size, bias=cfg.attention_bias, tp=tp
        )
        if cfg.qk_norm:
            self.q_norm = self.norm_class(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = self.norm_class(self.head_dim, cfg.rms_norm_eps)
        self.scale = (cfg.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.sink_logits = None  # [heads] of this rank: a learned logit per head in each softmax (gpt-oss)
        if cfg.sink_logits:
            group = cfg.num_attention_heads // cfg.num_key_value_heads
            self.head_range = (heads.kv_start * group, heads.kv_stop * group)  # this rank's of the checkpoint's
            self.sink_logits = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)

    def forward(self, x, cos_sin, kv_cache, meta: AttentionMetadata):
        qkv = self.qkv_proj(x)
        heads = self.num_heads
        # queries and keys side by side, as [T, heads + kv_heads, head_dim]: one rotary pass for both
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            qk = torch.cat([self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])], dim=1)
        qk = RotaryEmbedding.rotate(qk, cos_sin)
        out = paged_attention(
            qk[:, :heads],
            qk[:, heads:],
            v,
            kv_cache,
            meta,
            self.scale,
            self.sliding_window,
            self.attention_sinks,
            self.sink_logits,
        )
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear.even(
            cfg.hidden_size, [cfg.intermediate_size] * 2, tp, bias=cfg.mlp_bias
        )
        self.down_proj = RowParallelLinear.even(cfg.intermediate_size, cfg.hidden_size, tp, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, tp)

    def forward(self, x, cos_sin, kv_cache, meta):
        if (out := self._decode_in_one_call(x, cos_sin, kv_cache, meta)) is not None:
            return out
        attended = self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta)
        normed, x = self.post_attention_layernorm.add_and_norm(attended, x)
        return x + self.mlp(normed)

    def _decode_in_one_call(self, x, cos_sin, kv_cache, meta: AttentionMetadata):
        """A step of decodes only: the whole layer as one kernel call (dense_kernels.decode_layer: the same kernels
        the separate modules use on CPU, float32 or quantized weights, without a dispatch per operation), when the
        layer is plain — no biases, one rank, no LoRA. None otherwise."""
        if meta.prefills or len(meta.decode_groups) != 1 or (parts := self.one_call_parts()) is None:
            return None
        group = meta.decode_groups[0]
        return dense_kernels.decode_layer(
            x, parts, cos_sin[0], cos_sin[1], kv_cache, meta.slot_mapping, group.block_tables, group.context_lens_t
        )

    def one_call_parts(self) -> dense_kernels.LayerParts | None:
        """What dense_kernels needs of this layer to run it as one call, or None when it is not plain."""
        return self._one_call_parts((self.mlp.gate_up_proj, self.mlp.down_proj))

    def _one_call_parts(self, mlp_projections: tuple) -> dense_kernels.LayerParts | None:
        """LayerParts of the attention and these MLP projections (none: the MLP is not a dense one), or None."""
        attn = self.self_attn
        projections = (attn.qkv_proj, attn.o_proj, *mlp_projections)
        cached = self.__dict__.get("_plain")  # (projections, whether plain), kept while they stay the same
        if (
            cached is None
            or len(cached[0]) != len(projections)
            or any(a is not b for a, b in zip(cached[0], projections))
        ):
            cached = self.__dict__["_plain"] = (projections, self._is_plain(projections))
        if not cached[1]:
            return None
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        weights = tuple(m.qweight if type(m) is QuantizedLinear else m.weight for m in projections)
        biases = (attn.qkv_proj.bias, attn.o_proj.bias)
        return dense_kernels.LayerParts(
            (norm1.weight, norm2.weight),
            norm1.eps,
            weights + (None,) * (4 - len(weights)),
            (attn.num_heads, attn.num_kv_heads, attn.head_dim),
            attn.scale,
            attn.sliding_window,
            (attn.q_norm.weight, attn.k_norm.weight) if hasattr(attn, "q_norm") else None,
            biases=biases if any(b is not None for b in biases) else None,
            sink_logits=attn.sink_logits,
        )

    # whether the one-call kernels take this layer's q/k/v and o biases (LayerParts.biases; gpt-oss's layers: its
    # tests check the kernels' path against the modules'); other layers with biases run their modules
    attention_biases_in_kernels = False

    def _is_plain(self, projections) -> bool:
        dense_kinds = (ColumnParallelLinear, RowParallelLinear, ColumnParallelLinear, RowParallelLinear)
        attn, eps = self.self_attn, self.input_layernorm.eps
        attention_biases = projections[:2] if self.attention_biases_in_kernels else ()
        return (
            all(type(m) in (kind, QuantizedLinear) for m, kind in zip(projections, dense_kinds))
            and all(getattr(m, "tp", SINGLE).size == 1 for m in projections)
            and all(m.bias is None for m in projections if m not in attention_biases)
            and (  # q/k norms (Qwen3): RMS norms with the layer's eps
                not hasattr(attn, "q_norm")
                or (
                    type(attn.q_norm) is RMSNorm
                    and type(attn.k_norm) is RMSNorm
                    and attn.q_norm.eps == eps == attn.k_norm.eps
                )
            )
            and not self.self_attn.attention_sinks  # the kernels know windows and sink logits, not these sinks
            and type(self.input_layernorm) is RMSNorm
            and type(self.post_attention_layernorm) is RMSNorm
            and eps == self.post_attention_layernorm.eps
        )


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE, layer_class: type = LlamaDecoderLayer):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(layer_class(cfg, i, tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    supports_prompt_tuning = True  # forward takes input_embeds
    # checkpoint name fragment -> (fused parameter fragment, shard index)
    fused_shards = {
        ".q_proj.": (".qkv_proj.", 0),
        ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, tp)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        num_layers: int | None = None,
        input_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
        rotary_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Flat batch in ([T] ids and positions), final hidden states out ([T, hidden]).

        num_layers: run only the first layers, then the final norm (early exit, for self-speculation).
        input_embeds: (rows, embeddings [len(rows), hidden]) that replace those rows' token embeddings (prompt
        tuning's virtual tokens). rotary_rows: (rows, cos, sin [len(rows), head_dim / 2]) that replace those rows'
        rotary angles (a request's given M-RoPE table)."""
        x = self.model.embed_tokens(input_ids)
        if input_embeds is not None:
            x[input_embeds[0]] = input_embeds[1].to(x.dtype)
        cos_sin = self.model.rotary.for_positions(positions, x.dtype)
        if rotary_rows is not None:
            rows, cos, sin = rotary_rows
            cos_sin = tuple(t.clone() for t in cos_sin)
            cos_sin[0][rows, 0] = torch.cat([cos, cos], dim=-1).to(x.dtype)  # rotate-half layout: [freqs, freqs]
            cos_sin[1][rows, 0] = torch.cat([sin, sin], dim=-1).to(x.dtype)
        layers = self.model.layers if num_layers is None else self.model.layers[:num_layers]
        if (out := self._step_in_one_call(x, cos_sin, kv_caches, meta, layers)) is not None:
            return self.model.norm(out)
        for layer, kv_cache, layer_meta in zip(layers, kv_caches, per_layer(meta)):
            x = layer(x, cos_sin, kv_cache, layer_meta)
        return self.model.norm(x)

    def __getstate__(self):
        """Copies and pickles leave out the decoder-stack cache (raw pointers into this model's tensors)."""
        state = dict(super().__getstate__())
        state.pop("_decode_stack", None)
        return state

    def _step_in_one_call(self, x, cos_sin, kv_caches, meta, layers) -> torch.Tensor | None:
        """A step of decodes and prompt chunks after them, every layer plain and one KV block table per sequence in
        each KV group (a model whose layers keep different blocks has one metadata a layer, shared by a group's
        layers): the whole decoder stack as one kernel call (dense_kernels.decode_layers); None otherwise (then
        each layer decides for itself; on a device the Triton kernels serve, they run the step)."""
        if triton_attention.serves(x.device):
            return None
        metas = meta[: len(layers)] if isinstance(meta, list) else [meta]
        groups, layer_groups, seen = [], [], {}
        for m in metas:
            if id(m) not in seen:
                if (group := _step_group(m)) is None:
                    return None
                seen[id(m)] = len(groups)
                groups.append(group)
            layer_groups.append(seen[id(m)])
        decodes = {len(g.context_lens) for g in groups}
        if len(decodes) != 1 or len({tuple(row for row, _, _ in g.chunks) for g in groups}) != 1:
            return None

        def build() -> dense_kernels.DecoderStack | None:
            parts = [layer.one_call_parts() for layer in layers]
            return None if None in parts else dense_kernels.DecoderStack.build(parts, kv_caches[: len(layers)])

        if (stack := self._one_call_stack(layers, kv_caches, build)) is None:
            return None
        return stack(x, cos_sin[0], cos_sin[1], groups, layer_groups if len(groups) > 1 else None)

    def _one_call_stack(self, layers, kv_caches, build, enabled: bool = True):
        """The stack build() makes of these layers (None: one call cannot run them), kept while the kernels, the
        caches and the layers' modules stay the same; None while the kernels are off (or not `enabled`), and a
        stack built then is not kept for later."""
        stack = self.__dict__.get("_decode_stack")  # (key, the stack or None)
        key = (
            enabled and dense_kernels.library() is not None,
            len(layers),
            kv_caches[0].data_ptr(),
            layers[0].input_layernorm.weight.data_ptr(),
            _projections(layers),
        )
        if stack is None or stack[0] != key:
            stack = self.__dict__["_decode_stack"] = (key, build() if key[0] else None)
        return stack[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def decoder_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters load_weights fills and checks: all of them (a vision-language model keeps its tower's
        apart)."""
        return dict(self.named_parameters())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the parameters: q/k/v and gate/up into their fused
        projections, and each sharded layer's own slice (see petrel/model/parallel.py). QuantizedWeights (a GGUF
        loaded with quantization 'gguf', one rank only) are gathered by parameter and shard and put in place as
        quantized modules."""
        from petrel.model.quantization import QuantizedLoads, QuantizedWeight

        quantized = QuantizedLoads()
        cfg = self.config
        params = self.decoder_parameters()
        modules = dict(self.named_modules())
        loaded = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            target, piece = self.checkpoint_target(name)
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint for {cfg.architecture}")
            owner, _, kind = target.rpartition(".")
            module = modules[owner]
            if hasattr(module, "piece_keys"):  # experts: dense or quantized, whole or one expert's piece
                loaded.update(f"{target}#{k}" for k in module.load(kind, tensor, piece, name))
                continue
            if isinstance(tensor, QuantizedWeight):
                loaded.update(_add_quantized(quantized, name, target, module, piece, tensor))
                continue
            if isinstance(module, SHARDED_LAYERS):
                pieces = module.load(kind, tensor, piece, name)  # the fused pieces filled (q/k/v, gate/up), or None
                loaded.update([target] if pieces is None else [f"{target}#{i}" for i in pieces])
                continue
            if params[target].shape != tensor.shape:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(params[target].shape)}"
                )
            params[target].data.copy_(tensor)
            loaded.add(target)
        expected = set()
        for pname in params:
            module = modules[pname.rpartition(".")[0]]
            if isinstance(module, ColumnParallelLinear):
                expected.update(f"{pname}#{i}" for i in range(len(module.pieces)))
            elif hasattr(module, "piece_keys"):  # loaded piece by piece (petrel/model/moe.py's experts)
                expected.update(f"{pname}#{i}" for i in module.piece_keys(pname.rpartition(".")[2]))
            else:
                expected.add(pname)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        quantized.install(self)

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        """(parameter name, piece) a checkpoint tensor loads into: q/k/v and gate/up into their fused projections
        (piece: the shard index), anything else into the parameter of its own name (piece None)."""
        for fragment, (fused, shard) in self.fused_shards.items():
            if fragment in name:
                return name.replace(fragment, fused), shard
        return name, None


def _step_group(meta) -> dense_kernels.StepGroup | None:
    """A KV group's metadata as the one-call stack takes it (decode rows in one group, then prompt chunks one after
    another, none a draft tree), or None."""
    if not isinstance(meta, AttentionMetadata) or len(meta.decode_groups) > 1:
        return None
    if any(c.tree_positions is not None for c in meta.prefills):
        return None  # a draft tree: its mask is not causal (the torch path)
    decodes = meta.decode_groups[0].end if meta.decode_groups else 0
    starts, ends = [c.start for c in meta.prefills], [c.start + c.num_tokens for c in meta.prefills]
    if not (decodes or starts) or starts != [decodes, *ends][: len(starts)]:  # chunks one after another
        return None
    if decodes:
        tables, lens = meta.decode_groups[0].block_tables, meta.decode_groups[0].context_lens_t
    else:
        tables = meta.slot_mapping.new_zeros((0, 1), dtype=torch.int64)
        lens = meta.slot_mapping.new_zeros(0, dtype=torch.int64)
    chunks = [(c.start, c.block_table, c.first_pos) for c in meta.prefills]
    return dense_kernels.StepGroup(meta.slot_mapping, tables, lens, chunks)


def _projections(layers: nn.ModuleList) -> tuple:
    """Each layer's attention and MLP modules (and its window): the decoder stack cache's key, so that a module
    replaced after the stack was built (quantized, wrapped for LoRA) makes a new one. Read from the modules' own
    `_modules` dicts: nn.Module's attribute lookup made this walk 8x slower (80 us a step on the default model)."""
    out = []
    for layer in layers._modules.values():
        attn, mlp = layer._modules["self_attn"], layer._modules["mlp"]
        experts = mlp._modules.get("experts")  # a mixture of experts: held again (quantized) means new weights
        out.append(
            (
                *attn._modules.values(),
                *mlp._modules.values(),
                getattr(attn, "sliding_window", None),  # latent attention (DeepSeek) has no window
                getattr(experts, "held", None),
            )
        )
    return tuple(out)


def _add_quantized(quantized, name: str, target: str, module: nn.Module, piece: int | None, qweight) -> list[str]:
    """Queue a quantized checkpoint tensor for `target` (whole, or one fused piece of it); returns what it loaded.
    Quantized weights are kept only unsharded (EngineConfig refuses quantization with tensor parallelism)."""
    pieces = getattr(module, "pieces", None)
    if getattr(getattr(module, "tp", None), "size", 1) > 1 or (pieces and module.out_features != sum(pieces)):
        raise ValueError(f"weight {name!r}: quantized weights cannot be split over tensor-parallel ranks")
    if pieces is not None and piece is not None:
        expected = (pieces[piece], module.in_features)
        quantized.add(target, piece, len(pieces), sum(pieces[:piece]), qweight)
        keys = [f"{target}#{piece}"]
    else:
        expected = tuple(module.weight.shape)
        quantized.add(target, 0, 1, 0, qweight)
        keys = [f"{target}#{i}" for i in range(len(pieces))] if pieces is not None else [target]
    if tuple(qweight.shape) != expected:
        raise ValueError(f"weight {name!r} has shape {tuple(qweight.shape)}, expected {expected}")
    return keys
