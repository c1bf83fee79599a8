"""petrel: a fast LLM inference engine and server.

The public names below are imported when first used (`from petrel import LLM`, `petrel.SamplingParams`), not when
`petrel` is: importing a light module such as petrel.engine.scheduler or petrel.serve.protocol first runs this file,
and must not pull in torch, the model code or the server with it."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "LLM": "petrel.llm",
    "RequestFuture": "petrel.llm",
    "SamplingParams": "petrel.sampling_params",
    "EngineConfig": "petrel.config",
    "RequestOutput": "petrel.outputs",
    "CompletionOutput": "petrel.outputs",
    "Logprob": "petrel.outputs",
    "OutputChunk": "petrel.outputs",
    "FinishDetails": "petrel.outputs",
    "RequestPerfMetrics": "petrel.outputs",
    "TextGenerationRequest": "petrel.text_request",
    "GuidedDecodingParams": "petrel.guided_decoding",
    "LoRARequest": "petrel.lora",
    "DisaggregatedParams": "petrel.disagg",
}
__all__ = [
    "LLM",
    "RequestFuture",
    "SamplingParams",
    "EngineConfig",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "OutputChunk",
    "FinishDetails",
    "RequestPerfMetrics",
    "TextGenerationRequest",
    "GuidedDecodingParams",
    "LoRARequest",
    "DisaggregatedParams",
]


def __getattr__(name: str):
    """Import a public name's module on first use, and keep the name here so later lookups are plain ones."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'petrel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # for type checkers and editors only: the same names, imported eagerly
    from petrel.config import EngineConfig
    from petrel.disagg import DisaggregatedParams
    from petrel.guided_decoding import GuidedDecodingParams
    from petrel.llm import LLM, RequestFuture
    from petrel.lora import LoRARequest
    from petrel.outputs import CompletionOutput, FinishDetails, Logprob, OutputChunk, RequestOutput, RequestPerfMetrics
    from petrel.sampling_params import SamplingParams
    from petrel.text_request import TextGenerationRequest
