"""The model runner owns tensors and nothing else: a scheduled batch in, logits for the rows that need them out."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from petrel.config import kv_cache_budget
from petrel.engine.block_manager import FREED
from petrel.engine.decode_graphs import capture_decode_graphs, graphs_supported
from petrel.engine.draft_tree import DraftTree
from petrel.engine.encoder_cache import DEFAULT_ENCODER_CACHE_MEMORY, EncoderCache
from petrel.engine.kv_groups import KVGroups, single_group
from petrel.engine.prompt_tuning import virtual_token_embeddings
from petrel.engine.scheduler import ScheduledBatch
from petrel.engine.sequence import Sequence
from petrel.model import dense_kernels
from petrel.model.attention import AttentionMetadata, DecodeGroup, PrefillChunk, new_kv_cache
from petrel.model.config import ModelConfig
from petrel.model.kv_layout import kv_layout_of
from petrel.model.parallel import SINGLE, TensorParallel
from petrel.multimodal.inputs import MultiModalInputs
from petrel.multimodal.mrope import span_positions


@dataclass
class QuerySpan:
    """Consecutive tokens of one sequence to run through the model: their ids, first position, block table
    (group 0's; group_tables: every KV group's, when the runner has more than one group); embedding_table: the
    request's prompt-tuning table, which ids >= vocab_size index (petrel/engine/prompt_tuning.py)."""

    token_ids: list[int]
    start: int
    block_table: list[int]
    group_tables: list[list[int]] | None = None
    embedding_table: torch.Tensor | None = None
    multi_modal: MultiModalInputs | None = None  # the prompt's images, whose rows take encoder outputs
    rope_inputs: MultiModalInputs | None = None  # the request's media, for multimodal rotary positions (M-RoPE)
    given_positions: list[int] | None = None  # the tokens' rotary positions when the request gave them (else indices)
    # the tokens after the first are a tree of drafts (lookahead decoding): token k is the tree's node k, at cache
    # slot start + k but position (the root's) + its depth, seeing the context and its own ancestors only
    tree: DraftTree | None = None

    @property
    def positions(self) -> list[int]:
        """The tokens' positions: the request's own (given_positions) or consecutive from start; for a draft tree,
        the root's and each draft node's (the root's + its depth)."""
        if self.tree is None:
            if self.given_positions is not None:
                return self.given_positions
            return list(range(self.start, self.start + len(self.token_ids)))
        root = self.given_positions[0] if self.given_positions is not None else self.start
        return [root] + [root + d for d in self.tree.depths]

    @staticmethod
    def of(seq: Sequence, token_ids: list[int], start: int) -> QuerySpan:
        tables = seq.block_tables
        in_prompt = start < seq.num_prompt_tokens
        table = seq.params.prompt_embedding_table if in_prompt else None
        media = seq.request.multi_modal if in_prompt else None
        rope = seq.request.multi_modal
        positions = seq.request.position_of(start, len(token_ids))
        return QuerySpan(
            token_ids, start, tables[0], tables if len(tables) > 1 else None, table, media, rope, positions
        )


@dataclass
class ForwardPlan:
    """One forward pass as plain data: what every tensor-parallel rank needs to run the same pass (it is sent to
    the worker processes each step), and all the single-process runner needs too."""

    spans: list[QuerySpan]  # decodes (single-token spans) first
    logits_rows: list[int]  # rows of the flat batch whose logits are wanted
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    num_layers: int | None = None  # early exit after this many layers (self-speculation)
    # (source, destination) flat cache slots whose K/V are copied before the pass, in every layer: a draft tree's
    # accepted nodes brought to their positions' slots (a plan of copies alone runs no model)
    slot_copies: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class ContextRows:
    """Outputs of a span of prompt positions of one sequence (for prompt logprobs and context outputs)."""

    seq: Sequence
    first: int  # prompt position of the first row
    logits: torch.Tensor | None  # [k, vocab] float32, when logits are asked for
    hidden: torch.Tensor | None  # [k, hidden], when hidden states are asked for


