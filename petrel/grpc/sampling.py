"""A trtllm GenerateRequest -> petrel's SamplingParams and generate_async options. Anything petrel cannot honour is
a ValueError naming the proto field (the servicer answers INVALID_ARGUMENT with it).

Every list a request carries has the HTTP server's limit (the constants are shared: petrel/serve/params.py and
protocol.py), checked from the lists' lengths before any work that grows with them: 100,000 `bad` strings are
refused at once, naming `bad`, where they used to be tokenized and de-duplicated for minutes."""

from __future__ import annotations

from dataclasses import dataclass, field

from petrel.guided_decoding import GuidedDecodingLimits, GuidedDecodingParams
from petrel.sampling_params import SamplingParams
from petrel.serve.params import MAX_BAD_WORDS, MAX_STOP_STRINGS
from petrel.serve.protocol import MAX_ITEMS, MAX_LOGPROBS

# SamplingConfig fields petrel has no counterpart for: refused when set (proto3 `optional`: HasField)
UNSUPPORTED_SAMPLING = (
    "top_p_min",
    "top_p_reset_ids",
    "top_p_decay",
    "beam_search_diversity_rate",
    "prompt_ignore_length",
    "no_repeat_ngram_size",
)
# GenerateRequest fields petrel does not serve: refused when present
UNSUPPORTED_REQUEST = ("prompt_tuning_config", "multimodal_input", "kv_cache_retention", "lookahead_config")
SAME_NAME = ("top_k", "top_p", "min_p", "temperature", "repetition_penalty", "presence_penalty", "frequency_penalty")
# a request larger than this is prepared off the gRPC event loop (below it, a few ms of work: ~25k token ids)
INLINE_BYTES = 64 * 1024
# a guided-decoding constraint's text: none over GuidedDecodingLimits' 128 KiB compiles, this leaves room for
# whitespace; longer ones are refused before their nesting is scanned (4 MB held the interpreter for 0.6 s)
MAX_GUIDE_CHARS = 8 * GuidedDecodingLimits().max_grammar_bytes


@dataclass
class GenerateLimits:
    """What one request may ask for: the HTTP server's limits, so a request is refused alike on either front."""

    max_model_len: int
    vocab_size: int
    max_n: int = 16  # choices (n, num_return_sequences) and beams
    lora_by_id: dict = field(default_factory=dict)  # task_id -> petrel LoRARequest (served adapters)
    max_stop: int = MAX_STOP_STRINGS
    max_bad_words: int = MAX_BAD_WORDS
    max_ids: int = MAX_ITEMS  # token ids in one list (stop / bad token ids), entries of a logit bias or a choice
    max_logprobs: int = MAX_LOGPROBS  # alternatives per token, generated or prompt


@dataclass
class GenerateArgs:
    prompt_token_ids: list[int]
    params: SamplingParams
    options: dict  # generate_async keywords: cache_salt, lora_request, disaggregated_params


def guided_params(guided) -> GuidedDecodingParams:
    kinds = type(guided).GuideType
    kind, guide = guided.guide_type, guided.guide
    if kind == kinds.GUIDE_TYPE_JSON:
        return GuidedDecodingParams(json_object=True) if not guide else GuidedDecodingParams(json=guide)
    if kind == kinds.GUIDE_TYPE_JSON_SCHEMA:
        return GuidedDecodingParams(json=guide or "{}")
    if kind == kinds.GUIDE_TYPE_REGEX:
        return GuidedDecodingParams(regex=guide)
    if kind == kinds.GUIDE_TYPE_EBNF_GRAMMAR:
        return GuidedDecodingParams(grammar=guide)
    if kind == kinds.GUIDE_TYPE_STRUCTURAL_TAG:
        return GuidedDecodingParams(structural_tag=guide)
    raise ValueError("guided_decoding.guide_type must be set (JSON, JSON_SCHEMA, REGEX, EBNF_GRAMMAR, STRUCTURAL_TAG)")


