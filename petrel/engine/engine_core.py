"""EngineCore: one step = schedule -> run the model -> sample -> update sequences. Single-threaded, no I/O."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from petrel.config import EngineConfig
from petrel.engine.block_manager import BlockManager
from petrel.engine.kv_groups import KVGroups, kv_groups_for
from petrel.engine.model_runner import ModelRunner, num_kv_blocks
from petrel.engine.output_processor import EngineOutput
from petrel.engine.beam_search import BeamSearch, Hypothesis
from petrel.disagg.kv_blocks import scatter_prompt_kv
from petrel.disagg.params import DisaggregatedParams
from petrel.disagg.pinned import PinnedPrompts
from petrel.engine.grammar import GrammarCompiler
from petrel.engine.sampler import Sampler, prompt_logprobs, token_logprobs
from petrel.engine.scheduler import Scheduler
from petrel.engine.speculative import build_proposer
from petrel.engine.sequence import EngineRequest, Sequence
from petrel.model.config import ModelConfig

logger = logging.getLogger("petrel")


@dataclass
class IterationStats:
    iteration: int
    timestamp: float
    step_time: float
    num_running: int
    num_waiting: int
    num_preempted: int
    num_prompt_tokens: int        # prompt tokens computed this step
    num_generation_tokens: int    # tokens sampled this step
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int
    prefix_cache_hit_rate: float
    num_draft_tokens: int = 0       # speculative decoding: draft tokens verified this step
    num_accepted_tokens: int = 0    # and how many of them were accepted


class EngineCore:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, model_config: ModelConfig,
                 batched_post_processor=None, draft_model: tuple[torch.nn.Module, ModelConfig] | None = None,
                 workers=None):
        """workers: with tensor_parallel_size > 1, the other ranks (petrel.distributed); `model` is rank 0's shard."""
        self.config = config
        self.model_config = model_config
        bs = config.block_size
        self.kv_groups = self._kv_groups(config, model_config)
        num_blocks = num_kv_blocks(config, model_config, self.kv_groups.layers_per_block)
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory={config.kv_cache_memory} bytes holds fewer than 2 blocks of {bs} tokens")
        model_len = config.max_model_len or model_config.max_position_embeddings
        if model_len > model_config.max_position_embeddings:
            raise ValueError(f"max_model_len {model_len} exceeds the model's context length "
                             f"{model_config.max_position_embeddings}")
        held = max_tokens_held(self.kv_groups.windows, num_blocks, bs, config.max_num_batched_tokens)
        if held is not None and model_len > held:
            logger.warning("max_model_len %d lowered to %d: the KV cache holds no more", model_len, held)
            model_len = held
        self.max_model_len = model_len
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching, config.kv_cache_hash_seed,
                                          group_windows=list(self.kv_groups.windows))
        self.pinned = PinnedPrompts(self.block_manager, config.kv_transfer_timeout)   # context-only prompts' KV
        self.lora_manager = None
        if config.enable_lora:
            from petrel.model.lora import LoRAManager
            self.lora_manager = LoRAManager(model, model_config, config.max_loras, config.max_lora_rank)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill, config.max_loras if config.enable_lora else None)
        if workers is None:
            self.runner = ModelRunner(model, model_config, num_blocks, bs, config.torch_dtype, config.device,
                                      self.lora_manager, kv_groups=self.kv_groups)
        else:
            from petrel.distributed.runner import TensorParallelRunner
            self.runner = TensorParallelRunner(workers, model, model_config, num_blocks, bs, config.torch_dtype,
                                               config.device, kv_groups=self.kv_groups)
        self.sampler = Sampler(model_config.vocab_size, config.seed, batched_post_processor)
        self.spec = config.speculative_config
        self.proposer = None
        if self.spec is not None:
            draft_runner = None
            if draft_model is not None:
                draft_runner = ModelRunner(draft_model[0], draft_model[1], num_blocks, bs, config.torch_dtype,
                                           config.device)
            self.proposer = build_proposer(self.spec, self.runner, draft_runner)
        self.requests: dict[object, EngineRequest] = {}
        self.iteration = 0
        self.last_stats: IterationStats | None = None
        self.num_draft_tokens = 0       # speculative decoding, since start: drafts verified, and accepted
        self.num_accepted_tokens = 0

    @staticmethod
    def _kv_groups(config: EngineConfig, model_config: ModelConfig) -> KVGroups:
        """How the layers share block tables (petrel/engine/kv_groups.py): one table, freeing behind a uniform
        window; or, with sliding-window layers mixed with global ones, one table per group of same-window layers."""
        groups, why = kv_groups_for(config, model_config)
        if why:
            logger.info(why)
        return groups

    # ------------------------------------------------------------------ requests
    def validate(self, prompt_token_ids: list[int], params) -> None:
        """Raise ValueError for a request the engine could not serve (called before it is queued)."""
        if not prompt_token_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids has ids outside the vocabulary (size {vocab}): {bad[:5]}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(prompt_token_ids)} tokens, the model's context is "
                             f"{self.max_model_len}: max is {self.max_model_len - 1}")
        params.validate_for_model(vocab)

    def add_request(self, request: EngineRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        seq = Sequence(request, 0, request.prompt_token_ids + request.first_gen_tokens, len(request.prompt_token_ids))
        self._seed(seq)
        self._attach_grammar(seq)
        p = request.params
        if p.use_beam_search:
            request.beam_search = BeamSearch(p.num_beams, p.length_penalty, p.early_stopping,
                                             min(p.max_tokens or self.max_model_len, self.max_model_len - seq.num_tokens))
        request.seqs.append(seq)
        self.requests[request.request_id] = request
        self.scheduler.add(seq)

    @staticmethod
    def _attach_grammar(seq: Sequence) -> None:
        if seq.request.compiled_grammar is not None:
            seq.grammar = GrammarCompiler.matcher(seq.request.compiled_grammar)

    def _seed(self, seq: Sequence) -> None:
        seed = seq.params.seed
        if seed is not None:
            seq.generator = torch.Generator().manual_seed(hash((seed, seq.index)) & 0x7FFF_FFFF_FFFF_FFFF)

    def abort_request(self, request_id, message: str = "cancelled") -> list[EngineOutput]:
        """End every unfinished sequence of the request with 'abort'. Idempotent."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return []
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
        by_index = {} if req.beam_search else {s.index: s for s in req.seqs}
        outputs = []
        now = time.monotonic()
        for i in range(req.params.n):
            if i in req.finished_indices:
                continue
            seq = by_index.get(i)
            outputs.append(EngineOutput(request_id, i, [], finish_reason="abort", abort_message=message,
                                        num_prompt_tokens=len(req.prompt_token_ids),
                                        num_output_tokens=seq.num_output_tokens if seq else 0,
                                        num_cached_tokens=seq.num_cached_tokens if seq else 0, timestamp=now))
            req.finished_indices.add(i)
        return outputs

    def finish_sequence(self, request_id, index: int, stop_reason) -> None:
        """The front found a stop string: end that sequence now."""
        req = self.requests.get(request_id)
        if req is None:
            return
        seq = next(s for s in req.seqs if s.index == index)
        if not seq.is_finished:
            self.scheduler.finish(seq)
            seq.finish_reason, seq.stop_reason = "stop", stop_reason
        req.finished_indices.add(index)
        if req.finished:
            del self.requests[request_id]

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def step(self) -> list[EngineOutput]:
        t0 = time.monotonic()
        if self.proposer is not None:
            for seq in self.scheduler.running:
                seq.num_lookahead = self._lookahead(seq)
        batch = self.scheduler.schedule()
        if not batch:
            return []
        for seq in batch.seqs:
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = t0
            if seq.request.imported_kv is not None:    # disaggregated decode: the prompt's KV, fetched beforehand
                scatter_prompt_kv(self.runner.kv_caches, self.runner.layer_tables(seq.block_tables),
                                  seq.request.imported_kv)
                seq.request.imported_kv = None
        if self.proposer is not None:
            self._propose(batch)
        if self.lora_manager is not None:
            ids = {seq.request.lora_int_id for seq in batch.seqs} - {0}
            if ids:
                self.lora_manager.activate(ids, in_use={s.request.lora_int_id for s in self.scheduler.running})
        step_logits = self.runner.execute(batch)
        num_prompt_tokens = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            n -= len(seq.spec_token_ids)          # drafts count as computed once accepted
            num_prompt_tokens += max(0, min(seq.num_computed_tokens + n, seq.num_prompt_tokens) - seq.num_computed_tokens)
            seq.num_computed_tokens += n
            self.block_manager.cache_computed_blocks(seq)

        failed: dict = {}     # request id -> why: one request's failure in this step ends that request only
        for rows in step_logits.context_rows:
            _isolated(failed, rows.seq.request.request_id, self._collect_context_rows, rows)

        outputs: list[EngineOutput] = []
        num_generated = num_accepted = 0
        if step_logits.sample_seqs:
            seqs, rows = self._fork_new_sequences(step_logits.sample_seqs)
            rows = [step_logits.first_rows[r] for r in rows]
            outputs, num_generated, num_accepted = self._sample_and_append(seqs, rows, step_logits, failed)
        for request_id, message in failed.items():
            outputs.extend(self.abort_request(request_id, message))
        num_draft = self._finish_verification(batch)
        if self.block_manager.frees_blocks:   # forked children too: give back what fell behind a window
            for seq in self.scheduler.running:
                self.block_manager.free_behind_window(seq)
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        self.iteration += 1
        self._record_stats(t0, batch, num_prompt_tokens, num_generated, num_draft, num_accepted)
        return outputs

    def _sample_and_append(self, seqs: list[Sequence], rows: list[int], step_logits, failed: dict):
        """Sample every sequence's next token; a sequence with drafts goes on to its next row while the
        sampled token equals its draft (speculative verification). One merged output per sequence.
        A request whose sampling or bookkeeping raises is added to `failed` (the caller aborts what is left of it). Returns (outputs, tokens sampled, drafts accepted)."""
        merged: dict[Sequence, EngineOutput] = {}
        beam_requests = {}
        num_generated = num_accepted = 0
        position = 0
        now = time.monotonic()
        while seqs:
            logits = step_logits.sample_logits
            if rows != list(range(len(rows))):
                logits = logits[torch.tensor(rows)]
            drafts = [s.spec_token_ids[position] if position < len(s.spec_token_ids) else None for s in seqs]
            extras = self._generation_extras(seqs, logits, step_logits.sample_hidden, rows)
            result = self.sampler.sample(logits, seqs, drafts if self.proposer is not None else None)
            for i, message in result.errors.items():
                failed.setdefault(seqs[i].request.request_id, message)
            next_seqs, next_rows = [], []
            for i, (seq, token, lp) in enumerate(zip(seqs, result.token_ids, result.logprobs)):
                if seq.request.request_id in failed:
                    continue
                num_generated += 1
                if seq.params.use_beam_search:
                    seq.beam_candidates = (result.beam_candidates[i], result.beam_logp.get(i), extras[i])
                    beam_requests[seq.request.request_id] = seq.request
                    continue
                out = _isolated(failed, seq.request.request_id, self._append_token, seq, token, lp, extras[i], now)
                if out is None:
                    continue
                merged[seq] = _merge_outputs(merged[seq], out) if seq in merged else out
                if token == drafts[i]:
                    seq.num_accepted_tokens += 1
                    num_accepted += 1
                    if out.finish_reason is None:
                        next_seqs.append(seq)
                        next_rows.append(rows[i] + 1)
            seqs, rows = next_seqs, next_rows
            position += 1
        outputs = []
        for req in beam_requests.values():
            if req.request_id not in failed:
                outputs.extend(_isolated(failed, req.request_id, self._beam_step, req, now) or [])
        for seq, out in merged.items():   # a failed request's finished sequences keep their final output
            if self.proposer is not None:
                self._attach_spec_stats(out, seq)
            outputs.append(out)
        return outputs, num_generated, num_accepted

    # ------------------------------------------------------------------ speculative decoding
    def _lookahead(self, seq: Sequence) -> int:
        """How many draft tokens a running sequence may verify next step (0: decode plainly)."""
        p = seq.params
        if p.use_beam_search or seq.num_output_tokens == 0 or seq.num_computed_tokens != seq.num_tokens - 1:
            return 0
        k = min(self.spec.num_speculative_tokens, self.max_model_len - seq.num_tokens)
        if p.max_tokens is not None:
            k = min(k, p.max_tokens - seq.num_output_tokens - 1)   # the step emits at most drafts + 1 tokens
        return max(k, 0)

    def _propose(self, batch) -> None:
        """Fill the draft tokens of the sequences the scheduler gave lookahead room, and fit the batch to them."""
        picked = [i for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))
                  if n > 1 and seq.num_computed_tokens == seq.num_tokens - 1]
        if not picked:
            return
        seqs = [batch.seqs[i] for i in picked]
        drafts = self.proposer.propose(seqs, [batch.num_new_tokens[i] - 1 for i in picked])
        for i, seq, draft in zip(picked, seqs, drafts):
            seq.spec_token_ids = draft[:batch.num_new_tokens[i] - 1]
            batch.num_new_tokens[i] = 1 + len(seq.spec_token_ids)
        batch.put_decodes_first()   # a sequence left without drafts is a plain decode again

    def _finish_verification(self, batch) -> int:
        """After a step: accepted drafts are computed K/V; clear the drafts. Returns the number of drafts."""
        num_draft = 0
        for seq in batch.seqs:
            if not seq.spec_token_ids:
                continue
            num_draft += len(seq.spec_token_ids)
            seq.spec_verify_ct += 1
            seq.num_draft_tokens += len(seq.spec_token_ids)
            seq.spec_token_ids = []
            if not seq.is_finished:
                seq.num_computed_tokens = seq.num_tokens - 1
                seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed_tokens)
                self.block_manager.cache_computed_blocks(seq)
        return num_draft

    @staticmethod
    def _attach_spec_stats(out: EngineOutput, seq: Sequence) -> None:
        out.spec_verify_ct = seq.spec_verify_ct + (1 if seq.spec_token_ids else 0)
        if out.finish_reason is not None:
            out.accept_draft_tokens = seq.num_accepted_tokens / out.spec_verify_ct if out.spec_verify_ct else 0.0

    def _collect_context_rows(self, rows) -> None:
        """Keep a prompt span's logits / hidden states and score prompt logprobs (after a preemption the
        recomputed positions that were already kept are skipped)."""
        seq, p = rows.seq, rows.seq.params
        skip = seq.num_context_rows - rows.first
        new = {"logits": rows.logits, "hidden_states": rows.hidden}
        k = next(t.shape[0] for t in new.values() if t is not None)
        if skip >= k:
            return
        for name, tensor in new.items():
            if tensor is not None:
                seq.context_outputs.setdefault(name, []).append(tensor[skip:])
        if p.prompt_logprobs is not None:
            start = rows.first + skip
            end = min(rows.first + k, seq.num_prompt_tokens - 1)     # the last prompt position has no next prompt token
            if end > start:
                nxt = seq.token_ids[start + 1:end + 1]
                seq.prompt_logprobs.extend(prompt_logprobs(rows.logits[skip:skip + end - start], nxt, p.prompt_logprobs))

    def _generation_extras(self, seqs, logits, hidden, rows) -> list[dict]:
        """Raw logits / hidden states of each sampling row, for the sequences that asked for them."""
        extras = []
        for i, seq in enumerate(seqs):
            p = seq.params
            entry = {}
            if p.return_generation_logits:
                entry["logits"] = logits[i].clone()
            if "hidden_states" in p.additional_model_outputs and hidden is not None:
                entry["hidden_states"] = hidden[rows[i]].clone()
            extras.append(entry)
        return extras

    def _fork_new_sequences(self, sample_seqs: list[Sequence]) -> tuple[list[Sequence], list[int]]:
        """A request with n > 1 forks its prompt's sequence when the prompt is done; all n sample from one row."""
        seqs, rows = [], []
        for row, seq in enumerate(sample_seqs):
            seqs.append(seq)
            rows.append(row)
            req = seq.request
            if req.params.n > 1 and not req.params.use_beam_search and len(req.seqs) == 1 and seq.num_output_tokens == 0:
                prev = seq
                for i in range(1, req.params.n):
                    child = Sequence(req, i, seq.token_ids, seq.num_prompt_tokens)
                    self._seed(child)
                    self._attach_grammar(child)
                    self.block_manager.fork(seq, child)
                    self.scheduler.add_running(child, after=prev)
                    req.seqs.append(child)
                    seqs.append(child)
                    rows.append(row)
                    prev = child
        return seqs, rows

    def _append_token(self, seq: Sequence, token: int, logprobs, extras: dict, now: float) -> EngineOutput:
        req = seq.request
        p = seq.params
        seq.token_ids.append(token)
        for name, row in extras.items():
            seq.generation_outputs.setdefault(name, []).append(row)
        finish, stop_reason = self._check_stop(seq, token)
        new_tokens, disagg = [token], None
        if req.first_gen_tokens and seq.num_output_tokens == len(req.first_gen_tokens) + 1:
            new_tokens = req.first_gen_tokens + new_tokens   # the context instance's token(s) lead the output
        if req.context_only and finish is None:   # prefill done: pin the prompt's KV for the decode instance
            finish = "length"
            disagg = DisaggregatedParams(request_type="context_only", first_gen_tokens=[token],
                                         ctx_request_id=req.request_id,
                                         opaque_state=self.pinned.pin(seq.block_tables, seq.num_prompt_tokens))
        out = EngineOutput(req.request_id, seq.index, new_tokens, [logprobs] if logprobs is not None else None,
                           finish_reason=finish, stop_reason=stop_reason,
                           num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
                           num_cached_tokens=seq.num_cached_tokens, timestamp=now,
                           scheduled_time=req.first_scheduled_time, disaggregated_params=disagg)
        if "logits" in extras:
            out.generation_logits = extras["logits"].unsqueeze(0)
        if "hidden_states" in extras:
            out.additional_generation_outputs = {"hidden_states": extras["hidden_states"].unsqueeze(0)}
        if seq.num_output_tokens == 1 and seq.index == 0:
            self._attach_context_outputs(out, seq)
        if finish is not None:
            self.scheduler.finish(seq)
            seq.finish_reason, seq.stop_reason = finish, stop_reason
            req.finished_indices.add(seq.index)
            if req.finished:
                self.requests.pop(req.request_id, None)
        return out

    def _check_stop(self, seq: Sequence, token: int):
        """(finish_reason, stop_reason) after `token` was appended, or (None, None)."""
        p = seq.params
        if seq.grammar is not None:
            if not seq.grammar.accept_token(token):   # only when every token was masked (e.g. a processor's -inf)
                logger.warning("request %r: token %d is outside its grammar; ending it", seq.request.request_id, token)
                return "stop", None
            if seq.grammar.is_terminated():
                return "stop", token if token in seq.request.eos_token_ids or token in p.stop_token_ids else None
        if token in p.stop_token_ids:
            return "stop", token
        if token in seq.request.eos_token_ids and not p.ignore_eos:
            return "stop", token
        for word in p.stop_token_sequences:
            if seq.num_output_tokens >= len(word) and seq.token_ids[-len(word):] == word:
                return "stop", tuple(word)
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return "length", None
        if seq.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    def _attach_context_outputs(self, out: EngineOutput, seq: Sequence) -> None:
        """The prompt's outputs ride on the request's first output of sequence 0."""
        p = seq.params
        if p.prompt_logprobs is not None:
            out.prompt_logprobs = seq.prompt_logprobs
        if p.return_context_logits:
            out.context_logits = torch.cat(seq.context_outputs["logits"])
        if "hidden_states" in p.additional_model_outputs:
            out.additional_context_outputs = {"hidden_states": torch.cat(seq.context_outputs["hidden_states"])}

    # ------------------------------------------------------------------ beam search
    def _beam_step(self, req: EngineRequest, now: float) -> list[EngineOutput]:
        """Advance a request's beams together once every live beam has its candidates."""
        bs, p = req.beam_search, req.params
        beams = [s for s in req.seqs if not s.is_finished]
        if any(s.beam_candidates is None for s in beams):
            return []      # some beam is still being (re)computed
        num_out = beams[0].num_output_tokens
        is_end = lambda t: t in p.stop_token_ids or (t in req.eos_token_ids and not p.ignore_eos)  # noqa: E731
        keep, ended = bs.select([s.beam_candidates[0] for s in beams], [s.cum_logprob for s in beams], num_out, is_end)
        for cand in ended:
            parent = beams[cand.beam]
            lp, extras = self._beam_token_record(parent, cand.token_id)
            kept = self._extras_lists(parent)
            for name, rows in extras.items():
                kept.setdefault(name, []).extend(rows)
            bs.add_hypothesis(Hypothesis(
                parent.output_token_ids + [cand.token_id], cand.cum_logprob, bs.score(cand.cum_logprob, num_out + 1),
                "stop", cand.token_id, parent.token_logprobs + lp, kept))

        # children: a parent's first child takes over its sequence, the others fork it first
        children: dict[int, list] = {}
        for cand in keep:
            children.setdefault(cand.beam, []).append(cand)
        new_beams = []
        for b, parent in enumerate(beams):
            cands = children.get(b, [])
            if not cands:
                self.scheduler.finish(parent)
                req.seqs.remove(parent)
                continue
            for cand in cands[1:]:
                child = Sequence(req, len(req.seqs), parent.token_ids, parent.num_prompt_tokens)
                self.block_manager.fork(parent, child)
                child.cum_logprob, child.token_logprobs = parent.cum_logprob, list(parent.token_logprobs)
                child.generation_outputs = {k: list(v) for k, v in parent.generation_outputs.items()}
                child.context_outputs, child.prompt_logprobs = parent.context_outputs, parent.prompt_logprobs
                child.beam_candidates = parent.beam_candidates
                child.grammar = parent.grammar.fork() if parent.grammar is not None else None
                self.scheduler.add_running(child, after=parent)
                req.seqs.append(child)
                new_beams.append((child, cand))
            new_beams.append((parent, cands[0]))
        for seq, cand in new_beams:
            lp, extras = self._beam_token_record(seq, cand.token_id)
            seq.token_ids.append(cand.token_id)
            if seq.grammar is not None:
                seq.grammar.accept_token(cand.token_id)
            seq.cum_logprob = cand.cum_logprob
            seq.token_logprobs.extend(lp)
            for name, rows in extras.items():
                seq.generation_outputs.setdefault(name, []).extend(rows)
        for seq, _ in new_beams:
            seq.beam_candidates = None

        length = num_out + 1
        out_of_room = (p.max_tokens is not None and length >= p.max_tokens) or \
            (new_beams and new_beams[0][0].num_tokens >= self.max_model_len)
        if out_of_room:
            for seq, cand in new_beams:
                bs.add_hypothesis(Hypothesis(seq.output_token_ids, seq.cum_logprob, bs.score(seq.cum_logprob, length),
                                             "length", None, list(seq.token_logprobs), self._extras_lists(seq)))
            bs.done = True
        else:
            best = max((c.cum_logprob for c in keep), default=None)
            bs.update_done(best, length)
        return self._finish_beams(req, now) if bs.done else []

    def _beam_token_record(self, seq: Sequence, token: int) -> tuple[list, dict]:
        """What the beam keeps for appending `token`: its logprob entry (when asked) and the extras rows."""
        _, logp, extras = seq.beam_candidates
        p = seq.params
        lp = [token_logprobs(logp, token, p.logprobs)] if logp is not None else []
        return lp, {name: [row] for name, row in extras.items()}

    @staticmethod
    def _extras_lists(seq: Sequence) -> dict:
        return {name: list(rows) for name, rows in seq.generation_outputs.items()}

    def _finish_beams(self, req: EngineRequest, now: float) -> list[EngineOutput]:
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
        p = req.params
        first = req.seqs[0] if req.seqs else None
        outputs = []
        for i, hyp in enumerate(req.beam_search.best(p.n)):
            out = EngineOutput(req.request_id, i, list(hyp.output_token_ids),
                               list(hyp.token_logprobs) if p.logprobs is not None else None,
                               finish_reason=hyp.finish_reason, stop_reason=hyp.stop_reason,
                               num_prompt_tokens=len(req.prompt_token_ids),
                               num_output_tokens=len(hyp.output_token_ids),
                               num_cached_tokens=first.num_cached_tokens if first else 0, timestamp=now,
                               scheduled_time=req.first_scheduled_time, cumulative_logprob=hyp.cum_logprob)
            if "logits" in hyp.extras:
                out.generation_logits = torch.stack(hyp.extras["logits"])
            if "hidden_states" in hyp.extras:
                out.additional_generation_outputs = {"hidden_states": torch.stack(hyp.extras["hidden_states"])}
            if i == 0 and first is not None:
                self._attach_context_outputs(out, first)
            outputs.append(out)
            req.finished_indices.add(i)
        for i in range(len(outputs), p.n):   # fewer hypotheses than asked (a tiny vocabulary): end the rest empty
            outputs.append(EngineOutput(req.request_id, i, [], finish_reason="stop", timestamp=now,
                                        num_prompt_tokens=len(req.prompt_token_ids)))
            req.finished_indices.add(i)
        self.requests.pop(req.request_id, None)
        return outputs

    def _record_stats(self, t0: float, batch, num_prompt_tokens: int, num_generated: int,
                      num_draft: int = 0, num_accepted: int = 0) -> None:
        bm, sched = self.block_manager, self.scheduler
        queried = sched.prefix_queried_tokens
        self.last_stats = IterationStats(
            iteration=self.iteration, timestamp=time.time(), step_time=time.monotonic() - t0,
            num_running=len(sched.running), num_waiting=len(sched.waiting), num_preempted=len(batch.preempted),
            num_prompt_tokens=num_prompt_tokens, num_generation_tokens=num_generated,
            kv_blocks_used=bm.num_used_blocks, kv_blocks_free=bm.num_free_blocks, kv_blocks_cached=bm.num_cached_blocks,
            prefix_cache_hit_rate=sched.prefix_hit_tokens / queried if queried else 0.0,
            num_draft_tokens=num_draft, num_accepted_tokens=num_accepted)


