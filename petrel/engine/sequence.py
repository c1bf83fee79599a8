"""The one object that carries a sequence's state from admission to finish, and the request that owns it.

A Sequence holds what every sequence needs (tokens, KV blocks, status); what only some features need sits in
three small records on it: `spec` (speculative decoding), `beam` (beam search) and `extra_outputs` (prompt
logprobs, logits and hidden states a request asked for).
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from petrel.lora import LoRARequest
from petrel.sampling_params import SamplingParams

if TYPE_CHECKING:
    from petrel.engine.beam_search import BeamSearch
    from petrel.engine.draft_acceptance import DraftWithProbs
    from petrel.engine.draft_tree import DraftTree
    from petrel.engine.kv_retention import KvRetention
    from petrel.engine.lookahead import LookaheadState
    from petrel.multimodal.inputs import MultiModalInputs
    from petrel.outputs import KVFetchStats


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
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    arrival_time: float = field(default_factory=time.monotonic)
    deadline: float | None = None  # monotonic time after which the request ends with 'timeout'
    first_scheduled_time: float | None = None
    client_id: int | None = None
    priority: float = 0.5  # 0..1; higher is admitted first among waiting requests
    # executor logits post-processor: fn(request_id, logits [beam_width, vocab], beam_tokens, stream, client_id)
    logits_post_processor: Callable[..., object] | None = None
    use_batched_post_processor: bool = False  # the engine's batched post-processor applies to this request
    seqs: list[Sequence] = field(default_factory=list)
    beam_search: BeamSearch | None = None  # set when params.use_beam_search
    compiled_grammar: object = None  # xgrammar CompiledGrammar when params.guided_decoding is set
    finished_indices: set[int] = field(default_factory=set)  # output indices already reported finished
    stream_beams: bool = False  # a streamed beam search: every step reports its current best beams, whole
    # disaggregated serving (petrel/disagg): a context-only request stops after its first token and leaves its
    # prompt's KV pinned; a generation-only one brings its prompt's KV (imported_kv, written at admission) and
    # the context instance's first token(s), and decodes on from there
    context_only: bool = False
    imported_kv: object = None  # torch.Tensor [layers, 2, prompt_len, kv_heads, head_dim]
    first_gen_tokens: list[int] = field(default_factory=list)
    prompt_table_digest: str = ""  # params.prompt_embedding_table's digest, in the prefix cache's root hash
    multi_modal: MultiModalInputs | None = None  # the prompt's images (petrel/multimodal/inputs.py)
    kv_retention: KvRetention | None = None  # its cached blocks' priorities (petrel/engine/kv_retention.py)
    # the prompt tokens' rotary positions when given (Executor Request.position_ids; None: 0, 1, 2, ...); a later
    # token's goes on from the last prompt token's (position_of)
    position_ids: list[int] | None = None
    # prompt tuning's input_token_extra_ids: per prompt token, what tells its virtual token's table apart (0 for a
    # vocabulary token); they key the prefix cache per virtual token (TensorRT-LLM's unique tokens)
    token_extra_ids: list[int] | None = None
    # dkv_cache_hint (petrel/kv_tiers/dkv_hint.py): chain hashes the shared KV store holds, and the prompt tokens
    # it holds from the start; plan_hinted_fetch keeps those in this request's own chain
    kv_hint_keys: tuple[bytes, ...] = ()
    kv_hint_tokens: int = 0
    kv_fetch: KVFetchStats | None = None  # its waits for KV blocks read from a slow tier (kv_tier_io.fetch_pending)

    def position_of(self, start: int, n: int) -> list[int] | None:
        """The rotary positions of tokens start .. start + n - 1 (None: their indices, the default)."""
        given = self.position_ids
        if given is None:
            return None
        p = len(given)
        return [given[i] if i < p else given[-1] + i - p + 1 for i in range(start, start + n)]

    def block_key(self, block: int, block_size: int) -> bytes:
        """What keys the prefix cache's block `block` of this request besides its tokens (b"" for most requests):
        its tokens' given positions (the KV depends on them), and its virtual tokens' extra ids."""
        key = b""
        if self.position_ids is not None:
            key += b"|pos:" + repr(self.position_of(block * block_size, block_size)).encode()
        if self.token_extra_ids is not None:
            extra = self.token_extra_ids[block * block_size : (block + 1) * block_size]
            if any(extra):
                key += b"|extra:" + repr(extra).encode()
        return key

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def finished(self) -> bool:
        return len(self.finished_indices) == self.params.n


@dataclass
class SpeculativeState:
    """Speculative decoding: the drafts a sequence verifies this step and its counts so far."""

    num_lookahead: int = 0  # draft slots the scheduler reserves beyond the next token
    draft_token_ids: list[int] = field(default_factory=list)  # this step's drafts, verified after the token_ids
    # this step's drafts as a tree (lookahead decoding; draft_token_ids holds its nodes' tokens), None: a chain
    draft_tree: DraftTree | None = None
    accepted_nodes: list[int] = field(default_factory=list)  # the draft nodes accepted this step, in order
    draft_dists: list[DraftWithProbs] | None = None  # the caller's drafts with their distributions, when given
    lookahead: LookaheadState | None = None  # lookahead decoding's window and n-gram pool (petrel/engine/lookahead.py)
    num_draft_computed: int = 0  # positions whose K/V a draft model holds
    num_verify_rounds: int = 0  # steps that verified drafts, so far
    num_drafted: int = 0  # draft tokens proposed so far
    num_accepted: int = 0  # draft tokens accepted so far


@dataclass
class BeamState:
    """Beam search: a beam's score and what it waits with until every beam of its request has its candidates."""

    cum_logprob: float = 0.0  # sum of the output tokens' logprobs
    token_logprobs: list[object] = field(default_factory=list)  # what the sampler recorded per output token
    # (best next (token, logprob) pairs, the logprob row, the extra outputs of this row), or None: being computed
    candidates: tuple[object, ...] | None = None


