"""A vLLM-protocol GenerateRequest (smg's `vllm.grpc.engine` service) -> petrel's GenerateArgs. Its
`kv_transfer_params_json` carries petrel's DisaggregatedParams from the prefill worker to the decode worker:
at a worker whose role is 'prefill' a request without it runs context-only; with it, generation-only."""

from __future__ import annotations

import json

from petrel.disagg import DisaggregatedParams
from petrel.grpc.sampling import (
    INLINE_BYTES,
    MAX_GUIDE_CHARS,
    GenerateArgs,
    GenerateLimits,
    check_count,
    check_logprobs,
    check_most,
    check_prompt,
    check_prompt_length,
)
from petrel.guided_decoding import GuidedDecodingParams
from petrel.sampling_params import SamplingParams

SAME_NAME = ("top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_tokens")


def _guided(sp) -> GuidedDecodingParams | None:
    kind = sp.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_schema":
        return GuidedDecodingParams(json=sp.json_schema)
    if kind == "json_object":
        return GuidedDecodingParams(json_object=True) if sp.json_object else None
    if kind == "choice":
        return GuidedDecodingParams(choice=list(sp.choice.choices))
    return GuidedDecodingParams(**{kind: getattr(sp, kind)})


def _disaggregated(req, role: str | None) -> DisaggregatedParams | None:
    """generation_only from the prefill's JSON; context_only at a prefill worker; else None (run whole)."""
    text = req.kv_transfer_params_json if req.HasField("kv_transfer_params_json") else ""
    if text:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"kv_transfer_params_json is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("kv_transfer_params_json must be a JSON object")
        return DisaggregatedParams.from_dict(dict(data, request_type="generation_only"))
    if role == "prefill":
        return DisaggregatedParams(request_type="context_only")
    return None


def check_sizes(req, limits: GenerateLimits) -> None:
    """Every list the request carries against its limit (the HTTP server's), from the lists' lengths alone: a
    ValueError naming the first field past its limit."""
    if req.WhichOneof("input") == "tokenized":
        check_prompt_length("tokenized.input_ids", len(req.tokenized.input_ids), limits)
    sp = req.sampling_params
    check_count("sampling_params.stop", len(sp.stop), limits.max_stop, "strings")
    check_count("sampling_params.stop_token_ids", len(sp.stop_token_ids), limits.max_ids, "token ids")
    check_count("sampling_params.logit_bias", len(sp.logit_bias), limits.max_ids, "entries")
    kind = sp.WhichOneof("constraint")
    if kind == "choice":
        check_count("sampling_params.choice.choices", len(sp.choice.choices), limits.max_ids, "strings")
    elif kind in ("json_schema", "regex", "grammar", "structural_tag"):
        check_count(f"sampling_params.{kind}", len(getattr(sp, kind)), MAX_GUIDE_CHARS, "characters")
    check_most("sampling_params.n", sp.n, limits.max_n)
    for name in ("logprobs", "prompt_logprobs"):
        if sp.HasField(name):
            check_logprobs(f"sampling_params.{name}", getattr(sp, name), limits)


def prepares_slowly(req) -> bool:
    """Preparing the request may take long (it is large): done off the event loop."""
    return req.ByteSize() > INLINE_BYTES


def vllm_generate_args(req, limits: GenerateLimits, role: str | None = None) -> GenerateArgs:
    """The prompt, SamplingParams and generate_async options a vLLM GenerateRequest asks for (ValueError naming the
    field petrel cannot honour); stop token ids lose their repeats."""
    check_sizes(req, limits)
    if req.WhichOneof("input") != "tokenized":
        raise ValueError("tokenized: petrel's gRPC worker takes token ids (the gateway tokenizes)")
    if req.HasField("mm_inputs") or req.extra_mm_inputs or req.HasField("media_refs"):
        raise ValueError("mm_inputs: multimodal input is not supported by petrel")
    if req.HasField("kv_transfer_params"):
        raise ValueError("kv_transfer_params (Mooncake) is not supported: petrel uses kv_transfer_params_json")
    sp = req.sampling_params
    if sp.HasField("truncate_prompt_tokens"):
        raise ValueError("sampling_params.truncate_prompt_tokens is not supported by petrel")
    ids = list(req.tokenized.input_ids)
    max_tokens = check_prompt(ids, sp.max_tokens if sp.HasField("max_tokens") else None, limits, "tokenized.input_ids")
    n = sp.n or 1
    kwargs: dict = {name: getattr(sp, name) for name in SAME_NAME}
    kwargs["top_p"] = sp.top_p or 1.0
    kwargs["repetition_penalty"] = sp.repetition_penalty or 1.0
    kwargs.update(
        n=n,
        max_tokens=max_tokens,
        top_k=sp.top_k,
        stop=list(sp.stop),
        stop_token_ids=list(dict.fromkeys(sp.stop_token_ids)),
        ignore_eos=sp.ignore_eos,
        skip_special_tokens=sp.skip_special_tokens,
        include_stop_str_in_output=sp.include_stop_str_in_output,
        logit_bias=dict(sp.logit_bias) or None,
        guided_decoding=_guided(sp),
    )
    if sp.HasField("temperature"):
        kwargs["temperature"] = sp.temperature
    if sp.HasField("seed"):
        kwargs["seed"] = sp.seed
    if sp.HasField("logprobs"):
        kwargs["logprobs"] = sp.logprobs
    if sp.HasField("prompt_logprobs"):
        kwargs["prompt_logprobs"] = sp.prompt_logprobs
    options: dict = {}
    dp = _disaggregated(req, role)
    if dp is not None and dp.is_generation_only and max_tokens < 2:
        dp = None  # nothing to decode after the prefill's token: run it whole (the pinned prompt expires unfetched)
    if dp is not None and dp.is_context_only:
        # the prefill leg (the gateway sends max_tokens 1, ignore_eos): the prompt's KV is handed off after the first
        # token unless that token ends the request (then no params go back and the decode worker runs it whole)
        kwargs.update(
            max_tokens=min(2, limits.max_model_len - len(ids)),
            n=1,
            logprobs=None,
            prompt_logprobs=None,
            ignore_eos=False,
        )
    if dp is not None:
        options["disaggregated_params"] = dp
    params = SamplingParams(**kwargs)
    params.validate_for_model(limits.vocab_size)
    return GenerateArgs(ids, params, options)
