"""The Executor API's request and response types (TensorRT-LLM's executor, in snake_case)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# fn(request_id, logits [beam_width, vocab], beam_tokens [beam_width lists of token ids], stream, client_id)
# -> logits (or None after editing in place). stream: None on CPU, torch.cuda.current_stream() on CUDA.
LogitsPostProcessor = Callable[[int, Any, list[list[int]], Any, int | None], Any]
# fn(request_ids, logits_list ([beam_width, vocab] each, edited in place), beam_tokens_list, stream, client_ids)
LogitsPostProcessorBatched = Callable[[list[int], list[Any], list[list[list[int]]], Any, list[int | None]], None]


class FinishReason(enum.Enum):
    NOT_FINISHED = 0
    END_ID = 1  # the end token (the model's EOS, or Request.end_id)
    STOP_WORDS = 2  # a stop word
    LENGTH = 3  # max_tokens, or the model's context
    TIMED_OUT = 4
    CANCELLED = 5


class RequestStage(enum.Enum):
    QUEUED = "queued"
    CONTEXT_IN_PROGRESS = "context_in_progress"
    GENERATION_IN_PROGRESS = "generation_in_progress"


@dataclass
class SamplingConfig:
    """How tokens are chosen. With none of temperature, top_k, top_p or min_p set, decoding is greedy."""

    beam_width: int = 1
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    temperature: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_tokens: int | None = None
    length_penalty: float | None = None  # beam search: score = sum logprobs / length ** length_penalty
    early_stopping: bool | int | str | None = None  # beam search: True/1, False/0, or 'never'
    num_return_sequences: int | None = None  # alias of Request.num_return_sequences


@dataclass
class AdditionalModelOutput:
    """A model output besides logits: 'hidden_states' (the final normed hidden states)."""

    name: str
    gather_context: bool = False  # also return it for every prompt position


@dataclass
class OutputConfig:
    """The spec's order, so positional construction works: OutputConfig(False, False, False, True, False, False,
    additional_outputs)."""

    return_log_probs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool = False  # non-streaming results start with the prompt unless this is set
    return_encoder_output: bool = False  # encoder-decoder models only: a ValueError on petrel's decoder-only models
    return_perf_metrics: bool = False  # fills Result.request_perf_metrics
    additional_model_outputs: list[AdditionalModelOutput] | None = None  # names ExecutorConfig was configured with


@dataclass
class PromptTuningConfig:
    """Prompt tuning: a prompt id >= the vocabulary size is a virtual token whose input embedding is row
    (id - vocab_size) of `embedding_table` ([num_virtual_tokens, hidden]). The prefix cache is keyed by the table
    (its digest), and, as TensorRT-LLM does, by `input_token_extra_ids` (one per prompt token; a virtual token's
    (id, extra id) pair is its key, a vocabulary token's extra id is ignored): requests with the same table and
    different extra ids never share the blocks holding those virtual tokens."""

    embedding_table: Any
    input_token_extra_ids: list[int] | None = None


@dataclass
class MultimodalInput:
    """TensorRT-LLM's MultimodalInput: per media item its hash (a list of ints, TensorRT-LLM's 8 x int32 digest),
    the prompt position of its first placeholder token and its number of placeholder tokens. petrel uses the
    positions and lengths to split Request.multimodal_embedding into items; the prefix cache is keyed by the
    embedding rows themselves, so the hashes are checked for form only."""

    multimodal_hashes: list[list[int]]
    multimodal_positions: list[int]
    multimodal_lengths: list[int]


@dataclass
class ExternalDraftTokensConfig:
    """Draft tokens the caller proposes as the continuation, verified exactly like petrel's own drafts (greedy:
    kept while equal to the argmax, so the output is what it would be without them).

    logits: [len(tokens), vocab], the logits each draft token was drawn from (its distribution q is their
    softmax): a sampled request then verifies by speculative sampling (accept d with probability
    min(1, p(d) / q(d)), else draw from the normalised max(0, p - q)), which keeps the target's distribution p.
    Without them a sampled request treats each draft as a point mass (accept with probability p(d)).
    acceptance_threshold: in (0, 1], with logits: accept d when p(d) / q(d) reaches it (a constant in place of
    the uniform draw, as TensorRT-LLM does; the output is no longer distributed exactly as p).
    fast_logits: TensorRT-LLM's direct transfer of a draft model's logits between executors; in petrel the
    logits always travel in the request, so it is accepted with the logits themselves and refused with
    TensorRT-LLM's [1, n] transfer descriptor."""

    tokens: list[int]
    logits: Any = None
    acceptance_threshold: float | None = None
    fast_logits: bool | None = None


