"""What the LLM front does with a request's DisaggregatedParams before queueing it: check it, and for a
generation-only request fetch its prompt's KV (network I/O: on the caller's thread, never the engine loop's)."""
from __future__ import annotations

from petrel.disagg.kv_transfer import fetch_kv
from petrel.disagg.params import DisaggregatedParams, KVTransferStats


def coerce(value) -> DisaggregatedParams | None:
    if value is None or isinstance(value, DisaggregatedParams):
        return value
    if isinstance(value, dict):
        return DisaggregatedParams.from_dict(value)
    raise ValueError(f"disaggregated_params must be a DisaggregatedParams or a dict, got {type(value).__name__}")


def check(dp: DisaggregatedParams, params, prompt_ids: list[int], vocab_size: int, max_model_len: int,
          kv_cache_tokens: int | None = None) -> None:
    """ValueError naming disaggregated_params for a combination the split cannot run.

    kv_cache_tokens: what the whole KV cache holds; a split request's prompt KV is held (pinned, or imported) whole,
    even where sliding-window blocks are given back and max_model_len is longer than the cache."""
    dp.validate(vocab_size)
    if dp.request_type == "context_and_generation":
        return
    if kv_cache_tokens is not None and len(prompt_ids) + 1 > kv_cache_tokens:
        raise ValueError(f"disaggregated_params: the prompt ({len(prompt_ids)} tokens) and the first token must fit "
                         f"the {kv_cache_tokens}-token KV cache whole")
    unsupported = [name for name, on in (
        ("n > 1", params.n > 1), ("beam search", params.use_beam_search),
        ("prompt logprobs or context outputs", params.needs_context_outputs),
        ("guided decoding", params.guided_decoding is not None),
        ("logprobs (the first token's would stay on the context instance)", params.logprobs is not None),
    ) if on]
    if unsupported:
        raise ValueError(f"disaggregated_params: a {dp.request_type} request cannot have {', '.join(unsupported)}")
    if dp.is_generation_only:
        if params.max_tokens is not None and params.max_tokens < 2:
            raise ValueError("disaggregated_params: a generation_only request needs max_tokens >= 2 "
                             "(the context instance sampled the first token)")
        if len(prompt_ids) + 1 >= max_model_len:
            raise ValueError(f"disaggregated_params: the prompt ({len(prompt_ids)} tokens) and the first token "
                             f"leave no room to generate in the {max_model_len}-token context")


def request_options(dp: DisaggregatedParams | None, prompt_ids: list[int], model_config,
                    timeout: float) -> tuple[dict, KVTransferStats | None]:
    """The EngineRequest fields for this request (fetching the KV of a generation-only one), and the fetch's stats."""
    if dp is None or dp.request_type == "context_and_generation":
        return {}, None
    if dp.is_context_only:
        return {"context_only": True}, None
    kv, stats = fetch_kv(dp.ctx_info_endpoint, dp.opaque_state, timeout)
    expected = (model_config.num_hidden_layers, 2, len(prompt_ids), model_config.num_key_value_heads,
                model_config.head_dim)
    if tuple(kv.shape) != expected:
        raise ValueError(f"disaggregated_params: the context instance sent KV of shape {list(kv.shape)}, this model "
                         f"and prompt need {list(expected)} (a different model, or not this prompt)")
    return {"imported_kv": kv, "first_gen_tokens": list(dp.first_gen_tokens)}, stats
