"""EngineConfig: every engine option in one place, validated once at start-up, defaults that work on a laptop."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

TORCH_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


@dataclass
class EngineConfig:
    model: str | None = None              # None: the default model (SmolLM2-135M-Instruct GGUF)
    tokenizer: str | None = None          # another tokenizer directory or hub id
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None      # None: the model's context length (capped by the KV cache)
    block_size: int = 16
    kv_cache_memory: int = 2 * 1024 ** 3  # bytes for the paged KV cache
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_cache_hash_seed: str = ""          # combined with each request's cache_salt in the root block hash
    seed: int = 0
    num_threads: int | None = None        # torch intra-op threads (None: torch's default)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)

    def __post_init__(self):
        if self.dtype not in TORCH_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(TORCH_DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]
