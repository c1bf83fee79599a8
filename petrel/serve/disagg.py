"""The server's side of disaggregated serving: the `disaggregated_params` request field checked, the request
submitted (a generation-only one fetches its prompt's KV first, off the event loop), and what the response
carries back (a context-only choice's DisaggregatedParams, a generation-only usage's KV transfer)."""
from __future__ import annotations

import asyncio

from petrel.disagg import DisaggregatedParams
from petrel.disagg.kv_transfer import KVTransferError
from petrel.serve.errors import APIError

PARAM = "disaggregated_params"


def from_request(req, num_prompts: int) -> DisaggregatedParams | None:
    model = req.disaggregated_params
    if model is None:
        return None
    dp = DisaggregatedParams(**model.model_dump())
    if dp.request_type == "context_and_generation":
        return None
    if num_prompts != 1:
        raise APIError(f"disaggregated_params: a {dp.request_type} request takes one prompt, got {num_prompts}", 400,
                       param=PARAM)
    if dp.is_context_only and req.stream:
        raise APIError("disaggregated_params: a context_only request returns one token and its parameters: "
                       "it cannot stream", 400, param=PARAM)
    return dp


async def submit(state, ids, params, stream: bool, cache_salt, lora_request, dp: DisaggregatedParams | None):
    """state.generate_async, with a generation-only request's KV fetch on a worker thread; a bad handle is a 400
    naming disaggregated_params, a failed transfer a 502 (only this request fails)."""
    if dp is None:
        return state.generate_async(ids, params, stream, cache_salt, lora_request)
    try:
        call = lambda: state.generate_async(ids, params, stream, cache_salt, lora_request, disaggregated_params=dp)  # noqa: E731
        return await asyncio.to_thread(call) if dp.is_generation_only else call()
    except ValueError as exc:
        if str(exc).startswith(PARAM):
            raise APIError(str(exc), 400, param=PARAM) from None
        raise
    except KVTransferError as exc:
        raise APIError(f"disaggregated_params: {exc}", 502, param=PARAM) from None


def choice_params(out) -> dict | None:
    dp = out.disaggregated_params
    return dp.to_dict() if dp is not None else None


def kv_transfer_usage(outputs) -> dict | None:
    stats = [o.kv_transfer for o in outputs if o is not None and o.kv_transfer is not None]
    if not stats:
        return None
    return {"bytes": sum(s.num_bytes for s in stats), "seconds": round(sum(s.seconds for s in stats), 6),
            "tokens": sum(s.num_tokens for s in stats)}
