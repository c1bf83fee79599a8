"""Disaggregated serving: the prompt's prefill on one instance, the decode on another.

A context-only request prefills, samples its first token and keeps its prompt's KV blocks pinned (the engine
side: petrel/engine/pinned_prompts.py); its DisaggregatedParams (`params.py`) say where to fetch them. A
generation-only request on another instance fetches them over TCP (`kv_transfer.py`), has the engine write them
into blocks of its own cache (petrel/engine/kv_export.py) and decodes on from the first token. `petrel route
--prefill URL --decode URL` runs both. This package imports the engine; the engine never imports it.

Off unless an instance takes a role (EngineConfig.kv_transfer_role, `petrel serve --kv-transfer-role`): only a
prefill role answers context_only requests and runs the transfer server, only a decode role answers
generation_only ones, fetching only from its kv_transfer_peers, with an HMAC of the handle under the
kv_transfer_secret they share, and reading no more than its prompt's KV. Pins (prompts and a share of the cache,
reserved through `requests.py`) and fetches at once (`petrel/serve/disagg.py`) are capped.
"""

from petrel.disagg.params import REQUEST_TYPES, DisaggregatedParams, KVTransferBusy, KVTransferStats

__all__ = ["DisaggregatedParams", "KVTransferBusy", "KVTransferStats", "REQUEST_TYPES"]
