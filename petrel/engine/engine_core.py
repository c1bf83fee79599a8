"""EngineCore: one step = schedule -> run the model -> sample -> update the sequences. Single-threaded, no I/O.

Beside it: speculative.py, beam_search.py, stop.py (the one stop check), engine_output.py (the outputs, one
builder), extra_outputs.py, kv_capacity.py, step_isolation.py, and disaggregated serving's engine side
(pinned_prompts.py, kv_export.py).
"""

from __future__ import annotations

import logging
import time

import torch

from petrel.config import EngineConfig
from petrel.engine.beam_search import BeamSearchDriver
from petrel.engine.block_manager import BlockManager
from petrel.engine.decode_graphs import batch_sizes_of
from petrel.engine.engine_output import EngineOutput, IterationStats, build_output, merge_outputs, step_stats
from petrel.engine.extra_outputs import gather_context_rows, generation_rows
from petrel.engine.kv_capacity import plan_kv_cache
from petrel.engine.kv_export import write_imported_kv
from petrel.engine.kv_tier_io import build_tier_io
from petrel.engine.model_runner import ModelRunner
from petrel.engine.parallel_sampling import fork_parallel_samples, new_sequence
from petrel.engine.pinned_prompts import PinnedPrompts
from petrel.engine.prompt_tuning import check_prompt_tuning_engine, table_digest
from petrel.engine.request_checks import check_request
from petrel.engine.sampler import Sampler
from petrel.engine.scheduler import Scheduler
from petrel.engine.sequence import EngineRequest, Sequence
from petrel.engine.speculative import Speculator
from petrel.engine.step_isolation import isolated
from petrel.engine.stop import check_stop
from petrel.model.config import ModelConfig
from petrel.model.kv_layout import kv_layout_of

logger = logging.getLogger("petrel")

