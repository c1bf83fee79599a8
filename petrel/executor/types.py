"""The Executor API's request and response types (TensorRT-LLM's executor, in snake_case)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# fn(request_id, logits [1, vocab], beam_tokens [[token ids]], client_id) -> logits (or None after editing in place)
LogitsPostProcessor = Callable[[int, Any, list[list[int]], int | None], Any]
# fn(request_ids, logits (list of [1, vocab] views, edited in place), beam_tokens (list), client_ids (list))
LogitsPostProcessorBatched = Callable[[list[int], list[Any], list[list[list[int]]], list[int | None]], None]


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
    return_log_probs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool = False  # non-streaming results start with the prompt unless this is set
    additional_model_outputs: list[AdditionalModelOutput] | None = None


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
    processor_map: dict[str, LogitsPostProcessor] = field(default_factory=dict)
    processor_batched: LogitsPostProcessorBatched | None = None


@dataclass
class ExecutorConfig:
    max_beam_width: int = 4
    logits_post_processor_config: LogitsPostProcessorConfig | None = None
    iter_stats_max_iterations: int = 1000
    max_num_return_sequences: int = 64


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