@dataclass
class ExtraOutputs:
    """What a request asked of the model besides tokens, gathered as the sequence runs."""

    prompt_logprobs: list[object] = field(default_factory=list)  # TokenLogprobs of prompt positions 1..
    context: dict[str, list[Any]] = field(default_factory=dict)  # 'logits' / 'hidden_states' -> the prompt's row chunks
    generation: dict[str, list[Any]] = field(default_factory=dict)  # same, one row per output token

    @property
    def num_context_rows(self) -> int:
        chunks = next(iter(self.context.values()), [])
        return sum(c.shape[0] for c in chunks)

    def copy(self) -> ExtraOutputs:
        """A beam's own copy: the prompt's outputs shared, the generation rows its own lists."""
        return ExtraOutputs(self.prompt_logprobs, self.context, {k: list(v) for k, v in self.generation.items()})


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
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at admission
        self.block_tables: list[list[int]] = [[]]  # one per KV group (petrel/engine/kv_groups.py)
        self.block_hashes: list[bytes] = []  # hashes of the full blocks of token_ids, computed lazily
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None  # 'stop' | 'length' | 'abort'
        self.stop_reason: int | str | None = None
        self.generator = None  # torch.Generator when the request has a seed
        self.grammar = None  # xgrammar GrammarMatcher of a guided sequence (kept across preemption)
        self.spec = SpeculativeState()
        self.beam = BeamState()
        self.extra_outputs = ExtraOutputs()

    def pending_token_ids(self, n: int) -> list[int]:
        """The next n tokens to compute: the uncomputed token_ids, then the draft tokens."""
        start = self.num_computed_tokens
        tokens = self.token_ids[start : start + n]
        return tokens + self.spec.draft_token_ids[: n - len(tokens)]

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
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request.request_id}#{self.index}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)}, {self.status.value})"
        )