@dataclass
class StepLogits:
    sample_seqs: list[Sequence]  # sequences that reached their last token and sample next
    sample_logits: torch.Tensor | None  # [rows, vocab] float32: one row per sample sequence, 1 + k when it
    first_rows: list[int] = field(default_factory=list)  # verifies k draft tokens; each sequence's first row
    context_rows: list[ContextRows] = field(default_factory=list)
    sample_hidden: torch.Tensor | None = None  # rows as sample_logits, when a sampling sequence asks for it


class ExecutorDied(RuntimeError):
    """The model executor can run no more steps (a tensor-parallel worker died, or a step failed part-way and the
    ranks are out of step): the engine stops and reports it, instead of failing each later step."""


DECODE_GROUP_SIZE = 16  # decodes attended per call by the torch path: fewer calls vs. less padding read


def keep_freed_memory_in_heap() -> None:
    """Tell glibc to keep large freed buffers instead of returning them to the OS. Each step allocates
    tens of MB of temporaries; handed back and faulted in again every step, those page faults cost
    about as much as the decode step itself on CPU."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)


def kv_bytes_per_block(
    cfg: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    tensor_parallel_size: int = 1,
    layers_per_block: int | None = None,
) -> int:
    """Bytes of one cache block on the rank holding the most KV heads (all of them with one rank). A block id
    holds layers_per_block layers' KV (KVGroups.layers_per_block; default: every layer)."""
    layout = kv_layout_of(cfg, TensorParallel(0, tensor_parallel_size), widest=True)
    layers = cfg.num_hidden_layers if layers_per_block is None else layers_per_block
    return block_size * layout.bytes_per_token(layers, dtype)


def num_kv_blocks(config, cfg: ModelConfig, layers_per_block: int | None = None) -> int:
    """Cache blocks that the KV budget (kv_cache_budget: per rank) holds: every rank computes the same number."""
    return kv_cache_budget(config) // kv_bytes_per_block(
        cfg, config.block_size, config.kv_cache_torch_dtype, config.tensor_parallel_size, layers_per_block
    )


def _mrope_positions(span: QuerySpan) -> torch.Tensor:
    """A span's multimodal rotary positions [3, n]; a draft tree's nodes take those of their depths."""
    if span.tree is None:
        return span_positions(span.rope_inputs, span.start, len(span.token_ids))
    deep = span_positions(span.rope_inputs, span.start, 1 + max(span.tree.depths))
    return deep[:, [0] + span.tree.depths]