IDLE_FETCH_WAIT_S = 0.005  # a step with nothing to run waits this long at most for a KV tier fetch (then polls again)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        model: torch.nn.Module,
        model_config: ModelConfig,
        batched_post_processor=None,
        draft_model: tuple[torch.nn.Module, ModelConfig] | None = None,
        workers=None,
    ):
        """workers: with tensor_parallel_size > 1, the other ranks (petrel.distributed); `model` is rank 0's shard.
        draft_model: speculative method 'draft_model''s (model, model_config)."""
        self.config, self.model_config = config, model_config
        capacity = plan_kv_cache(config, model_config)
        self.kv_groups, self.max_model_len = capacity.kv_groups, capacity.max_model_len
        num_blocks, bs = capacity.num_blocks, config.block_size
        # what one token of context costs in the KV cache over every layer (a latent cache holds less than expanded
        # heads would: petrel/model/kv_layout.py)
        layers = model_config.num_hidden_layers
        self.kv_bytes_per_token = kv_layout_of(model_config).bytes_per_token(layers, config.kv_cache_torch_dtype)
        windows = list(self.kv_groups.windows)
        self.block_manager = BlockManager(
            num_blocks,
            bs,
            config.enable_prefix_caching,
            config.kv_cache_hash_seed,
            group_windows=windows,
            sink_tokens=self.kv_groups.sink_tokens,
        )
        self.block_manager.partial_reuse = config.enable_partial_reuse and config.enable_prefix_caching
        self.block_manager.copy_on_partial_reuse = config.copy_on_partial_reuse
        self.pinned = PinnedPrompts(self.block_manager, config.kv_transfer_timeout)  # context-only prompts' KV
        self.lora_manager = None
        if config.enable_lora:
            from petrel.model.lora import LoRAManager

            self.lora_manager = LoRAManager(model, model_config, config.max_loras, config.max_lora_rank)
        max_loras = config.max_loras if config.enable_lora else None
        budget = (config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill)
        self.scheduler = Scheduler(self.block_manager, *budget, max_loras)
        shape = (model, model_config, num_blocks, bs, config.torch_dtype, config.device)
        if workers is None:
            self.runner = ModelRunner(
                *shape,
                self.lora_manager,
                kv_groups=self.kv_groups,
                encoder_cache_memory=config.encoder_cache_memory,
                cuda_graph_batch_sizes=batch_sizes_of(config),
                max_model_len=self.max_model_len,
                kv_cache_dtype=config.kv_cache_torch_dtype,
            )
        else:
            from petrel.distributed.runner import TensorParallelRunner

            self.runner = TensorParallelRunner(
                workers, *shape, kv_groups=self.kv_groups, kv_cache_dtype=config.kv_cache_torch_dtype
            )
        # lower KV tiers (host memory, disk): evicted prefix blocks kept and brought back by hash
        self.tier_io = build_tier_io(config, self.runner, model, model_config, self.block_manager)
        if self.tier_io is not None:  # a request whose blocks are read from a slow tier waits, the batch does not
            self.scheduler.fetch_pending = self.tier_io.fetch_pending
        self.sampler = Sampler(model_config.vocab_size, config.seed, batched_post_processor)
        vocab = model_config.vocab_size
        self.speculator = None  # the engine's own speculative decoding (speculative_config)
        if config.speculative_config is not None:
            self.speculator = Speculator(config, self.runner, draft_model, num_blocks, self.max_model_len, vocab)
        # drafts verified each step: the speculator's, or (without one) only requests' external_draft_tokens
        self.drafting = self.speculator or Speculator(config, self.runner, None, num_blocks, self.max_model_len, vocab)
        self.beams = BeamSearchDriver(self.scheduler, self.block_manager, self.max_model_len)
        self.requests: dict[object, EngineRequest] = {}
        self.iteration = 0
        self.last_stats: IterationStats | None = None
        self.num_draft_tokens = 0  # speculative decoding, since start: drafts verified, and accepted
        self.num_accepted_tokens = 0
        # mixtures of experts, since start: tokens routed to each expert, {layer index: [per expert]} (None: dense)
        self.expert_tokens: dict[int, list[int]] | None = None

    # ------------------------------------------------------------------ requests
    def validate(self, prompt_token_ids: list[int], params, eos_token_ids=()) -> None:
        """Raise ValueError for a request the engine could not serve (called before it is queued)."""
        check_request(
            prompt_token_ids,
            params,
            self.model_config.vocab_size,
            self.max_model_len,
            self.model_config.hidden_size,
            eos_token_ids,
        )
        if params.prompt_embedding_table is not None:
            check_prompt_tuning_engine(self.runner.model, self.config.speculative_config)
        self.drafting.check_request(params)

    def add_request(self, request: EngineRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        if request.params.prompt_embedding_table is not None and not request.prompt_table_digest:
            request.prompt_table_digest = table_digest(request.params.prompt_embedding_table)
        seq = new_sequence(
            request, 0, request.prompt_token_ids + request.first_gen_tokens, len(request.prompt_token_ids)
        )
        if request.params.use_beam_search:
            self.beams.start(request, seq)
        request.seqs.append(seq)
        self.requests[request.request_id] = request
        if self.tier_io is not None:  # a dkv_cache_hint: its blocks fetched from the shared store ahead
            self.tier_io.prefetch_hint(self.block_manager, seq, request)
        self.scheduler.add(seq)

    def abort_request(self, request_id, message: str = "cancelled") -> list[EngineOutput]:
        """End every unfinished sequence of the request with 'abort'. Idempotent."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return []
        for seq in req.seqs:
            if not seq.is_finished:
                self._end(seq, "abort")
        by_index = {} if req.beam_search else {s.index: s for s in req.seqs}
        now = time.monotonic()
        outputs = [
            build_output(req, i, [], now, seq=by_index.get(i), finish_reason="abort", abort_message=message)
            for i in range(req.params.n)
            if i not in req.finished_indices
        ]
        req.finished_indices.update(range(req.params.n))
        return outputs

    def finish_sequence(self, request_id, index: int, stop_reason) -> None:
        """The output processor found a stop string in this sequence's text: end it now ('stop')."""
        req = self.requests.get(request_id)
        if req is None:
            return
        seq = next(s for s in req.seqs if s.index == index)
        if not seq.is_finished:
            self._end(seq, "stop", stop_reason)
        self._mark_finished(req, index)

    def close(self) -> None:
        """Let go of what the core holds outside the process's memory (the disk tier's directory)."""
        if self.tier_io is not None:
            self.tier_io.close()

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def step(self) -> list[EngineOutput]:
        """Schedule, run the model, sample, update: the outputs of the sequences that moved (or ended)."""
        t0 = time.monotonic()  # schedule (room for drafts first), then ready the batch
        encoder0 = self.encoder_counters()
        self.drafting.reserve_lookahead(self.scheduler.running)
        batch = self.scheduler.schedule()
        if self.tier_io is not None:  # evicted blocks out to the tiers, tier hits in, before anything writes
            self.tier_io.drain(self.block_manager)
        if not batch:
            if self.tier_io is not None:  # maybe only requests waiting for their blocks: let the fetch worker run
                self.tier_io.wait_for_fetches(IDLE_FETCH_WAIT_S)
            return []
        for seq in batch.seqs:
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = t0
            if seq.request.imported_kv is not None:  # disaggregated decode: the prompt's KV, fetched beforehand
                write_imported_kv(self.runner, seq)
        self.drafting.propose(batch)
        if self.lora_manager is not None:
            ids = {seq.request.lora_int_id for seq in batch.seqs} - {0}
            if ids:
                self.lora_manager.activate(ids, in_use={s.request.lora_int_id for s in self.scheduler.running})
        # run the model
        step_logits = self.runner.execute(batch)
        num_prompt_tokens = self._count_computed(batch)
        # sample and update the sequences
        failed: dict = {}  # request id -> why: one request's failure in this step ends that request only
        for rows in step_logits.context_rows:
            isolated(failed, rows.seq.request.request_id, gather_context_rows, rows)
        outputs: list[EngineOutput] = []
        num_generated = num_accepted = 0
        if step_logits.sample_seqs:
            seqs, rows = fork_parallel_samples(step_logits.sample_seqs, self.scheduler, self.block_manager)
            rows = [step_logits.first_rows[r] for r in rows]
            outputs, num_generated, num_accepted = self._sample_and_append(seqs, rows, step_logits, failed)
        for request_id, message in failed.items():
            outputs.extend(self.abort_request(request_id, message))
        # after the step: drafts verified, blocks behind a window given back, stats
        num_draft = self.drafting.finish_verification(batch, self.block_manager, step_logits)
        if self.block_manager.frees_blocks:  # forked children too: give back what fell behind a window
            for seq in self.scheduler.running:
                self.block_manager.free_behind_window(seq)
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        self.iteration += 1
        counts = (num_prompt_tokens, num_generated, num_draft, num_accepted)
        encoder = tuple(b - a for a, b in zip(encoder0, self.encoder_counters()))
        expert_load = self._take_expert_load()
        self.last_stats = step_stats(
            self.iteration,
            t0,
            batch,
            self.scheduler,
            self.block_manager,
            *counts,
            encoder,
            kv_tiers=self.tier_io,
            expert_load=expert_load,
        )
        return outputs

    def _take_expert_load(self) -> dict[int, list[int]] | None:
        """A mixture of experts' tokens per expert this step (petrel/model/moe.py), added to expert_tokens."""
        take = getattr(self.runner.model, "take_expert_load", None)
        load = take() if take is not None else None
        if load is not None:
            totals = self.expert_tokens if self.expert_tokens is not None else {}
            for layer, counts in load.items():
                known = totals.setdefault(layer, [0] * len(counts))
                totals[layer] = [a + b for a, b in zip(known, counts)]
            self.expert_tokens = totals
        return load

    def encoder_counters(self) -> tuple[int, int, float]:
        """(images encoded, encoder-cache hits, encoder seconds) since start (zeros without an encoder cache)."""
        cache = getattr(self.runner, "encoder_cache", None)
        return cache.counters() if cache is not None else (0, 0, 0.0)

    def _count_computed(self, batch) -> int:
        """After the forward pass: the scheduled tokens are in the KV cache (drafts only once accepted); their
        full blocks go to the prefix cache. Returns the prompt tokens computed."""
        num_prompt_tokens = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            n -= len(seq.spec.draft_token_ids)
            num_prompt_tokens += max(
                0, min(seq.num_computed_tokens + n, seq.num_prompt_tokens) - seq.num_computed_tokens
            )
            seq.num_computed_tokens += n
            self.block_manager.cache_computed_blocks(seq)
        return num_prompt_tokens

    def _sample_and_append(self, seqs: list[Sequence], rows: list[int], step_logits, failed: dict):
        """Sample every sequence's next token; a sequence with drafts goes on to its next row while the sampled
        token is its next draft (speculative verification; in a draft tree, a child of the node it stands on). One
        merged output per sequence; a beam keeps its candidates until every beam of its request has them. A
        request whose sampling or bookkeeping raises is added to `failed` (the caller aborts what is left of it).
        Returns (outputs, tokens sampled, drafts accepted)."""
        merged: dict[Sequence, EngineOutput] = {}
        beam_requests: dict[object, EngineRequest] = {}
        num_generated = num_accepted = 0
        nodes = [0] * len(seqs)  # each sequence's draft node (0: the row after its last token)
        now = time.monotonic()
        while seqs:
            logits = step_logits.sample_logits
            if rows != list(range(len(rows))):
                logits = logits[torch.tensor(rows)]
            elif logits.shape[0] != len(rows):  # the rows after these are drafts' positions, verified later
                logits = logits[: len(rows)]  # a view: one row per sequence, as the sampler reads them
            drafts = self.drafting.sampler_drafts(seqs, nodes)
            extras = generation_rows(seqs, logits, step_logits.sample_hidden, rows)
            result = self.sampler.sample(logits, seqs, drafts if any(d is not None for d in drafts) else None)
            for i, message in result.errors.items():
                failed.setdefault(seqs[i].request.request_id, message)
            next_seqs, next_rows, next_nodes = [], [], []
            chosen = zip(seqs, result.token_ids, result.logprobs, result.sampled_logprobs)
            for i, (seq, token, lp, sampled) in enumerate(chosen):
                if seq.request.request_id in failed:
                    continue
                num_generated += 1
                if seq.params.use_beam_search:
                    seq.beam.candidates = (result.beam_candidates[i], result.beam_logp.get(i), extras[i])
                    beam_requests[seq.request.request_id] = seq.request
                    continue
                if i in result.no_token_left:
                    args = (seq, now)
                    out = isolated(failed, seq.request.request_id, self._end_with_no_token_left, *args)
                else:
                    args = (seq, token, lp, sampled, extras[i], now)
                    out = isolated(failed, seq.request.request_id, self._append_token, *args)
                if out is None:
                    continue
                merged[seq] = merge_outputs(merged[seq], out) if seq in merged else out
                child = self.drafting.next_node(seq, nodes[i], token)
                if child is not None:
                    seq.spec.num_accepted += 1
                    num_accepted += 1
                    if out.finish_reason is None:
                        next_seqs.append(seq)
                        next_rows.append(rows[i] + child - nodes[i])
                        next_nodes.append(child)
            seqs, rows, nodes = next_seqs, next_rows, next_nodes
        outputs = []
        for req in beam_requests.values():
            outputs.extend(isolated(failed, req.request_id, self.beams.advance, req, now) or [])
            if req.finished:
                self.requests.pop(req.request_id, None)
        for seq, out in merged.items():  # a failed request's finished sequences keep their final output
            if self.speculator is not None or seq.params.external_draft_tokens:
                self.drafting.report(out, seq)
            outputs.append(out)
        return outputs, num_generated, num_accepted

    def _append_token(self, seq: Sequence, token: int, logprobs, sampled, extras: dict, now: float) -> EngineOutput:
        """A sampled (or accepted draft) token onto its sequence (its top logprobs when asked for, its own logprob
        `sampled` always): the stop check, the output, the end if it ends."""
        req = seq.request
        stop = check_stop(
            seq, token, self.max_model_len, seq.grammar.accept_token(token) if seq.grammar is not None else None
        )
        seq.token_ids.append(token)
        for name, row in extras.items():
            seq.extra_outputs.generation.setdefault(name, []).append(row)
        finish_reason, stop_reason = (stop.finish_reason, stop.stop_reason) if stop else (None, None)
        new_tokens, handoff = [token], None
        if req.first_gen_tokens and seq.num_output_tokens == len(req.first_gen_tokens) + 1:
            new_tokens = req.first_gen_tokens + new_tokens  # the context instance's token(s) lead the output
        if req.context_only and stop is None:  # prefill done: pin the prompt's KV for the decode instance
            finish_reason, handoff = "length", self.pinned.hand_off(seq, token)
        out = build_output(
            req,
            seq.index,
            new_tokens,
            now,
            seq=seq,
            logprobs=[logprobs] if logprobs is not None else None,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            generation={name: [row] for name, row in extras.items()},
            with_context=seq.num_output_tokens == 1 and seq.index == 0,
            disaggregated_params=handoff,
            sampled_logprobs=[sampled] if sampled is not None else None,
        )
        if finish_reason is not None:
            self._end(seq, finish_reason, stop_reason)
            self._mark_finished(req, seq.index)
        return out

    def _end_with_no_token_left(self, seq: Sequence, now: float) -> EngineOutput:
        """Every token is banned for `seq` at this step (its grammar allows only an end min_tokens bans, a longer
        bad word or the grammar bans the rest): nothing can follow, so it ends here ('stop') without a token,
        rather than with a banned one. Bans that leave nothing from the start are refused before (SamplingParams).
        """
        logger.info("request %r: every token is banned at this step; ending it", seq.request.request_id)
        self._end(seq, "stop")
        self._mark_finished(seq.request, seq.index)
        return build_output(seq.request, seq.index, [], now, seq=seq, finish_reason="stop")

    # ------------------------------------------------------------------ ends
    def _end(self, seq: Sequence, finish_reason: str, stop_reason=None) -> None:
        """A sequence is finished: its blocks go back, its reasons are kept."""
        self.scheduler.finish(seq)
        if self.tier_io is not None:
            self.tier_io.forget(seq)
        seq.finish_reason, seq.stop_reason = finish_reason, stop_reason

    def _mark_finished(self, req: EngineRequest, index: int) -> None:
        """Output `index` of the request was reported finished; the request leaves once all n have."""
        req.finished_indices.add(index)
        if req.finished:
            self.requests.pop(req.request_id, None)