def _check_supported(req) -> None:
    for name in UNSUPPORTED_REQUEST:
        if req.HasField(name):
            raise ValueError(f"{name} is not supported by petrel")
    if req.tokenized.query_token_ids:
        raise ValueError("tokenized.query_token_ids is not supported by petrel")
    cfg = req.sampling_config
    for name in UNSUPPORTED_SAMPLING:
        if cfg.HasField(name):
            raise ValueError(f"sampling_config.{name} is not supported by petrel")
    if cfg.beam_width_array:
        raise ValueError("sampling_config.beam_width_array is not supported by petrel")
    out = req.output_config
    if out.return_perf_metrics:
        raise ValueError("output_config.return_perf_metrics is not supported over gRPC")
    if out.return_encoder_output:
        raise ValueError("output_config.return_encoder_output is not supported by petrel (decoder-only models)")
    if req.HasField("output_config") and not out.exclude_input_from_output:
        raise ValueError("output_config.exclude_input_from_output must be true: petrel returns only output tokens")
    if req.HasField("disaggregated_params"):
        raise ValueError("disaggregated_params is not supported over the trtllm service")


def check_count(name: str, count: int, most: int, what: str) -> None:
    if count > most:
        raise ValueError(f"{name} has {count} {what}; this server allows at most {most}")


def check_most(name: str, value: int, most: int) -> None:
    if value > most:
        raise ValueError(f"{name} is {value}; this server allows at most {most}")


def check_prompt_length(name: str, num_ids: int, limits: GenerateLimits) -> None:
    if num_ids == 0:
        raise ValueError(f"{name} is empty: at least one token is needed")
    if num_ids >= limits.max_model_len:
        raise ValueError(
            f"{name} has {num_ids} tokens; this model's context is {limits.max_model_len}, "
            f"so at most {limits.max_model_len - 1} leave room to generate"
        )


def check_logprobs(name: str, value: int, limits: GenerateLimits) -> None:
    if not 0 <= value <= limits.max_logprobs:
        raise ValueError(f"{name} is {value}; this server allows 0 to {limits.max_logprobs} alternatives per token")


def check_sizes(req, limits: GenerateLimits) -> None:
    """Every list the request carries against its limit, from the lists' lengths alone (constant time): a
    ValueError naming the first field past its limit."""
    check_prompt_length("tokenized.input_token_ids", len(req.tokenized.input_token_ids), limits)
    check_count("stop", len(req.stop), limits.max_stop, "strings")
    check_count("bad", len(req.bad), limits.max_bad_words, "strings")
    check_count("stop_token_ids", len(req.stop_token_ids), limits.max_ids, "token ids")
    check_count("bad_token_ids", len(req.bad_token_ids), limits.max_ids, "token ids")
    check_count("guided_decoding.guide", len(req.guided_decoding.guide), MAX_GUIDE_CHARS, "characters")
    if req.embedding_bias and len(req.embedding_bias) != limits.vocab_size:
        raise ValueError(
            f"embedding_bias has {len(req.embedding_bias)} values; it needs one per vocabulary token "
            f"({limits.vocab_size})"
        )
    cfg = req.sampling_config
    check_most("sampling_config.num_return_sequences", cfg.num_return_sequences, limits.max_n)
    check_most("sampling_config.beam_width", cfg.beam_width, limits.max_n)
    out = req.output_config
    for name in ("logprobs", "prompt_logprobs"):
        if out.HasField(name):
            check_logprobs(f"output_config.{name}", getattr(out, name), limits)


def prepares_slowly(req) -> bool:
    """Preparing the request may take long (its bad words are tokenized, or it is large): done off the event loop."""
    return bool(req.bad) or req.ByteSize() > INLINE_BYTES


def check_prompt(
    ids: list[int], max_tokens: int | None, limits: GenerateLimits, name: str = "tokenized.input_token_ids"
) -> int:
    """Checks the prompt's ids (the field `name`); returns max_tokens clamped to what the prompt leaves of the
    context (the gateway sends 2048 for a chat request without max_tokens; TensorRT-LLM clamps the same way; None:
    all of it)."""
    check_prompt_length(name, len(ids), limits)  # before a pass over ids of any length
    bad = [t for t in ids if t >= limits.vocab_size]
    if bad:
        raise ValueError(f"{name}: {bad[:5]} outside the vocabulary (size {limits.vocab_size})")
    left = limits.max_model_len - len(ids)
    if max_tokens == 0:
        raise ValueError("max_tokens must be at least 1")
    return left if max_tokens is None else min(max_tokens, left)


