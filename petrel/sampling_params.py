"""SamplingParams: how to pick tokens and when to stop, validated once (ValueError names the field)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from petrel.guided_decoding import GuidedDecodingParams

ADDITIONAL_OUTPUTS = ("hidden_states",)  # model outputs a request may ask for besides logits
# a temperature below this samples as greedy: dividing logits by it would overflow float32 (1e-45 made every
# logit -inf or nan, and the draw picked token 0)
GREEDY_TEMPERATURE = 1e-5
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "length_penalty",
)


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k alternatives per generated token (the sampled one is always included)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    return_perf_metrics: bool = False
    logits_processors: list[Callable[..., Any]] | None = field(default=None, repr=False)
    bad_words: list[str] | None = None  # strings never generated (tokenized by the LLM front)
    bad_words_token_ids: list[list[int]] | None = None  # token sequences whose last token is banned after the rest
    stop_token_sequences: list[list[int]] | None = None  # multi-token stop words (ids)
    # beam search: keep `beam_width` (or best_of) beams, return the best `n`
    use_beam_search: bool = False
    beam_width: int | None = None
    best_of: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True: stop at beam_width finished; False: when no beam can win; 'never'
    # extra outputs
    return_context_logits: bool = False
    return_generation_logits: bool = False
    additional_model_outputs: list[str] | None = None  # 'hidden_states' (final normed) for context and generation
    guided_decoding: GuidedDecodingParams | None = None  # constrain the output (JSON schema, regex, grammar, ...)
    # speculative decoding: token ids the caller proposes as the continuation; verified like petrel's own drafts
    external_draft_tokens: list[int] | None = None
    # the logits each external draft token was drawn from ([len(external_draft_tokens), vocab]): a sampled request
    # verifies them by speculative sampling (petrel/engine/draft_acceptance.py); greedy ones ignore them
    external_draft_logits: Any = field(default=None, repr=False, compare=False)  # a float32 tensor once validated
    # with external_draft_logits: accept a draft when p / q reaches this constant (0, 1] instead of a uniform draw
    # (TensorRT-LLM's acceptance_threshold; the output is then no longer distributed exactly as the target)
    external_draft_acceptance_threshold: float | None = None
    # lookahead decoding's (window, ngram, verification set) sizes for this request, within the engine's
    # speculative_config maximum (method 'lookahead'); (1, 1, 0) decodes plainly. None: the engine's sizes
    lookahead_config: tuple[int, int, int] | None = None
    # prompt tuning: a [num_virtual_tokens, hidden] tensor; prompt ids >= vocab_size take row (id - vocab_size)
    prompt_embedding_table: object = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.bad_words = list(self.bad_words or [])
        self.bad_words_token_ids = [list(w) for w in (self.bad_words_token_ids or [])]
        self.stop_token_sequences = [list(w) for w in (self.stop_token_sequences or [])]
        self.additional_model_outputs = list(self.additional_model_outputs or [])
        if self.external_draft_tokens is not None:
            self.external_draft_tokens = list(self.external_draft_tokens)
        if self.lookahead_config is not None:
            self.lookahead_config = _lookahead_sizes(self.lookahead_config)
        self.validate()

    @property
    def num_beams(self) -> int:
        """Beams kept per step (1 without beam search)."""
        if not self.use_beam_search:
            return 1
        return self.beam_width or self.best_of or self.n

    @property
    def needs_context_outputs(self) -> bool:
        """Outputs of every prompt position are asked for (so no prompt token may come from the cache)."""
        return self.prompt_logprobs is not None or self.return_context_logits or bool(self.additional_model_outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def validate(self) -> None:
        def bad(name: str, why: str) -> NoReturn:
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                bad(name, "must be a finite number")
        if not _is_int(self.n) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.temperature < 0.0:
            bad("temperature", "must be >= 0")
        if not _is_int(self.top_k) or self.top_k < 0:
            bad("top_k", "must be an integer >= 0 (0 or -1 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0.0:
            bad("repetition_penalty", "must be > 0")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            bad("logprobs", "must be an integer >= 0")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            bad("prompt_logprobs", "must be an integer >= 0")
        if self.seed is not None and not _is_int(self.seed):
            bad("seed", "must be an integer")
        if any(not isinstance(s, str) or not s for s in self.stop or ()):
            bad("stop", "must be non-empty strings")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids or ()):
            bad("stop_token_ids", "must be non-negative integers")
        for name in ("bad_words_token_ids", "stop_token_sequences"):
            for w in getattr(self, name):
                if not w or any(not _is_int(t) or t < 0 for t in w):
                    raise ValueError(f"{name} must be non-empty lists of token ids (ints >= 0), got {w!r}")
        if any(not isinstance(w, str) or not w for w in self.bad_words or ()):
            bad("bad_words", "must be non-empty strings")
        unknown = [o for o in self.additional_model_outputs or () if o not in ADDITIONAL_OUTPUTS]
        if unknown:
            raise ValueError(
                f"additional_model_outputs has unknown names {unknown}; available: {list(ADDITIONAL_OUTPUTS)}"
            )
        if self.guided_decoding is not None and not isinstance(self.guided_decoding, GuidedDecodingParams):
            bad("guided_decoding", "must be a GuidedDecodingParams")
        self._validate_speculation_and_prompt_tuning(bad)
        if self.use_beam_search:
            self._validate_beam_search(bad)
        elif self.beam_width not in (None, 1):
            bad("beam_width", "needs use_beam_search=True")
        if self.logit_bias is not None:
            for tok, bias in self.logit_bias.items():
                if not _is_int(tok) or tok < 0:
                    raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {tok!r}")
                if isinstance(bias, bool) or not isinstance(bias, numbers.Real) or not -100.0 <= bias <= 100.0:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {tok}")

    def _validate_speculation_and_prompt_tuning(self, bad: Callable[[str, str], NoReturn]) -> None:
        drafts = self.external_draft_tokens
        if drafts is not None:
            if any(not _is_int(t) or t < 0 for t in drafts):
                bad("external_draft_tokens", "must be a list of token ids (ints >= 0)")
            if self.use_beam_search and drafts:
                bad("external_draft_tokens", "cannot be verified with beam search")
        _check_draft_logits(self)
        if self.lookahead_config is not None:
            from petrel.engine.lookahead import check_lookahead_config

            check_lookahead_config("lookahead_config", self.lookahead_config)
            if self.use_beam_search:
                bad("lookahead_config", "cannot be used with beam search")
        table = self.prompt_embedding_table
        if table is not None:
            shape = tuple(getattr(table, "shape", ()))
            if len(shape) != 2 or shape[0] < 1 or not getattr(table, "is_floating_point", lambda: False)():
                raise ValueError(
                    "prompt_embedding_table (prompt_tuning_config.embedding_table) must be a floating-point tensor "
                    f"[num_virtual_tokens >= 1, hidden_size], got {type(table).__name__} of shape {shape}"
                )
            if self.prompt_logprobs is not None:
                bad("prompt_logprobs", "cannot score virtual prompt tokens (prompt_embedding_table is set)")

    def _validate_beam_search(self, bad: Callable[[str, str], NoReturn]) -> None:
        width = self.num_beams
        if not _is_int(width) or width < 1:
            bad("beam_width", "must be an integer >= 1")
        if self.n > width:
            bad("n", f"must be <= the beam width ({width})")
        if not isinstance(self.length_penalty, (int, float)):
            bad("length_penalty", "must be a number")
        if self.early_stopping not in (True, False, "never"):
            bad("early_stopping", "must be True, False or 'never'")
        if self.stop:
            bad("stop", "is not supported with beam search (use stop_token_ids or stop_token_sequences)")
        if not self.greedy and self.temperature != 1.0:
            bad(
                "temperature", "has no meaning for beam search (beams follow the log-probabilities); leave it at 0 or 1"
            )
        if self.top_p != 1.0 or self.top_k not in (0, 1) or self.min_p != 0.0:
            raise ValueError("top_p, top_k and min_p do not apply to beam search: leave them at their defaults")

    def validate_for_model(self, vocab_size: int, eos_token_ids: Iterable[int] = ()) -> None:
        """The limits that depend on the model: token ids and counts of tokens within its vocabulary, and some token
        left to generate (_check_bans; eos_token_ids: the model's end-of-sequence tokens, when known)."""
        if self.top_k > vocab_size:
            raise ValueError(
                f"top_k must be <= the vocabulary size ({vocab_size}), got {self.top_k} (0 or -1 keeps every token)"
            )
        # max() first: a pass in C over the ids (a bad word list may hold millions), Python only for a bad one
        words = [
            t
            for w in (self.bad_words_token_ids or []) + (self.stop_token_sequences or [])
            if max(w) >= vocab_size
            for t in w
        ]
        for name, ids in (
            ("external_draft_tokens", self.external_draft_tokens or []),
            ("stop_token_ids", self.stop_token_ids or []),
            ("logit_bias", list(self.logit_bias or {})),
            ("bad_words/stop words", words),
        ):
            bad = [t for t in ids if t >= vocab_size] if ids and max(ids) >= vocab_size else []
            if bad:
                raise ValueError(f"{name} has token ids outside the vocabulary (size {vocab_size}): {bad[:5]}")
        logits = self.external_draft_logits
        if logits is not None and logits.shape[1] != vocab_size:
            raise ValueError(
                f"external_draft_logits must have the vocabulary's size ({vocab_size}) per row, got shape "
                f"{tuple(logits.shape)}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and k > vocab_size:
                raise ValueError(f"{name} must be <= the vocabulary size ({vocab_size}), got {k}")
        self._check_bans(vocab_size, eos_token_ids)

    def _check_bans(self, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        """A request whose bans leave no token it could generate is refused (its ids are in the vocabulary by now).
        Single-token bad words are banned at every step; until min_tokens is reached, the stop token ids and the
        end-of-sequence tokens (unless ignore_eos) are banned too. Bans that only a grammar or a longer bad word
        complete are found when they happen: the sequence then ends there (finish_reason 'stop'), see Sampler."""
        banned = {w[0] for w in self.bad_words_token_ids or () if len(w) == 1}
        if len(banned) >= vocab_size:
            raise ValueError(
                f"bad_words_token_ids ban every token of the vocabulary ({vocab_size} ids; bad_token_ids over gRPC, "
                "bad_words in an executor Request): no token is left to generate"
            )
        if self.min_tokens > 0:
            ends = set(self.stop_token_ids or ()) | (set() if self.ignore_eos else set(eos_token_ids))
            if len(banned | {t for t in ends if t < vocab_size}) >= vocab_size:
                raise ValueError(
                    f"min_tokens ({self.min_tokens}) bans the stop token ids and end-of-sequence tokens until it is "
                    f"reached, and with bad_words_token_ids that is every token of the vocabulary ({vocab_size} "
                    "ids): no token is left to generate"
                )

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _is_int(value: object) -> bool:
    """An integer, not a bool (True is an int to Python, not a count or a token id to a request)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _lookahead_sizes(value: object) -> Any:
    """(window, ngram, verification set) from a 3-sequence or a lookahead config object (TensorRT-LLM's
    LookaheadDecodingConfig, or petrel.executor's); anything else as it came. Unchecked (Any): validate checks it."""
    names = ("max_window_size", "max_ngram_size", "max_verification_set_size")
    if all(hasattr(value, name) for name in names):
        return tuple(getattr(value, name) for name in names)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return value


def _check_draft_logits(params: SamplingParams) -> None:
    """external_draft_logits: a floating-point [len(external_draft_tokens), vocab] tensor of finite values or -inf
    (at least one finite a row), kept as float32 on the CPU; the threshold needs it and lies in (0, 1]."""
    logits, threshold = params.external_draft_logits, params.external_draft_acceptance_threshold
    if logits is not None:
        from petrel.engine.draft_acceptance import checked_draft_logits  # torch: only where logits are given

        if params.external_draft_tokens is None:
            raise ValueError("external_draft_logits needs external_draft_tokens (one row of logits per draft token)")
        logits = checked_draft_logits(logits, len(params.external_draft_tokens), "external_draft_logits")
        params.external_draft_logits = logits
    if threshold is not None:
        if logits is None:
            raise ValueError("external_draft_acceptance_threshold needs external_draft_logits (it compares p / q)")
        if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not 0.0 < threshold <= 1.0:
            raise ValueError(f"external_draft_acceptance_threshold must be in (0, 1], got {threshold!r}")
