"""A trtllm GenerateRequest -> petrel's SamplingParams and generate_async options. Anything petrel cannot honour is
a ValueError naming the proto field (the servicer answers INVALID_ARGUMENT with it)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from petrel.engine.kv_retention import make_retention
from petrel.guided_decoding import GuidedDecodingParams
from petrel.sampling_params import SamplingParams

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
UNSUPPORTED_REQUEST = ("prompt_tuning_config", "multimodal_input", "lookahead_config")
RETENTION_POLICIES = ("", "priority")  # kv_cache_retention.policy: TensorRT-LLM's priority-based retention
SAME_NAME = ("top_k", "top_p", "min_p", "temperature", "repetition_penalty", "presence_penalty", "frequency_penalty")


@dataclass
class GenerateLimits:
    max_model_len: int
    vocab_size: int
    max_n: int = 16
    lora_by_id: dict = field(default_factory=dict)  # task_id -> petrel LoRARequest (served adapters)


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


def check_prompt(ids: list[int], max_tokens: int | None, limits: GenerateLimits) -> int:
    """Checks the prompt's ids; returns max_tokens clamped to what the prompt leaves of the context (the gateway
    sends 2048 for a chat request without max_tokens; TensorRT-LLM clamps the same way; None: all of it)."""
    if not ids:
        raise ValueError("tokenized.input_token_ids is empty: at least one token is needed")
    bad = [t for t in ids if t >= limits.vocab_size]
    if bad:
        raise ValueError(f"tokenized.input_token_ids: {bad[:5]} outside the vocabulary (size {limits.vocab_size})")
    left = limits.max_model_len - len(ids)
    if left <= 0:
        raise ValueError(
            f"tokenized.input_token_ids has {len(ids)} tokens; this model's context is {limits.max_model_len}, "
            f"so at most {limits.max_model_len - 1} leave room to generate"
        )
    if max_tokens == 0:
        raise ValueError("max_tokens must be at least 1")
    return left if max_tokens is None else min(max_tokens, left)


def _sampling_kwargs(req, limits: GenerateLimits) -> dict:
    cfg = req.sampling_config
    n = cfg.num_return_sequences or 1
    if n > limits.max_n:
        raise ValueError(f"sampling_config.num_return_sequences is {n}; this server allows at most {limits.max_n}")
    kwargs: dict = {"n": n}
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


def _embedding_bias(req, vocab_size: int) -> dict[int, float] | None:
    bias = req.embedding_bias
    if not bias:
        return None
    if len(bias) != vocab_size:
        raise ValueError(f"embedding_bias has {len(bias)} values; it needs one per vocabulary token ({vocab_size})")
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


def _retention(retention) -> dict:
    """kv_cache_retention: policy '' or 'priority', config_json TensorRT-LLM's KvCacheRetentionConfig fields as
    JSON (token_range_retention_configs, decode_retention_priority, decode_duration_ms), checked by the engine."""
    if retention.policy not in RETENTION_POLICIES:
        raise ValueError(
            f"kv_cache_retention.policy must be one of {list(RETENTION_POLICIES)}, got {retention.policy!r}"
        )
    try:
        config = json.loads(retention.config_json or "{}")
    except json.JSONDecodeError as exc:
        raise ValueError(f"kv_cache_retention.config_json is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError("kv_cache_retention.config_json must be a JSON object")
    make_retention(config, "kv_cache_retention")  # malformed: INVALID_ARGUMENT before anything is queued
    return config


def generate_args(req, limits: GenerateLimits) -> GenerateArgs:
    """The prompt, SamplingParams and generate_async options a GenerateRequest asks for (ValueError naming the field
    petrel cannot honour)."""
    _check_supported(req)
    ids = list(req.tokenized.input_token_ids)
    max_tokens = check_prompt(ids, req.max_tokens, limits)
    kwargs = _sampling_kwargs(req, limits)
    kwargs.update(_output_kwargs(req))
    kwargs.update(
        max_tokens=max_tokens,
        stop=list(req.stop),
        stop_token_ids=list(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
        bad_words=list(req.bad),
        bad_words_token_ids=[[t] for t in req.bad_token_ids],
        logit_bias=_embedding_bias(req, limits.vocab_size),
    )
    if req.HasField("guided_decoding"):
        kwargs["guided_decoding"] = guided_params(req.guided_decoding)
    options: dict = {}
    if req.HasField("cache_salt_id"):
        options["cache_salt"] = str(req.cache_salt_id)
    lora = _lora(req, limits)
    if lora is not None:
        options["lora_request"] = lora
    if req.HasField("kv_cache_retention"):
        options["kv_cache_retention_config"] = _retention(req.kv_cache_retention)
    params = SamplingParams(**kwargs)
    params.validate_for_model(limits.vocab_size)
    return GenerateArgs(ids, params, options)