@dataclass
class MropeConfig:
    """A Qwen2-VL request's multimodal rotary embedding, as TensorRT-LLM takes it: mrope_rotary_cos_sin holds, for each
    prompt token in order (more rows, up to the model's context, may follow and are not read), the (cos, sin) pair of
    each of the head's head_dim / 2 rotary frequencies at that token's temporal / height / width position (each
    frequency from its M-RoPE section's stream), flattened (any shape of rows * head_dim values: [1, n], [rows,
    head_dim] or [rows, head_dim / 2, 2]); a generated token at index i has all three positions i +
    mrope_position_deltas (an int, or a one-element tensor). See petrel/executor/positions.py."""

    mrope_rotary_cos_sin: Any
    mrope_position_deltas: Any


@dataclass
class LookaheadDecodingConfig:
    """Lookahead (Jacobi) decoding's sizes, TensorRT-LLM's (W, N, G): the window of future positions iterated
    each step, the n-gram size (N - 1 drafts a candidate), the verification set (candidates verified a step).
    In ExecutorConfig.decoding_config: the executor-wide maximum (and the sizes of requests without their own);
    in Request.lookahead_config: the request's own, within that maximum ((1, 1, 0): plain decoding)."""

    max_window_size: int
    max_ngram_size: int
    max_verification_set_size: int


@dataclass
class DecodingConfig:
    """The executor's decoding (TensorRT-LLM's DecodingConfig): lookahead_decoding_config turns lookahead decoding
    on with its maximum sizes. decoding_mode: None, 'auto' or 'lookahead' (the others are TensorRT-LLM's choice
    of kernels petrel makes itself)."""

    decoding_mode: str | None = None
    lookahead_decoding_config: LookaheadDecodingConfig | None = None


@dataclass
class LoraConfig:
    """The LoRA adapter a request runs with, cached by task_id (TensorRT-LLM's behaviour): the first request with a
    task_id gives the adapter, later ones only the task_id. The engine needs enable_lora=True.

    The adapter: TensorRT-LLM's packed `weights` ([rows, width]: each row a module's flattened in then out weights)
    and `config` ([rows, 3]: module id, layer, adapter size), see petrel/executor/packed_lora.py; or petrel's
    extension `path`, a PEFT adapter directory (adapter_config.json + adapter_model.safetensors). Both go into the
    engine's one adapter store."""

    task_id: int
    weights: Any = None
    config: Any = None
    path: str | None = None


@dataclass
class TokenRangeRetentionConfig:
    """The retention priority (0..100; 35 is the default) of the cached blocks whose first token lies in the prompt
    range [token_start, token_end) (token_end None: to the prompt's end), for duration_ms (milliseconds, or a
    datetime.timedelta; None: for as long as the block stays cached)."""

    token_start: int
    token_end: int | None = None
    priority: int = 35
    duration_ms: Any = None


@dataclass
class KvCacheRetentionConfig:
    """Which of a request's cached KV blocks are evicted last (TensorRT-LLM's retention policy; see
    petrel/engine/kv_retention.py): token ranges of the prompt with priorities and durations, and the priority and
    duration of the blocks of generated tokens. transfer_mode and directory are TensorRT-LLM's debug options:
    only the default (DRAM, no directory) is accepted."""

    token_range_retention_configs: list[TokenRangeRetentionConfig] = field(default_factory=list)
    decode_retention_priority: int = 35
    decode_duration_ms: Any = None
    transfer_mode: str = "DRAM"
    directory: str | None = None


