"""EngineCore: one step = schedule -> run the model -> sample -> update sequences. Single-threaded, no I/O."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from petrel.config import EngineConfig
from petrel.engine.block_manager import BlockManager
from petrel.engine.model_runner import ModelRunner, kv_bytes_per_block
from petrel.engine.output_processor import EngineOutput
from petrel.engine.sampler import Sampler, prompt_logprobs
from petrel.engine.scheduler import Scheduler
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


class EngineCore:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, model_config: ModelConfig):
        self.config = config
        self.model_config = model_config
        bs = config.block_size
        num_blocks = config.kv_cache_memory // kv_bytes_per_block(model_config, bs, config.torch_dtype)
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory={config.kv_cache_memory} bytes holds fewer than 2 blocks of {bs} tokens")
        model_len = config.max_model_len or model_config.max_position_embeddings
        if model_len > model_config.max_position_embeddings:
            raise ValueError(f"max_model_len {model_len} exceeds the model's context length "
                             f"{model_config.max_position_embeddings}")
        if model_len > num_blocks * bs:
            logger.warning("max_model_len %d lowered to %d: the KV cache holds no more", model_len, num_blocks * bs)
            model_len = num_blocks * bs
        self.max_model_len = model_len
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching, config.kv_cache_hash_seed)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill)
        self.runner = ModelRunner(model, model_config, num_blocks, bs, config.torch_dtype, config.device)
        self.sampler = Sampler(model_config.vocab_size, config.seed)
        self.requests: dict[object, EngineRequest] = {}
        self.iteration = 0
        self.last_stats: IterationStats | None = None

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
        seq = Sequence(request, 0, request.prompt_token_ids, len(request.prompt_token_ids))
        self._seed(seq)
        request.seqs.append(seq)
        self.requests[request.request_id] = request
        self.scheduler.add(seq)

    def _seed(self, seq: Sequence) -> None:
        seed = seq.params.seed
        if seed is not None:
            seq.generator = torch.Generator().manual_seed(hash((seed, seq.index)) & 0x7FFF_FFFF_FFFF_FFFF)

    def abort_request(self, request_id, message: str = "cancelled") -> list[EngineOutput]:
        """End every unfinished sequence of the request with 'abort'. Idempotent."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return []
        by_index = {s.index: s for s in req.seqs}
        outputs = []
        now = time.monotonic()
        for i in range(req.params.n):
            seq = by_index.get(i)
            if seq is not None and seq.is_finished:
                continue
            if seq is not None:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
            outputs.append(EngineOutput(request_id, i, [], finish_reason="abort", abort_message=message,
                                        num_prompt_tokens=len(req.prompt_token_ids),
                                        num_output_tokens=seq.num_output_tokens if seq else 0,
                                        num_cached_tokens=seq.num_cached_tokens if seq else 0, timestamp=now))
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
        if req.finished:
            del self.requests[request_id]

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def step(self) -> list[EngineOutput]:
        t0 = time.monotonic()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        for seq in batch.seqs:
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = t0
        step_logits = self.runner.execute(batch)
        num_prompt_tokens = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            num_prompt_tokens += max(0, min(seq.num_computed_tokens + n, seq.num_prompt_tokens) - seq.num_computed_tokens)
            seq.num_computed_tokens += n
            self.block_manager.cache_computed_blocks(seq)

        for seq, first, logits in step_logits.prompt_logits:
            skip = len(seq.prompt_logprobs) - first   # positions already scored before a preemption
            if skip < logits.shape[0]:
                nxt = seq.token_ids[first + 1 + skip:first + 1 + logits.shape[0]]
                seq.prompt_logprobs.extend(prompt_logprobs(logits[skip:], nxt, seq.params.prompt_logprobs))

        outputs: list[EngineOutput] = []
        if step_logits.sample_seqs:
            seqs, rows = self._fork_new_sequences(step_logits.sample_seqs)
            logits = step_logits.sample_logits
            if rows != list(range(len(rows))):
                logits = logits[torch.tensor(rows)]
            result = self.sampler.sample(logits, seqs)
            now = time.monotonic()
            for seq, token, lp in zip(seqs, result.token_ids, result.logprobs):
                outputs.append(self._append_token(seq, token, lp, now))
        self.iteration += 1
        self._record_stats(t0, batch, num_prompt_tokens, len(outputs))
        return outputs

    def _fork_new_sequences(self, sample_seqs: list[Sequence]) -> tuple[list[Sequence], list[int]]:
        """A request with n > 1 forks its prompt's sequence when the prompt is done; all n sample from one row."""
        seqs, rows = [], []
        for row, seq in enumerate(sample_seqs):
            seqs.append(seq)
            rows.append(row)
            req = seq.request
            if req.params.n > 1 and len(req.seqs) == 1 and seq.num_output_tokens == 0:
                prev = seq
                for i in range(1, req.params.n):
                    child = Sequence(req, i, seq.token_ids, seq.num_prompt_tokens)
                    self._seed(child)
                    self.block_manager.fork(seq, child)
                    self.scheduler.add_running(child, after=prev)
                    req.seqs.append(child)
                    seqs.append(child)
                    rows.append(row)
                    prev = child
        return seqs, rows

    def _append_token(self, seq: Sequence, token: int, logprobs, now: float) -> EngineOutput:
        req = seq.request
        p = seq.params
        seq.token_ids.append(token)
        finish, stop_reason = None, None
        if token in p.stop_token_ids:
            finish, stop_reason = "stop", token
        elif token in req.eos_token_ids and not p.ignore_eos:
            finish, stop_reason = "stop", token
        elif p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            finish = "length"
        elif seq.num_tokens >= self.max_model_len:
            finish = "length"
        out = EngineOutput(req.request_id, seq.index, [token], [logprobs] if logprobs is not None else None,
                           finish_reason=finish, stop_reason=stop_reason,
                           num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
                           num_cached_tokens=seq.num_cached_tokens, timestamp=now,
                           scheduled_time=req.first_scheduled_time)
        if seq.num_output_tokens == 1 and seq.index == 0 and p.prompt_logprobs is not None:
            out.prompt_logprobs = seq.prompt_logprobs
        if finish is not None:
            self.scheduler.finish(seq)
            seq.finish_reason, seq.stop_reason = finish, stop_reason
            if req.finished:
                self.requests.pop(req.request_id, None)
        return out

    def _record_stats(self, t0: float, batch, num_prompt_tokens: int, num_generated: int) -> None:
        bm, sched = self.block_manager, self.scheduler
        queried = sched.prefix_queried_tokens
        self.last_stats = IterationStats(
            iteration=self.iteration, timestamp=time.time(), step_time=time.monotonic() - t0,
            num_running=len(sched.running), num_waiting=len(sched.waiting), num_preempted=len(batch.preempted),
            num_prompt_tokens=num_prompt_tokens, num_generation_tokens=num_generated,
            kv_blocks_used=bm.num_used_blocks, kv_blocks_free=bm.num_free_blocks, kv_blocks_cached=bm.num_cached_blocks,
            prefix_cache_hit_rate=sched.prefix_hit_tokens / queried if queried else 0.0)