def _sampling_kwargs(req) -> dict:
    cfg = req.sampling_config
    kwargs: dict = {"n": cfg.num_return_sequences or 1}
    for name in SAME_NAME:
        if cfg.HasField(name):
            kwargs[name] = getattr(cfg, name)
    if cfg.HasField("seed"):
        kwargs["seed"] = cfg.seed
    if cfg.HasField("min_tokens"):
        kwargs["min_tokens"] = cfg.min_tokens
    if cfg.beam_width > 1:
        kwargs.update(use_beam_search=True, beam_width=cfg.beam_width)
        if cfg.HasField("length_penalty"):
            kwargs["length_penalty"] = cfg.length_penalty
        if cfg.HasField("early_stopping"):
            kwargs["early_stopping"] = bool(cfg.early_stopping)
    elif cfg.HasField("length_penalty") or cfg.HasField("early_stopping"):
        raise ValueError("sampling_config.length_penalty and early_stopping go with beam_width > 1")
    return kwargs


def _output_kwargs(req) -> dict:
    out = req.output_config
    kwargs: dict = {}
    if out.HasField("logprobs"):
        kwargs["logprobs"] = out.logprobs
    if out.HasField("prompt_logprobs"):
        kwargs["prompt_logprobs"] = out.prompt_logprobs
    kwargs["return_context_logits"] = out.return_context_logits
    kwargs["return_generation_logits"] = out.return_generation_logits
    return kwargs


def _embedding_bias(req) -> dict[int, float] | None:
    bias = req.embedding_bias  # its length: check_sizes
    if not bias:
        return None
    return {i: float(b) for i, b in enumerate(bias) if b}


def _lora(req, limits: GenerateLimits):
    if not req.HasField("lora_config"):
        return None
    lora = req.lora_config
    if lora.HasField("weights") or lora.HasField("config_json"):
        raise ValueError(
            "lora_config.weights / config_json are not supported: petrel serves adapters loaded at start "
            "(--lora-modules); send only lora_config.task_id"
        )
    if lora.task_id not in limits.lora_by_id:
        known = sorted(limits.lora_by_id) or "none"
        raise ValueError(f"lora_config.task_id {lora.task_id} names no served LoRA adapter (served: {known})")
    return limits.lora_by_id[lora.task_id]


def generate_args(req, limits: GenerateLimits) -> GenerateArgs:
    """The prompt, SamplingParams and generate_async options a GenerateRequest asks for (ValueError naming the field
    petrel cannot honour). Token id lists lose their repeats (each id is looked up after every token)."""
    check_sizes(req, limits)
    _check_supported(req)
    ids = list(req.tokenized.input_token_ids)
    max_tokens = check_prompt(ids, req.max_tokens, limits)
    kwargs = _sampling_kwargs(req)
    kwargs.update(_output_kwargs(req))
    kwargs.update(
        max_tokens=max_tokens,
        stop=list(req.stop),
        stop_token_ids=list(dict.fromkeys(req.stop_token_ids)),
        ignore_eos=req.ignore_eos,
        bad_words=list(req.bad),
        bad_words_token_ids=[[t] for t in dict.fromkeys(req.bad_token_ids)],
        logit_bias=_embedding_bias(req),
    )
    if req.HasField("guided_decoding"):
        kwargs["guided_decoding"] = guided_params(req.guided_decoding)
    options: dict = {}
    if req.HasField("cache_salt_id"):
        options["cache_salt"] = str(req.cache_salt_id)
    lora = _lora(req, limits)
    if lora is not None:
        options["lora_request"] = lora
    params = SamplingParams(**kwargs)
    params.validate_for_model(limits.vocab_size)
    return GenerateArgs(ids, params, options)