@dataclass
class TimingMetrics:
    """Monotonic times (time.monotonic(), seconds) of the request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass
class KvCacheMetrics:
    num_reused_blocks: int = 0  # prompt blocks served from the prefix cache
    num_missed_blocks: int = 0  # full prompt blocks that had to be computed
    kv_cache_hit_rate: float = 0.0  # reused / (reused + missed)
    # petrel's own: seconds the request waited before admission for blocks read from the disk tier or the shared
    # KV store, and the blocks and bytes read for it
    fetch_time: float = 0.0
    fetched_blocks: int = 0
    fetched_bytes: int = 0


@dataclass
class RequestPerfMetrics:
    """Result.request_perf_metrics with OutputConfig.return_perf_metrics (TensorRT-LLM's RequestPerfMetrics: the
    timing and KV cache parts)."""

    timing_metrics: TimingMetrics
    kv_cache_metrics: KvCacheMetrics = field(default_factory=KvCacheMetrics)
    num_generated_tokens: int = 0  # over all sequences of this Result so far


class GuideType(enum.Enum):
    JSON = "json"  # any JSON object
    JSON_SCHEMA = "json_schema"  # guide: a JSON schema (text)
    REGEX = "regex"  # guide: a regular expression
    EBNF_GRAMMAR = "ebnf_grammar"  # guide: an EBNF grammar with a `root` rule
    STRUCTURAL_TAG = "structural_tag"  # guide: an xgrammar structural tag (JSON text)


@dataclass
class GuidedDecodingParams:
    """Structured output with xgrammar: the guide type and, except for JSON, its guide text."""

    guide_type: GuideType
    guide: str | None = None

    def to_params(self):
        from petrel.guided_decoding import GuidedDecodingParams as Guided

        kind = GuideType(self.guide_type)
        if kind is GuideType.JSON:
            return Guided(json_object=True)
        if not self.guide:
            raise ValueError(f"guided_decoding_params: {kind.name} needs a guide")
        field_name = {
            GuideType.JSON_SCHEMA: "json",
            GuideType.REGEX: "regex",
            GuideType.EBNF_GRAMMAR: "grammar",
            GuideType.STRUCTURAL_TAG: "structural_tag",
        }[kind]
        return Guided(**{field_name: self.guide})


@dataclass
class Request:
    input_token_ids: list[int]
    max_tokens: int
    streaming: bool = False
    sampling_config: SamplingConfig = field(default_factory=SamplingConfig)
    output_config: OutputConfig = field(default_factory=OutputConfig)
    end_id: int | None = None  # the end token (default: the model's EOS tokens)
    pad_id: int | None = None  # accepted for compatibility; results are lists, never padded
    stop_words: list[list[int]] | None = None
    bad_words: list[list[int]] | None = None
    client_id: int | None = None
    num_return_sequences: int | None = None
    return_all_generated_tokens: bool = False  # streaming: every result carries all tokens so far
    logits_post_processor_name: str | None = None
    guided_decoding_params: GuidedDecodingParams | None = None
    cache_salt: str | None = None
    priority: float = 0.5  # 0..1, higher is admitted first
    embedding_bias: Any = None  # [vocab] tensor or list added to the logits before sampling
    allotted_time_ms: int | None = None  # the request ends with FinishReason.TIMED_OUT after this long
    lora_config: LoraConfig | None = None
    prompt_tuning_config: PromptTuningConfig | None = None  # virtual prompt tokens (ids >= vocab) -> table rows
    lookahead_config: LookaheadDecodingConfig | None = None  # this request's lookahead sizes (see the class)
    external_draft_tokens_config: ExternalDraftTokensConfig | None = None  # the caller's drafts, verified
    # the prompt tokens' rotary positions (a text model's; one per token): later tokens go on from the last one
    position_ids: list[int] | None = None
    mrope_config: MropeConfig | None = None  # an M-RoPE model's rotary table and position delta (Qwen2-VL)
    # the fields below are refused (a ValueError naming them) unless said otherwise
    # a vision-language model's image rows given as embeddings ([rows, hidden], one per image placeholder token of
    # input_token_ids, in order): the vision encoder is skipped (petrel/executor/multimodal.py)
    multimodal_embedding: Any = None
    multimodal_input: MultimodalInput | None = None  # splits multimodal_embedding into items
    encoder_input_token_ids: Any = None
    encoder_input_features: Any = None
    encoder_output_length: int | None = None
    cross_attention_mask: Any = None
    kv_cache_retention_config: KvCacheRetentionConfig | None = None  # its cached blocks' eviction priorities
    eagle_config: Any = None
    skip_cross_attn_blocks: Any = None
    language_adapter_uid: int | None = None

    BATCHED_POST_PROCESSOR_NAME = "batched"  # logits_post_processor_name that selects the batched callback


@dataclass
class AdditionalOutput:
    name: str
    output: Any  # tensor: [prompt_len, ...] for context, [beams, tokens, ...] for generation
    context: bool = False  # True: for the prompt positions


@dataclass
class Result:
    is_final: bool
    output_token_ids: list[list[int]]  # one list per beam (one list without beam search)
    finish_reasons: list[FinishReason]
    sequence_index: int = 0
    is_sequence_final: bool = False
    cum_log_probs: list[float] | None = None
    log_probs: list[list[float]] | None = None
    context_logits: Any = None  # [prompt_len, vocab]
    generation_logits: Any = None  # [beams, tokens, vocab]
    additional_outputs: list[AdditionalOutput] = field(default_factory=list)
    decoding_iter: int = 0  # decoding steps this sequence has taken
    request_perf_metrics: RequestPerfMetrics | None = None  # with OutputConfig.return_perf_metrics


@dataclass
class Response:
    request_id: int
    result: Result | None = None
    error_msg: str | None = None
    client_id: int | None = None

    def has_error(self) -> bool:
        return self.error_msg is not None


@dataclass
class LogitsPostProcessorConfig:
    """Named logits post-processors (Request.logits_post_processor_name) and the batched one.

    replicate: TensorRT-LLM runs the callbacks on every rank of the first tensor-parallel group unless it is False
    (then on rank 0 only, the sampled tokens broadcast). petrel samples on rank 0 alone: the callbacks always run
    there, once per step, and the other ranks take the tokens it sampled with the next step's forward plan. So
    replicate=False is exactly TensorRT-LLM's; with replicate=True the tokens are what replicated (deterministic)
    callbacks give, and no client state needs replicating."""

    processor_map: dict[str, LogitsPostProcessor] = field(default_factory=dict)
    processor_batched: LogitsPostProcessorBatched | None = None
    replicate: bool = True


@dataclass
class KvCacheConfig:
    """The engine's KV cache. enable_block_reuse: prefix caching; max_tokens: the cache's size in tokens;
    free_gpu_memory_fraction: the fraction of free accelerator memory it takes (CUDA only; with max_tokens too, the
    smaller). max_attention_window (per layer, repeated over the layers) and sink_token_length: sliding-window
    attention with attention sinks on any model (petrel/engine/attention_windows.py). host_cache_size: bytes of the
    host-memory tier evicted blocks go to; secondary_offload_min_priority: the least retention priority it takes
    (petrel/engine/kv_retention.py). enable_partial_reuse / copy_on_partial_reuse: reuse of a partly matching block
    after a prefix hit (off unless set: petrel's default reuses whole blocks). event_buffer_max_size > 0: the events
    of Executor.get_kv_cache_event_manager(). onboard_blocks (True: tier blocks come back into the cache) and
    use_uvm (on the CPU, where the cache is host memory) take petrel's behaviour only; cross_kv_cache_fraction is for
    encoder-decoder models (refused)."""

    enable_block_reuse: bool = True
    max_tokens: int | None = None
    free_gpu_memory_fraction: float | None = None
    max_attention_window: list[int] | None = None
    sink_token_length: int | None = None
    host_cache_size: int | None = None
    onboard_blocks: bool | None = None
    cross_kv_cache_fraction: float | None = None
    secondary_offload_min_priority: int | None = None
    event_buffer_max_size: int | None = None
    enable_partial_reuse: bool | None = None
    copy_on_partial_reuse: bool | None = None
    use_uvm: bool | None = None


@dataclass
class ExecutorConfig:
    max_beam_width: int = 4
    logits_post_processor_config: LogitsPostProcessorConfig | None = None
    iter_stats_max_iterations: int = 1000
    request_stats_max_iterations: int = 1000  # iterations of request stats kept for get_latest_request_stats
    max_num_return_sequences: int = 64
    # outputs requests may ask for through OutputConfig.additional_model_outputs ('hidden_states')
    additional_model_outputs: list[AdditionalModelOutput] | None = None
    kv_cache_config: KvCacheConfig | None = None
    decoding_config: DecodingConfig | None = None  # lookahead decoding, executor-wide (its maximum sizes)


@dataclass
class RequestStats:
    """One in-flight request, as the engine sees it now."""

    id: int
    stage: RequestStage
    context_prefill_position: int  # prompt tokens computed so far
    num_generated_tokens: int  # over all sequences / beams
    num_sequences: int
    allocated_blocks: int  # KV blocks held (shared blocks counted once per sequence)
    reused_blocks: int  # prompt blocks served from the prefix cache
    scheduled: bool  # holds KV memory now (running), not waiting


@dataclass
class RequestStatsPerIteration:
    iter: int  # the engine iteration
    request_stats: list[RequestStats]
