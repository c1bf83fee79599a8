"""Disaggregated serving: the prompt's prefill on one instance, the decode on another.

A context-only request prefills, samples its first token and keeps its prompt's KV blocks pinned
(`pinned.py`); its DisaggregatedParams (`params.py`) say where to fetch them. A generation-only request on
another instance fetches them over TCP (`kv_transfer.py`), writes them into blocks of its own cache
(`kv_blocks.py`) and decodes on from the first token. `petrel route --prefill URL --decode URL` runs both.
"""
from petrel.disagg.params import REQUEST_TYPES, DisaggregatedParams, KVTransferStats

__all__ = ["DisaggregatedParams", "KVTransferStats", "REQUEST_TYPES"]
