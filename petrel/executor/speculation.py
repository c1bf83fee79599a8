"""Speculative decoding through the Executor: a Request's external_draft_tokens_config and lookahead_config as
SamplingParams fields, and ExecutorConfig.decoding_config's lookahead maximum as the engine's speculative_config.
Every value petrel cannot honour is a ValueError naming its field."""

from __future__ import annotations

import dataclasses

import torch

from petrel.config import EngineConfig, SpeculativeConfig
from petrel.engine.draft_acceptance import checked_draft_logits
from petrel.executor.types import DecodingConfig, LookaheadDecodingConfig, Request

DECODING_MODES = (None, "auto", "lookahead")


def speculation_fields(request: Request, vocab_size: int) -> dict:
    """The SamplingParams fields of the request's external drafts (tokens, logits, acceptance threshold) and of
    its lookahead sizes. SamplingParams checks the values; this checks what only the Executor's types carry."""
    extra: dict = {}
    lookahead = request.lookahead_config
    if lookahead is not None:
        if not isinstance(lookahead, LookaheadDecodingConfig):
            raise ValueError(f"lookahead_config must be a LookaheadDecodingConfig, got {type(lookahead).__name__}")
        extra["lookahead_config"] = lookahead
    drafts = request.external_draft_tokens_config
    if drafts is None:
        return extra
    name = "external_draft_tokens_config"
    if not drafts.tokens:
        raise ValueError(f"{name}.tokens is empty: give at least one draft token")
    extra["external_draft_tokens"] = list(drafts.tokens)
    if drafts.fast_logits is not None and not isinstance(drafts.fast_logits, bool):
        raise ValueError(f"{name}.fast_logits must be a bool, got {drafts.fast_logits!r}")
    logits = drafts.logits
    if logits is not None:
        try:
            logits = torch.as_tensor(logits)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"{name}.logits must be a tensor [len(tokens), vocab]") from None
        expected = (len(drafts.tokens), vocab_size)
        if tuple(logits.shape) != expected:
            if drafts.fast_logits:
                raise ValueError(
                    f"{name}.fast_logits: petrel takes the draft logits themselves {list(expected)} in the request "
                    f"(TensorRT-LLM's transfer descriptor between executors has no meaning here), got shape "
                    f"{tuple(logits.shape)}"
                )
            raise ValueError(
                f"{name}.logits must be [len(tokens), vocab] = {list(expected)}, got {tuple(logits.shape)}"
            )
        extra["external_draft_logits"] = checked_draft_logits(logits, len(drafts.tokens), f"{name}.logits")
    threshold = drafts.acceptance_threshold
    if threshold is not None:
        if logits is None:
            raise ValueError(f"{name}.acceptance_threshold needs logits (it compares p / q)")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 < threshold <= 1.0:
            raise ValueError(f"{name}.acceptance_threshold must be in (0, 1], got {threshold!r}")
        extra["external_draft_acceptance_threshold"] = float(threshold)
    return extra


def apply_decoding_config(decoding: DecodingConfig | None, engine_config: EngineConfig) -> EngineConfig:
    """ExecutorConfig.decoding_config onto the engine's options: a lookahead_decoding_config becomes
    speculative_config method 'lookahead' with its sizes as the maximum."""
    if decoding is None:
        return engine_config
    if not isinstance(decoding, DecodingConfig):
        raise ValueError(f"decoding_config must be a DecodingConfig, got {type(decoding).__name__}")
    mode = decoding.decoding_mode.lower() if isinstance(decoding.decoding_mode, str) else decoding.decoding_mode
    if mode not in DECODING_MODES:
        raise ValueError(f"decoding_config.decoding_mode must be one of {list(DECODING_MODES)}, got {mode!r}")
    lookahead = decoding.lookahead_decoding_config
    if lookahead is None:
        if mode == "lookahead":
            raise ValueError("decoding_config.decoding_mode 'lookahead' needs a lookahead_decoding_config")
        return engine_config
    if not isinstance(lookahead, LookaheadDecodingConfig):
        raise ValueError(
            "decoding_config.lookahead_decoding_config must be a LookaheadDecodingConfig, got "
            f"{type(lookahead).__name__}"
        )
    existing = SpeculativeConfig.coerce(engine_config.speculative_config)
    if existing is not None:
        raise ValueError(
            "decoding_config.lookahead_decoding_config: the engine already has a speculative_config "
            f"(method {existing.method!r})"
        )
    try:
        spec = SpeculativeConfig.coerce(lookahead)
    except ValueError as exc:
        raise ValueError(f"decoding_config.lookahead_decoding_config: {exc}") from None
    return dataclasses.replace(engine_config, speculative_config=spec)