def given_rotary_rows(spans: list[QuerySpan], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(rows of the flat batch, their cos, their sin [rows, head_dim / 2]) for the prompt tokens whose rotary table a
    request gave (Executor Request.mrope_config: MultiModalInputs.rope_cos_sin), or None when no span has any."""
    rows, tables, row = [], [], 0
    for span in spans:
        table = getattr(span.rope_inputs, "rope_cos_sin", None)  # [prompt length, head_dim / 2, 2]
        n = len(span.token_ids)
        if table is not None and span.start < table.shape[0]:
            k = min(n, table.shape[0] - span.start)
            rows.append(torch.arange(row, row + k))
            tables.append(table[span.start : span.start + k])
        row += n
    if not rows:
        return None
    given = torch.cat(tables).to(device)
    return torch.cat(rows).to(device), given[..., 0], given[..., 1]


def _readable(block_table: list[int], sink_blocks: int = 0) -> list[int]:
    """The table with its FREED entries (blocks given back behind the sliding window: a prefix, or a run after the
    sink_blocks kept for attention sinks) pointing at block 0: attention reads those columns masked at most (zero
    weight), so any valid block id will do."""
    if block_table and (
        block_table[0] == FREED
        or (sink_blocks and len(block_table) > sink_blocks and block_table[sink_blocks] == FREED)
    ):
        return [max(b, 0) for b in block_table]
    return block_table


class ModelRunner:
    """The single-process model executor (and each tensor-parallel rank's: see petrel/distributed/runner.py)."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str,
        lora_manager=None,
        tp: TensorParallel = SINGLE,
        kv_groups: KVGroups | None = None,
        encoder_cache_memory: int = DEFAULT_ENCODER_CACHE_MEMORY,
        cuda_graph_batch_sizes: list[int] | None = None,
        max_model_len: int | None = None,
        kv_cache_dtype: torch.dtype | None = None,
    ):
        """kv_groups: the layers' block tables (petrel/engine/kv_groups.py); default one table for all.
        encoder_cache_memory: bytes of a vision-language model's encoder outputs kept for reuse.
        cuda_graph_batch_sizes: decode batch sizes to capture as CUDA graphs (petrel/engine/decode_graphs.py), where
        the model and device allow; max_model_len bounds their block tables. kv_cache_dtype: what the cache holds
        (EngineConfig.kv_cache_torch_dtype; default dtype, the activations')."""
        if torch.device(device).type == "cpu":
            keep_freed_memory_in_heap()
        self.model = model
        self.cfg = cfg
        self.dtype = dtype  # the activations'
        self.encoder_cache = EncoderCache(encoder_cache_memory)
        self.lora_manager = lora_manager  # petrel.model.lora.LoRAManager with enable_lora
        self.block_size = block_size
        self.device = torch.device(device)
        # petrel's CPU kernel attends each decode row over its own length, so one group of all the step's decodes
        # costs no padding (and lets a decode-only step run each layer as one call); torch pads to the longest
        self.decode_group_size = (
            (1 << 30)
            if (self.device.type == "cpu" and dtype == torch.float32 and dense_kernels.library() is not None)
            else DECODE_GROUP_SIZE
        )
        self.kv_groups = kv_groups or single_group(cfg.num_hidden_layers, None)
        self.sink_blocks = -(-self.kv_groups.sink_tokens // block_size)
        self.kv_layout = kv_layout_of(cfg, tp)  # this rank's slice of the cache (a latent cache: whole)
        plain = (
            tp.size == 1
            and self.kv_layout.kind == "kv"
            and self.kv_groups.num_groups == 1
            and lora_manager is None
            and not getattr(model, "uses_mrope", False)
            and not self.kv_groups.sink_tokens  # attention sinks mask on the host: no graph holds them
        )
        graph_sizes = (cuda_graph_batch_sizes or []) if plain and graphs_supported(self.device) else []
        # layers_per_block tensors; the i-th layer of every group uses the i-th (at that group's block ids); with
        # CUDA graphs one more block, past the block manager's, takes the padded rows' K/V
        self.cache_tensors = [
            new_kv_cache(
                num_blocks + bool(graph_sizes),
                block_size,
                self.kv_layout.heads,
                self.kv_layout.width,
                kv_cache_dtype or dtype,
                device,
                self.kv_layout.planes,
            )
            for _ in range(self.kv_groups.layers_per_block)
        ]
        self.kv_caches = [self.cache_tensors[self.kv_groups.slot_of(layer)] for layer in range(cfg.num_hidden_layers)]
        self._layer_group = [self.kv_groups.group_of(layer) for layer in range(cfg.num_hidden_layers)]
        self.decode_graphs = None
        if graph_sizes:
            max_blocks = -(-(max_model_len or cfg.max_position_embeddings) // block_size)
            self.decode_graphs = capture_decode_graphs(model, self.kv_caches, graph_sizes, max_blocks, num_blocks)

    def layer_tables(self, block_tables: list[list[int]]):
        """A sequence's table for each layer (its group's), as petrel/engine/kv_export.py takes them; with one
        group, the one table."""
        if self.kv_groups.num_groups == 1:
            return block_tables[0]
        return [block_tables[g] for g in self._layer_group]

    def _tensor(self, data, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    @staticmethod
    def spans(batch: ScheduledBatch) -> list[QuerySpan]:
        """The scheduled tokens of each sequence (decodes first, as the scheduler orders them); a sequence
        verifying a draft tree runs its last token and the tree's nodes."""
        spans = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            span = QuerySpan.of(seq, seq.pending_token_ids(n), seq.num_computed_tokens)
            tree = seq.spec.draft_tree
            if tree is not None and n == 1 + len(tree):
                span.tree = tree
            spans.append(span)
        return spans

    def build_inputs(self, spans: list[QuerySpan]):
        """Flat input ids, positions and attention metadata; single-token spans must come first. With several
        KV groups the metadata is a list, one per layer (the layers of a group share their group's). A model with
        multimodal rotary positions (uses_mrope) gets them as [3, T] (petrel/multimodal/mrope.py)."""
        input_ids, positions = [], []
        for span in spans:
            input_ids.extend(span.token_ids)
            positions.extend(span.positions)
        if getattr(self.model, "uses_mrope", False) and spans:
            positions = torch.cat([_mrope_positions(s) for s in spans], dim=1)
        if self.kv_groups.num_groups == 1:
            meta = self._metadata(spans, lambda span: span.block_table)
        else:
            groups = range(self.kv_groups.num_groups)
            metas = [self._metadata(spans, lambda span, g=g: span.group_tables[g]) for g in groups]
            meta = [metas[g] for g in self._layer_group]
        return self._tensor(input_ids), torch.as_tensor(positions, dtype=torch.long, device=self.device), meta

    def _metadata(self, spans: list[QuerySpan], table_of) -> AttentionMetadata:
        """The attention metadata of the spans, with each span's block table taken by table_of (one group's)."""
        bs = self.block_size
        slots, prefills, decode_tables, decode_lens = [], [], [], []
        row = 0
        for span in spans:
            start, n, table = span.start, len(span.token_ids), table_of(span)
            end = start + n
            # new K/V never go to a FREED entry (a negative slot would fail index_copy_ loudly)
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            table = _readable(table, self.sink_blocks)
            if n == 1:
                assert not prefills, "single-token spans come first"
                decode_tables.append(table)
                decode_lens.append(end)
            elif span.tree is not None:
                prefills.append(self._tree_chunk(span, row, self._tensor(table[: -(-end // bs)])))
            else:
                mask = None
                if start > 0:
                    q = torch.arange(start, end, device=self.device).unsqueeze(1)
                    mask = torch.arange(end, device=self.device).unsqueeze(0) <= q
                prefills.append(PrefillChunk(row, n, end, self._tensor(table[: -(-end // bs)]), mask))
            row += n
        meta = AttentionMetadata(slot_mapping=self._tensor(slots), prefills=prefills)
        size = self.decode_group_size
        for start in range(0, len(decode_tables), size):
            tables = decode_tables[start : start + size]
            lens = decode_lens[start : start + size]
            width = max(len(t) for t in tables)
            span = torch.arange(width * bs, device=self.device)
            lens_t = self._tensor(lens)
            meta.decode_groups.append(
                DecodeGroup(
                    start,
                    start + len(tables),
                    self._tensor([t + [0] * (width - len(t)) for t in tables]),
                    span.unsqueeze(0) < lens_t.unsqueeze(1),
                    lens,
                    lens_t,
                )
            )
        return meta

    def _tree_chunk(self, span: QuerySpan, row: int, block_table: torch.Tensor) -> PrefillChunk:
        """A draft tree's chunk: the root and every node see the whole context before the root; within the span,
        node k sees the root, its ancestors and itself. The positions go with it for windowed layers."""
        tree, start, n = span.tree, span.start, len(span.token_ids)
        own = torch.eye(n, dtype=torch.bool)
        own[:, 0] = True
        for node in range(1, n):
            own[node, tree.ancestors(node)] = True
        mask = torch.cat([torch.ones(n, start, dtype=torch.bool), own], dim=1).to(self.device)
        q_pos = self._tensor(span.positions)
        k_pos = torch.cat([torch.arange(start, device=self.device), q_pos])
        return PrefillChunk(row, n, start + n, block_table, mask, tree_positions=(q_pos, k_pos))

    @torch.inference_mode()
    def forward(self, plan: ForwardPlan) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run a plan: (hidden states of every row, logits of plan.logits_rows or None when there are none). A plan
        without spans only copies (blocks, slots) and returns (None, None)."""
        self.copy_blocks(plan.block_copies)
        self.copy_slots(plan.slot_copies)
        if not plan.spans:
            return None, None
        input_ids, positions, meta = self.build_inputs(plan.spans)
        parts = []  # (rows, embeddings) that replace token embeddings: prompt tuning's, then the images'
        if any(span.embedding_table is not None for span in plan.spans):
            embeds = virtual_token_embeddings(plan.spans, self.cfg.vocab_size, self.device, self.dtype)
            if embeds is not None:
                input_ids[embeds[0]] = 0  # any id the embedding matrix has: the model puts the table's row there
                parts.append(embeds)
        if any(span.multi_modal is not None for span in plan.spans):
            parts.extend(self._media_embeddings(plan.spans))
        extra = {}
        if parts:
            extra["input_embeds"] = (torch.cat([r for r, _ in parts]), torch.cat([e for _, e in parts]))
        if any(getattr(span.rope_inputs, "rope_cos_sin", None) is not None for span in plan.spans):
            rotary = given_rotary_rows(plan.spans, self.device)
            if rotary is not None:
                extra["rotary_rows"] = rotary
        hidden = self.model(input_ids, positions, self.kv_caches, meta, num_layers=plan.num_layers, **extra)
        rows = plan.logits_rows
        if not rows:
            return hidden, None
        every_row = len(rows) == hidden.shape[0] and rows == list(range(len(rows)))  # a step of decodes alone
        return hidden, self.model.compute_logits(hidden if every_row else hidden[self._tensor(rows)])

    def _media_embeddings(self, spans: list[QuerySpan]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The encoder outputs of the spans' image rows, as [(rows, embeddings)]: each item's rows inside a span
        (a chunk may start or end inside an image) take the matching rows of its output, from the encoder cache or
        from one encoder call for all the items it misses."""
        wanted, row = [], 0
        for span in spans:
            if span.multi_modal is not None:
                for item, idx, positions in span.multi_modal.overlaps(span.start, span.start + len(span.token_ids)):
                    wanted.append((item, idx, [row + p - span.start for p in positions]))
            row += len(span.token_ids)
        if not wanted:
            return []
        outputs = self.encoder_cache.outputs([item for item, _, _ in wanted], self.model.encode_images)
        rows = torch.cat([self._tensor(r) for _, _, r in wanted])
        embeds = torch.cat([outputs[item.hash][idx].to(self.device) for item, idx, _ in wanted])  # given: on CPU
        return [(rows, embeds.to(self.dtype))]

    @torch.inference_mode()
    def last_token_logits(self, spans: list[QuerySpan], num_layers: int | None = None) -> torch.Tensor:
        """Write the spans' K/V and return the logits after each span's last token ([len(spans), vocab]).
        num_layers: stop after the model's first layers (early exit)."""
        order = sorted(range(len(spans)), key=lambda i: (len(spans[i].token_ids) != 1, spans[i].start))
        ends = torch.tensor([len(spans[i].token_ids) for i in order]).cumsum(0) - 1
        _, logits = self.forward(ForwardPlan([spans[i] for i in order], ends.tolist(), num_layers=num_layers))
        return logits[torch.tensor(order).argsort().to(self.device)]

    @torch.inference_mode()
    def _replay_decode(self, plan: ForwardPlan) -> torch.Tensor | None:
        """The logits of a plan of single-token spans through a captured CUDA graph, or None when the plan is
        another kind or no graph holds it (then forward runs it)."""
        graphs, spans = self.decode_graphs, plan.spans
        if (
            graphs is None
            or not spans
            or plan.num_layers is not None
            or plan.logits_rows != list(range(len(spans)))
            or any(len(s.token_ids) != 1 or s.embedding_table is not None or s.multi_modal is not None for s in spans)
            or not graphs.fits(len(spans), max(len(s.block_table) for s in spans))
        ):
            return None
        self.copy_blocks(plan.block_copies)
        bs = self.block_size
        return graphs.run(
            [s.token_ids[0] for s in spans],
            [s.start for s in spans],
            [s.block_table[s.start // bs] * bs + s.start % bs for s in spans],
            [_readable(s.block_table, self.sink_blocks) for s in spans],
            [s.start + 1 for s in spans],
        )

    def _forward_with_loras(self, batch: ScheduledBatch, plan: ForwardPlan):
        """One forward where each token runs with its request's adapter (slot -1: the base model). The engine
        core has given the batch's adapters their slots (LoRAManager.activate) before."""
        manager = self.lora_manager
        slots = manager.slots
        token_slots = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            token_slots.extend([slots.get(seq.request.lora_int_id, -1)] * n)
        manager.mapping.set(token_slots, self.device)
        try:
            return self.forward(plan)
        finally:
            manager.mapping.clear()  # any other forward (a self-speculation draft) runs the base model

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = self._tensor([s for s, _ in copies])
        dst = self._tensor([d for _, d in copies])
        for cache in self.cache_tensors:
            cache[:, dst] = cache[:, src]

    def copy_slots(self, copies: list[tuple[int, int]]) -> None:
        """Copy single K/V slots (flat: block * block_size + offset) in every layer's cache; every source is read
        before any destination is written."""
        if not copies:
            return
        src = self._tensor([s for s, _ in copies])
        dst = self._tensor([d for _, d in copies])
        for cache in self.cache_tensors:
            flat = cache.view(cache.shape[0], -1, *cache.shape[3:])
            flat[:, dst] = flat[:, src]

    def move_slots(self, copies: list[tuple[int, int]]) -> None:
        """copy_slots now, on every tensor-parallel rank too (a plan of copies alone: no model runs)."""
        if copies:
            self.forward(ForwardPlan([], [], slot_copies=copies))

    def check_health(self) -> None:
        """Raise if the executor cannot run steps (a tensor-parallel worker died); one process always can."""

    def shutdown(self) -> None:
        """Stop what the executor started (tensor-parallel workers); nothing for one process."""

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepLogits:
        """Run a scheduled batch: the logits to sample from, and the prompt rows' outputs that were asked for."""
        context_rows, context_spans, sample_rows, sample_seqs, first_rows = [], [], [], [], []
        row = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            if seq.params.needs_context_outputs and start < seq.num_prompt_tokens:
                k = min(start + n, seq.num_prompt_tokens) - start
                context_spans.append((seq, start, len(context_rows), k))
                context_rows.extend(range(row, row + k))
            num_draft = len(seq.spec.draft_token_ids)
            if start + n == seq.num_tokens + num_draft:  # reaches the end: sample the next token (and verify drafts)
                sample_seqs.append(seq)
                first_rows.append(len(sample_rows))
                sample_rows.extend(range(row + n - 1 - num_draft, row + n))
            row += n
        context_logits_wanted = any(
            s.params.prompt_logprobs is not None or s.params.return_context_logits for s, *_ in context_spans
        )
        logits_rows = context_rows + sample_rows if context_logits_wanted else sample_rows
        plan = ForwardPlan(self.spans(batch), logits_rows, batch.block_copies)
        wants_hidden = any("hidden_states" in s.params.additional_model_outputs for s in sample_seqs)
        logits = None if context_spans or wants_hidden else self._replay_decode(plan)
        if logits is not None:
            hidden = None
        elif self.lora_manager is None:
            hidden, logits = self.forward(plan)
        else:
            hidden, logits = self._forward_with_loras(batch, plan)
        if context_logits_wanted:
            context_logits, sample_logits = logits[: len(context_rows)], logits[len(context_rows) :]
        else:
            sample_logits = logits
        spans = []
        for seq, first, at, k in context_spans:
            p = seq.params
            wants_logits = p.prompt_logprobs is not None or p.return_context_logits
            wants_hidden = "hidden_states" in p.additional_model_outputs
            spans.append(
                ContextRows(
                    seq,
                    first,
                    context_logits[at : at + k] if wants_logits else None,
                    hidden[context_rows[at] : context_rows[at] + k].clone() if wants_hidden else None,
                )
            )
        sample_hidden = None
        if wants_hidden:
            sample_hidden = hidden[self._tensor(sample_rows)]
        return StepLogits(sample_seqs, sample_logits if sample_seqs else None, first_rows, spans, sample_hidden)
