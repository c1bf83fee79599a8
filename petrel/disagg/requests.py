"""What the LLM front does with a request's DisaggregatedParams before queueing it: check it against this
instance's role (kv_transfer_role) and peers, reserve room for a context-only prompt's pin, and for a
generation-only request fetch its prompt's KV (network I/O: on the caller's thread, never the engine loop's)."""

from __future__ import annotations

from petrel.config import parse_endpoint
from petrel.disagg.kv_transfer import fetch_kv
from petrel.disagg.params import DisaggregatedParams, KVTransferBusy, KVTransferStats
from petrel.engine.pinned_prompts import PinLimitReached, PinReservation
from petrel.model.kv_layout import kv_layout_of


def coerce(value) -> DisaggregatedParams | None:
    if value is None or isinstance(value, DisaggregatedParams):
        return value
    if isinstance(value, dict):
        return DisaggregatedParams.from_dict(value)
    raise ValueError(f"disaggregated_params must be a DisaggregatedParams or a dict, got {type(value).__name__}")


def check(dp: DisaggregatedParams, params, prompt_ids: list[int], engine, config) -> None:
    """ValueError naming disaggregated_params for a request this instance may not or cannot run: a split request
    where its kv_transfer_role does not take that side, a fetch from an endpoint outside kv_transfer_peers (refused
    here, before any connection), or a combination the split cannot run.

    A split request's prompt KV is held (pinned, or imported) whole: it must fit the KV cache (engine
    .kv_cache_tokens), even where sliding-window blocks are given back and max_model_len is longer than the cache."""
    dp.validate(engine.model_config.vocab_size)
    if dp.request_type == "context_and_generation":
        return
    check_role(dp, config)
    if len(prompt_ids) + 1 > engine.kv_cache_tokens:
        raise ValueError(
            f"disaggregated_params: the prompt ({len(prompt_ids)} tokens) and the first token must fit "
            f"the {engine.kv_cache_tokens}-token KV cache whole"
        )
    unsupported = [
        name
        for name, on in (
            ("n > 1", params.n > 1),
            ("beam search", params.use_beam_search),
            ("prompt logprobs or context outputs", params.needs_context_outputs),
            ("guided decoding", params.guided_decoding is not None),
            ("logprobs (the first token's would stay on the context instance)", params.logprobs is not None),
        )
        if on
    ]
    if unsupported:
        raise ValueError(f"disaggregated_params: a {dp.request_type} request cannot have {', '.join(unsupported)}")
    if dp.is_generation_only:
        if params.max_tokens is not None and params.max_tokens < 2:
            raise ValueError(
                "disaggregated_params: a generation_only request needs max_tokens >= 2 "
                "(the context instance sampled the first token)"
            )
        if len(prompt_ids) + 1 >= engine.max_model_len:
            raise ValueError(
                f"disaggregated_params: the prompt ({len(prompt_ids)} tokens) and the first token "
                f"leave no room to generate in the {engine.max_model_len}-token context"
            )


def check_role(dp: DisaggregatedParams, config) -> None:
    """A context_only request needs a prefill role, a generation_only one a decode role and an endpoint among the
    peers: ValueError naming disaggregated_params otherwise."""
    role = config.kv_transfer_role
    if role is None:
        raise ValueError(
            f"disaggregated_params: a {dp.request_type} request needs disaggregated serving, which is "
            "off on this instance; start it with kv_transfer_role 'prefill' or 'decode' "
            "(petrel serve --kv-transfer-role)"
        )
    if dp.is_context_only and not config.serves_kv:
        raise ValueError(
            f"disaggregated_params.request_type: this instance's kv_transfer_role is {role!r}: it "
            "answers generation_only requests, not context_only ones"
        )
    if dp.is_generation_only and not config.fetches_kv:
        raise ValueError(
            f"disaggregated_params.request_type: this instance's kv_transfer_role is {role!r}: it "
            "answers context_only requests, not generation_only ones"
        )
    if dp.is_generation_only and peer(dp) not in config.kv_transfer_peers:
        raise ValueError(
            f"disaggregated_params.ctx_info_endpoint: {dp.ctx_info_endpoint!r} is not one of this "
            "instance's prefill peers (kv_transfer_peers)"
        )


def peer(dp: DisaggregatedParams) -> str:
    """The context instance's endpoint, in the form kv_transfer_peers holds."""
    return parse_endpoint(dp.ctx_info_endpoint, "disaggregated_params.ctx_info_endpoint")


def reserve_pin(dp: DisaggregatedParams | None, prompt_ids: list[int], pinned, config) -> PinReservation | None:
    """For a context-only request, room for its prompt's pin (KVTransferBusy when the cap is reached)."""
    if dp is None or not dp.is_context_only:
        return None
    max_blocks = int(config.kv_transfer_max_pinned_share * pinned.block_manager.num_blocks)
    try:
        return pinned.reserve(len(prompt_ids), config.kv_transfer_max_pinned, max_blocks)
    except PinLimitReached as exc:
        raise KVTransferBusy(str(exc)) from None


def request_options(
    dp: DisaggregatedParams | None, prompt_ids: list[int], model_config, config, events=None
) -> tuple[dict, KVTransferStats | None]:
    """The EngineRequest fields for this request (fetching the KV of a generation-only one, no larger than this
    prompt's: [layers, planes, prompt tokens, heads, width], petrel/model/kv_layout.py), and the fetch's stats.
    `events` (the engine's RequestEvents) hears of the fetch, or of its failure."""
    if dp is None or dp.request_type == "context_and_generation":
        return {}, None
    if dp.is_context_only:
        return {"context_only": True}, None
    layout = kv_layout_of(model_config)  # a latent cache moves its one row a token
    shape = (model_config.num_hidden_layers, layout.planes, len(prompt_ids), layout.heads, layout.width)
    endpoint = peer(dp)
    try:
        kv, stats = fetch_kv(endpoint, dp.opaque_state, config.kv_transfer_secret, shape, config.kv_transfer_timeout)
    except Exception:
        if events is not None:
            events.kv_fetch_failed()
        raise
    if events is not None:
        events.kv_fetched(stats.num_bytes, stats.seconds)
    return {"imported_kv": kv, "first_gen_tokens": list(dp.first_gen_tokens)}, stats


def context_params(handoff, endpoint: str | None) -> DisaggregatedParams:
    """What a context-only request reports: the engine's record of its pinned prompt (a PromptHandoff) as the
    DisaggregatedParams a decode instance needs, with this instance's KV transfer endpoint."""
    if isinstance(handoff, DisaggregatedParams):
        handoff.ctx_info_endpoint = endpoint
        return handoff
    return DisaggregatedParams(
        request_type="context_only",
        first_gen_tokens=list(handoff.first_gen_tokens),
        ctx_request_id=handoff.request_id,
        opaque_state=handoff.handle,
        ctx_info_endpoint=endpoint,
    )
