"""An OpenAI request -> petrel SamplingParams, with every limit checked and named (APIError, 400)."""

from __future__ import annotations

from dataclasses import dataclass

from petrel.sampling_params import SamplingParams
from petrel.serve.errors import APIError, from_value_error

MAX_STOP_STRINGS = 64  # most stop strings per request: each one is searched for after every token
MAX_BAD_WORDS = 64  # most bad-word strings per request (gRPC `bad`): each is tokenized twice, checked every step


@dataclass
class ServerLimits:
    max_model_len: int
    vocab_size: int
    max_n: int = 16  # most choices per request
    max_prompts: int = 64  # most prompts in one /v1/completions request
    max_stop: int = MAX_STOP_STRINGS
    max_prompt_chars: int | None = None  # more characters cannot fit the context: refused before tokenizing


def parse_logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        try:
            tok = int(key)
        except ValueError:
            raise APIError(f"logit_bias keys must be token ids, got {key!r}", 400, param="logit_bias") from None
        if not 0 <= tok < vocab_size:
            raise APIError(
                f"logit_bias key {tok} is not a token id (the vocabulary has {vocab_size})", 400, param="logit_bias"
            )
        if not -100.0 <= value <= 100.0:
            raise APIError(f"logit_bias values must be in [-100, 100], got {value} for {key}", 400, param="logit_bias")
        out[tok] = float(value)
    return out


def check_prompt_chars(num_chars: int, limits: ServerLimits, param: str) -> None:
    """A prompt with more characters than the context could hold is refused before it is tokenized (tokenizing
    10 MB took the tokenizer tens of seconds and gigabytes, to learn that it is too long)."""
    if limits.max_prompt_chars is not None and num_chars > limits.max_prompt_chars:
        raise APIError(
            f"the prompt has {num_chars} characters, more than this model's {limits.max_model_len}-token "
            f"context can hold (at most {limits.max_prompt_chars} characters: no token is longer than "
            f"{limits.max_prompt_chars // limits.max_model_len})",
            400,
            param=param,
            code="context_length_exceeded",
        )


def check_prompt_length(num_prompt_tokens: int, limits: ServerLimits, param: str) -> None:
    if num_prompt_tokens == 0:
        raise APIError("the prompt is empty: at least one token is needed", 400, param=param)
    if num_prompt_tokens >= limits.max_model_len:
        raise APIError(
            f"this model's maximum context length is {limits.max_model_len} tokens, and the prompt "
            f"has {num_prompt_tokens}: at most {limits.max_model_len - 1} leave room to generate",
            400,
            param=param,
            code="context_length_exceeded",
        )


def resolve_max_tokens(
    requested: int | None, default: int | None, num_prompt_tokens: int, limits: ServerLimits, param: str
) -> int:
    """`requested` must fit in what the prompt leaves of the context; without it, `default` capped to fit
    (None: all that is left)."""
    left = limits.max_model_len - num_prompt_tokens
    if requested is not None:
        if requested > left:
            raise APIError(
                f"{param} is {requested}, but the prompt ({num_prompt_tokens} tokens) leaves only {left} "
                f"of the model's {limits.max_model_len}-token context",
                400,
                param=param,
                code="context_length_exceeded",
            )
        return requested
    return left if default is None else min(default, left)


def build_sampling_params(
    req,
    *,
    max_tokens: int,
    limits: ServerLimits,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    extra_stop: list[str] | None = None,
    renames: dict[str, str] | None = None,
    guided_decoding=None,
) -> SamplingParams:
    """The fields both endpoints share; `req` is a CompletionRequest or ChatCompletionRequest."""
    if req.n > limits.max_n:
        raise APIError(f"n is {req.n}; this server allows at most {limits.max_n}", 400, param="n")
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options needs stream=true", 400, param="stream_options")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > limits.max_stop:
        raise APIError(f"stop has {len(stop)} strings; this server allows at most {limits.max_stop}", 400, param="stop")
    kwargs = dict(
        n=req.n,
        max_tokens=max_tokens,
        stop=stop + list(extra_stop or []),
        stop_token_ids=req.stop_token_ids,
        seed=req.seed,
        logit_bias=parse_logit_bias(req.logit_bias, limits.vocab_size),
        ignore_eos=req.ignore_eos,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        return_perf_metrics=True,
        guided_decoding=guided_decoding,
    )
    for name, default in (
        ("temperature", 1.0),
        ("top_p", 1.0),
        ("top_k", 0),
        ("min_p", 0.0),
        ("repetition_penalty", 1.0),
        ("presence_penalty", 0.0),
        ("frequency_penalty", 0.0),
        ("min_tokens", 0),
    ):
        value = getattr(req, name)
        kwargs[name] = default if value is None else value
    if kwargs["min_tokens"] > max_tokens:
        raise APIError(
            f"min_tokens ({kwargs['min_tokens']}) is more than max_tokens ({max_tokens})", 400, param="min_tokens"
        )
    try:
        params = SamplingParams(**kwargs)
        params.validate_for_model(limits.vocab_size)
    except ValueError as exc:
        raise from_value_error(exc, renames) from None
    return params
