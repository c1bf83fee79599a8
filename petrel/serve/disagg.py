"""The server's side of disaggregated serving: the `disaggregated_params` request field checked, the request
submitted (a generation-only one fetches its prompt's KV first, on a pool of its own: a slow peer holds neither
the event loop nor the threads /health and /metrics use), and what the response carries back (a context-only
choice's DisaggregatedParams, a generation-only usage's KV transfer)."""

from __future__ import annotations

import asyncio
import weakref
from concurrent.futures import ThreadPoolExecutor

from petrel.disagg import DisaggregatedParams, KVTransferBusy
from petrel.disagg.kv_transfer import KVTransferError
from petrel.serve.errors import APIError

PARAM = "disaggregated_params"


class FetchPool:
    """kv_transfer_max_fetches threads for generation-only requests' KV fetches; one more while all are busy is
    refused at once (429) rather than queued. Used from the event loop thread only."""

    def __init__(self, max_fetches: int):
        self.max_fetches = max_fetches
        self.in_flight = 0
        self._pool = ThreadPoolExecutor(max_fetches, thread_name_prefix="petrel-kv-fetch")

    async def run(self, call):
        if self.in_flight >= self.max_fetches:
            raise KVTransferBusy(
                f"disaggregated_params: {self.in_flight} KV fetches are running, the most this "
                "server allows at once (kv_transfer_max_fetches); retry later"
            )
        self.in_flight += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, call)
        finally:
            self.in_flight -= 1


_fetch_pools: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # LLM -> its server's FetchPool


def fetch_pool(llm) -> FetchPool:
    pool = _fetch_pools.get(llm)
    if pool is None:
        pool = _fetch_pools[llm] = FetchPool(llm.config.kv_transfer_max_fetches)
    return pool


def from_request(req, num_prompts: int) -> DisaggregatedParams | None:
    model = req.disaggregated_params
    if model is None:
        return None
    dp = DisaggregatedParams(**model.model_dump())
    if dp.request_type == "context_and_generation":
        return None
    if num_prompts != 1:
        raise APIError(
            f"disaggregated_params: a {dp.request_type} request takes one prompt, got {num_prompts}", 400, param=PARAM
        )
    if dp.is_context_only and req.stream:
        raise APIError(
            "disaggregated_params: a context_only request returns one token and its parameters: it cannot stream",
            400,
            param=PARAM,
        )
    return dp


async def submit(
    state, ids, params, stream: bool, cache_salt, lora_request, dp: DisaggregatedParams | None, dkv_cache_hint=None
):
    """state.generate_async, with a generation-only request's KV fetch on the fetch pool; a request this server may
    not or cannot run, or a bad handle, is a 400 naming disaggregated_params, a split at its limits (prompts
    pinned, fetches at once) a 429, a failed transfer a 502 (only this request fails). dkv_cache_hint: the
    request's (a dict, see petrel/kv_tiers/dkv_hint.py), passed on."""
    hint = {} if dkv_cache_hint is None else {"dkv_cache_hint": dkv_cache_hint}
    if dp is None:
        return state.generate_async(ids, params, stream, cache_salt, lora_request, **hint)

    def call():
        return state.generate_async(ids, params, stream, cache_salt, lora_request, disaggregated_params=dp, **hint)

    try:
        if dp.is_generation_only and state.llm.config.fetches_kv:
            return await fetch_pool(state.llm).run(call)
        return call()  # nothing to fetch, or refused before any fetch
    except ValueError as exc:
        if str(exc).startswith(PARAM):
            raise APIError(str(exc), 400, param=PARAM) from None
        raise
    except KVTransferBusy as exc:
        raise APIError(str(exc), 429, param=PARAM, code="server_overloaded") from None
    except KVTransferError as exc:
        raise APIError(f"disaggregated_params: {exc}", 502, param=PARAM) from None


def choice_params(out) -> dict | None:
    dp = out.disaggregated_params
    return dp.to_dict() if dp is not None else None


def kv_transfer_usage(outputs) -> dict | None:
    stats = [o.kv_transfer for o in outputs if o is not None and o.kv_transfer is not None]
    if not stats:
        return None
    return {
        "bytes": sum(s.num_bytes for s in stats),
        "seconds": round(sum(s.seconds for s in stats), 6),
        "tokens": sum(s.num_tokens for s in stats),
    }
