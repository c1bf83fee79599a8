"""Paged attention in Triton, for CUDA: the KV scatter (kv_write.py), decode (decode.py: one query per sequence,
split over long contexts), prefill and chunked prefill (prefill.py: a batch of chunks against their cached
prefixes) and the step dispatch over AttentionMetadata (paged.py), which attention.paged_attention hands a CUDA step.

Each kernel reads K/V blocks in place through the block tables, in float16, bfloat16 or float32 with float32
accumulation. Importing this package does not import Triton: its functions load their module on first use, so
`import petrel` works (and CPU runs stay untouched) where Triton is absent. On a CPU the kernels run in Triton's
interpreter when TRITON_INTERPRET=1 was set before the first use (the tests do this); it is far too slow to serve.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from functools import cache

import torch

# Device types whose paged attention runs here when Triton is available; PETREL_TRITON=0 turns the path off.
# Tests add "cpu" to run the dispatch in the interpreter.
DEVICE_TYPES: tuple[str, ...] = () if os.environ.get("PETREL_TRITON") == "0" else ("cuda",)

_HOMES = {
    "write_kv": "kv_write",
    "paged_decode_attention": "decode",
    "paged_prefill_attention": "prefill",
    "paged_attention": "paged",
}


@cache
def _importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def available(device: torch.device | str) -> bool:
    """Whether the kernels can run on `device`: Triton is installed, and the device is CUDA or Triton interprets."""
    return _importable() and (torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def serves(device: torch.device) -> bool:
    """Whether attention.paged_attention should hand a step on `device` to these kernels."""
    return device.type in DEVICE_TYPES and available(device)


def lazy_functions(package: str, homes: dict[str, str]):
    """A package's module-level __getattr__: each public function in `homes` (name -> module) imported from its
    module (and Triton with it) when first asked for."""

    def __getattr__(name: str):
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        function = getattr(importlib.import_module(f"{package}.{homes[name]}"), name)
        setattr(sys.modules[package], name, function)
        return function

    return __getattr__


__getattr__ = lazy_functions(__name__, _HOMES)
