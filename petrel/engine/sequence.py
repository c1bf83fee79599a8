"""The one object that carries a sequence's state from admission to finish, and the request that owns it."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

from petrel.engine.beam_search import BeamSearch

from petrel.lora import LoRARequest
from petrel.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class EngineRequest:
    """What the engine core knows about a request: tokens in, parameters, and its sequences."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None    # the adapter it runs with (None: the base model)
    arrival_time: float = field(default_factory=time.monotonic)
    deadline: float | None = None      # monotonic time after which the request ends with 'timeout'
    first_scheduled_time: float | None = None
    client_id: int | None = None
    priority: float = 0.5                      # 0..1; higher is admitted first among waiting requests
    # executor-style logits post-processor: fn(request_id, logits [1, vocab], beam_tokens, client_id) -> logits
    logits_post_processor: Callable | None = None
    use_batched_post_processor: bool = False   # the engine's batched post-processor applies to this request
    seqs: list["Sequence"] = field(default_factory=list)
    beam_search: BeamSearch | None = None      # set when params.use_beam_search
    compiled_grammar: object = None            # xgrammar CompiledGrammar when params.guided_decoding is set
    finished_indices: set[int] = field(default_factory=set)   # output indices already reported finished
    # disaggregated serving (petrel/disagg): a context-only request stops after its first token and leaves its
    # prompt's KV pinned; a generation-only one brings its prompt's KV (imported_kv, written at admission) and
    # the context instance's first token(s), and decodes on from there
    context_only: bool = False
    imported_kv: object = None                 # torch.Tensor [layers, 2, prompt_len, kv_heads, head_dim]
    first_gen_tokens: list[int] = field(default_factory=list)

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def finished(self) -> bool:
        return len(self.finished_indices) == self.params.n


_seq_ids = itertools.count()


class Sequence:
    """Tokens (prompt + output), how many of them are in the KV cache, and the blocks that hold them.

    The scheduler only ever makes ``num_computed_tokens`` catch up with ``num_tokens``: prefill,
    chunked prefill, prefix-cache hits and recomputation after preemption are the same arithmetic.
    """

    def __init__(self, request: EngineRequest, index: int, token_ids: list[int], num_prompt_tokens: int):
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = num_prompt_tokens
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0     # prompt tokens served from the prefix cache at admission
        self.block_tables: list[list[int]] = [[]]   # one per KV group (petrel/engine/kv_groups.py)
        self.block_hashes: list[bytes] = []   # hashes of the full blocks of token_ids, computed lazily
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None  # 'stop' | 'length' | 'abort'
        self.stop_reason: int | str | None = None
        self.generator = None                  # torch.Generator when the request has a seed
        self.prompt_logprobs: list = []        # TokenLogprobs of prompt positions 1.., when asked for
        self.context_outputs: dict[str, list] = {}      # 'logits' / 'hidden_states' -> row chunks of the prompt
        self.generation_outputs: dict[str, list] = {}   # same, one row per output token (when asked for)
        self.cum_logprob = 0.0                 # beam search: sum of the output tokens' logprobs
        self.token_logprobs: list = []         # beam search: what the sampler recorded per output token
        self.beam_candidates: list[tuple[int, float]] | None = None   # beam search: best next tokens, waiting for the other beams
        self.grammar = None                    # xgrammar GrammarMatcher of a guided sequence (kept across preemption)
        # speculative decoding
        self.num_lookahead = 0                 # draft slots the scheduler reserves beyond the next token
        self.spec_token_ids: list[int] = []    # this step's draft tokens, verified after the token_ids
        self.num_draft_computed = 0            # positions whose K/V a draft model holds
        self.spec_verify_ct = 0                # verify rounds so far
        self.num_draft_tokens = 0              # draft tokens proposed so far
        self.num_accepted_tokens = 0           # draft tokens accepted so far

    @property
    def num_context_rows(self) -> int:
        chunks = next(iter(self.context_outputs.values()), [])
        return sum(c.shape[0] for c in chunks)

    def pending_token_ids(self, n: int) -> list[int]:
        """The next n tokens to compute: the uncomputed token_ids, then the draft tokens."""
        start = self.num_computed_tokens
        tokens = self.token_ids[start:start + n]
        return tokens + self.spec_token_ids[:n - len(tokens)]

    @property
    def block_table(self) -> list[int]:
        """Group 0's block table: the only one of a model whose layers all see the same positions."""
        return self.block_tables[0]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    def __repr__(self) -> str:
        return (f"Sequence({self.request.request_id}#{self.index}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)}, {self.status.value})")