def _isolated(failed: dict, request_id, fn, *args):
    """fn(*args), unless this request failed earlier in the step; an exception fails the request (recorded in
    `failed` with its cause, logged) instead of the step. Returns fn's result, or None."""
    if request_id in failed:
        return None
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - one request's failure must not end the others in its step
        logger.exception("request %r failed in an engine step", request_id)
        failed[request_id] = f"engine error in this request: {type(exc).__name__}: {exc}"
        return None


def max_tokens_held(windows, num_blocks: int, block_size: int, max_batched_tokens: int) -> int | None:
    """The longest sequence a cache of num_blocks holds alone (None: any length), given each KV group's window.
    A sliding group holds about its window plus one step's tokens at most, whatever the sequence's length."""
    per_window = [None if w is None else -(-(w + max_batched_tokens) // block_size) + 2 for w in windows]
    if None not in per_window:
        return None if sum(per_window) <= num_blocks else num_blocks // len(windows) * block_size

    def blocks(n: int) -> int:     # what a sequence of n blocks holds over all groups
        return sum(n if cap is None else min(n, cap) for cap in per_window)
    lo, hi = 0, num_blocks        # the most blocks n with blocks(n) <= num_blocks (blocks(n) >= n)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if blocks(mid) <= num_blocks else (lo, mid - 1)
    return lo * block_size


def _merge_outputs(first: EngineOutput, later: EngineOutput) -> EngineOutput:
    """One step's consecutive outputs of one sequence (accepted drafts, then one more token) as one output."""
    first.new_token_ids += later.new_token_ids
    if first.new_logprobs is not None and later.new_logprobs is not None:
        first.new_logprobs += later.new_logprobs
    for name in ("finish_reason", "stop_reason", "num_output_tokens", "timestamp"):
        setattr(first, name, getattr(later, name))
    if first.generation_logits is not None and later.generation_logits is not None:
        first.generation_logits = torch.cat([first.generation_logits, later.generation_logits])
    if first.additional_generation_outputs and later.additional_generation_outputs:
        first.additional_generation_outputs = {
            k: torch.cat([v, later.additional_generation_outputs[k]]) for k, v in first.additional_generation_outputs.items()}
    return first
