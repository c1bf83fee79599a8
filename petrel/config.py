"""EngineConfig: every engine option in one place, validated once at start-up, defaults that work on a laptop."""

from __future__ import annotations

import functools
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

TORCH_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


DEVICES = ("cpu", "cuda")
SPECULATIVE_METHODS = ("ngram", "draft_model", "self", "lookahead")
LOOKAHEAD_SIZES = ("max_window_size", "max_ngram_size", "max_verification_set_size")
KV_TRANSFER_ROLES = ("prefill", "decode", "both")
EXECUTOR_BACKENDS = ("mp", "ray")
KV_STORE_SCHEMES = ("redis://", "rediss://", "unix://")
CPU_KV_CACHE_MEMORY = 2 * 1024**3  # the KV cache's default bytes on CPU (and per rank with tensor parallelism)
KV_CACHE_FREE_FRACTION = 0.9  # of a CUDA device's free memory after the weights: the KV cache's default


def kv_cache_budget(config: EngineConfig) -> int:
    """The KV cache's bytes: kv_cache_memory, else KV_CACHE_FREE_FRACTION of the CUDA device's free memory now
    (call it once the weights are loaded)."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    return int(torch.cuda.mem_get_info(torch.device(config.device))[0] * KV_CACHE_FREE_FRACTION)


@dataclass
class SpeculativeConfig:
    """Speculative decoding: propose up to k tokens cheaply, verify them in one target forward pass.

    method 'ngram': continue the latest earlier occurrence of the sequence's last n tokens (prompt lookup),
    n from prompt_lookup_max down to prompt_lookup_min; no extra model.
    method 'draft_model': a smaller model with the same vocabulary (draft_model: path or hub id) drafts greedily
    with its own paged KV cache (same block tables as the target).
    method 'self': the target's first draft_num_layers layers, its final norm and LM head draft (early exit).
    method 'lookahead': Jacobi lookahead decoding (petrel/engine/lookahead.py), no extra model: a window of
    max_window_size future positions, n-grams of max_ngram_size tokens, up to max_verification_set_size of them
    verified a step (TensorRT-LLM's LookaheadDecodingConfig W, N, G); these are the maximum a request's own
    SamplingParams.lookahead_config may ask for, and the sizes of requests without one. num_speculative_tokens
    does not apply.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    draft_model: str | None = None
    draft_num_layers: int | None = None  # 'self': None means a quarter of the target's layers
    max_window_size: int = 4  # 'lookahead': W
    max_ngram_size: int = 3  # 'lookahead': N
    max_verification_set_size: int = 4  # 'lookahead': G

    @classmethod
    def coerce(cls, value: object) -> SpeculativeConfig | None:
        """A SpeculativeConfig from itself, a dict (the CLI's JSON), a lookahead config object (TensorRT-LLM's
        LookaheadDecodingConfig, or petrel.executor's: max_window_size, max_ngram_size, max_verification_set_size)
        or None."""
        if value is None or isinstance(value, cls):
            return value
        if has_lookahead_sizes(value):
            return cls(method="lookahead", **{name: getattr(value, name) for name in LOOKAHEAD_SIZES})
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"speculative_config has unknown field(s) {unknown}; known: {sorted(known)}")
            return cls(**value)
        raise ValueError(f"speculative_config must be a SpeculativeConfig or a dict, got {type(value).__name__}")

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {list(SPECULATIVE_METHODS)}, got {self.method!r}"
            )
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be 1..16, got {self.num_speculative_tokens!r}"
            )
        if not (
            isinstance(self.prompt_lookup_min, int)
            and isinstance(self.prompt_lookup_max, int)
            and 1 <= self.prompt_lookup_min <= self.prompt_lookup_max
        ):
            raise ValueError(
                "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min!r}, {self.prompt_lookup_max!r}"
            )
        if self.method == "draft_model" and not self.draft_model:
            raise ValueError(
                "speculative_config.draft_model (a model path or hub id) is needed for method 'draft_model'"
            )
        if self.draft_num_layers is not None and (
            not isinstance(self.draft_num_layers, int) or self.draft_num_layers < 1
        ):
            raise ValueError(
                f"speculative_config.draft_num_layers must be a positive integer, got {self.draft_num_layers!r}"
            )
        if self.method == "lookahead":
            from petrel.engine.lookahead import check_lookahead_config

            sizes = tuple(getattr(self, name) for name in LOOKAHEAD_SIZES)
            check_lookahead_config(
                "speculative_config max_window_size / max_ngram_size / max_verification_set_size", sizes, 1
            )

    @property
    def lookahead_sizes(self) -> tuple[int, int, int]:
        """'lookahead': (W, N, G)."""
        return self.max_window_size, self.max_ngram_size, self.max_verification_set_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EngineConfig:
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct GGUF)
    tokenizer: str | None = None  # another tokenizer directory or hub id
    # llama.cpp's vision projector GGUF (an Idefics3 / SmolVLM mmproj) beside a llama text GGUF `model`
    mmproj: str | None = None
    dtype: str = "auto"  # 'auto': bfloat16 on CUDA, float32 on CPU
    # what the paged KV cache holds: 'auto' the dtype asked for (on the CPU, dtype 'bfloat16' keeps a bfloat16
    # cache beside its float32 arithmetic: half the bytes attention reads); on the CPU 'float32' or 'bfloat16' with
    # float32 arithmetic; elsewhere only the dtype's own
    kv_cache_dtype: str = "auto"
    device: str = "cpu"
    max_model_len: int | None = None  # None: the model's context length (capped by the KV cache unless every
    # layer has one sliding window: its blocks behind it are given back)
    block_size: int = 16
    # bytes for the paged KV cache; None: CPU_KV_CACHE_MEMORY, or on one CUDA device KV_CACHE_FREE_FRACTION of the
    # memory free once the weights are loaded (resolved by kv_cache_budget)
    kv_cache_memory: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_cache_hash_seed: str = ""  # combined with each request's cache_salt in the root block hash
    seed: int = 0
    enforce_eager: bool = False  # no CUDA graphs for decode steps (petrel/engine/decode_graphs.py)
    cuda_graph_batch_sizes: list[int] | None = None  # decode batch sizes captured; None: 1, 2, 4, 8, 16, 32, ...
    num_threads: int | None = None  # torch intra-op threads (None: torch's default)
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None
    enable_lora: bool = False  # LoRA adapter slots on the model's projections (LLM.generate(lora_request=...))
    max_loras: int = 4  # adapters resident at once; distinct adapters running at once at most
    max_lora_rank: int = 16  # largest adapter rank accepted
    # disaggregated serving (petrel/disagg), off unless kv_transfer_role is set: 'prefill' answers context_only
    # requests and serves their KV, 'decode' answers generation_only ones by fetching it, 'both' does both
    kv_transfer_role: str | None = None
    kv_transfer_host: str = "127.0.0.1"  # where a prefill role's KV transfer server listens
    kv_transfer_port: int = 0  # 0: a port the OS picks
    kv_transfer_timeout: float = 60.0  # seconds a pinned prompt KV waits to be fetched; also a fetch's deadline
    kv_transfer_peers: list[str] | None = None  # decode: the prefill instances' "host:port" it may fetch from
    kv_transfer_secret: str | None = field(default=None, repr=False)  # shared by the instances: authenticates a fetch
    kv_transfer_max_pinned: int = 64  # prefill: context_only prompts pinned (or prefilling to be) at once
    kv_transfer_max_pinned_share: float = 0.25  # prefill: the most of the KV cache's blocks they may hold
    kv_transfer_max_fetches: int = 4  # decode (petrel serve): KV fetches at once; more get 429
    # the KV block store instances share: a Redis / Valkey server's redis://, rediss:// or unix:// URL
    # (None: none); repr=False: the URL may hold a password
    kv_store_url: str | None = field(default=None, repr=False)
    # None/'none': weights dequantized to dtype; 'int8': int8 per row; 'gguf': GGUF blocks kept; 'bf16': bfloat16
    # weights, float32 arithmetic (what dtype 'bfloat16' becomes on the CPU)
    quantization: str | None = None
    # float32 weights' prompt-sized products on the CPU, named as torch's float32_matmul_precision: 'highest' float32;
    # 'medium' in bfloat16 on AMX tiles where the CPU has them (petrel/model/amx.py; elsewhere float32 still)
    float32_matmul_precision: str = "highest"
    tensor_parallel_size: int = 1  # ranks the model is split over (kv_cache_memory is per rank)
    distributed_executor_backend: str = "mp"  # with tensor_parallel_size > 1: 'mp' (local processes) or 'ray'
    # mixtures of experts over tensor_parallel_size > 1 ranks: each rank holds E / ranks whole experts (the router
    # runs on every rank, each rank's experts' sums are all-reduced) instead of a slice of every expert
    enable_expert_parallel: bool = False
    # vision-language models (petrel/multimodal): images / videos per prompt by kind (vLLM's limit_mm_per_prompt;
    # None: any number), the pixel budget of one image, and the bytes of encoder outputs kept for reuse (encoder cache)
    limit_mm_per_prompt: dict[str, int] | None = None
    max_image_pixels: int = 40_000_000
    encoder_cache_memory: int = 256 * 1024**2
    # lower KV tiers (petrel/kv_tiers): prefix-cache blocks evicted from the KV cache are kept in host memory (up
    # to kv_host_tier_bytes) and/or on disk (kv_disk_tier_path, up to kv_disk_tier_bytes) and brought back by hash
    # instead of being recomputed; off unless one is given. A request whose blocks are on disk or in the shared
    # store waits (the batch does not) while they are read, kv_tier_fetch_timeout seconds at most
    kv_host_tier_bytes: int | None = None
    kv_disk_tier_path: str | None = None
    kv_disk_tier_bytes: int = 8 * 1024**3
    kv_tier_fetch_timeout: float = 2.0
    # attention windows on any model (TensorRT-LLM's KvCacheConfig, petrel/engine/attention_windows.py): one window
    # per layer, the list repeated over the layers; and the first positions every windowed layer also sees
    # (StreamingLLM's attention sinks). The blocks behind a window are given back
    max_attention_window: list[int] | None = None
    sink_token_length: int | None = None
    # a lower KV tier takes an evicted block only if its retention priority (petrel/engine/kv_retention.py: 0..100,
    # 35 by default) is at least this (TensorRT-LLM's secondary_offload_min_priority)
    secondary_offload_min_priority: int = 35
    # the block after a prefix hit may be reused in part: its first tokens from a cached block that shares them
    # (petrel/engine/block_manager.py); copied into a fresh block, or (copy_on_partial_reuse False) taken over
    enable_partial_reuse: bool = False
    copy_on_partial_reuse: bool = True

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)

    def __post_init__(self) -> None:
        if has_lookahead_sizes(self.speculative_config):  # a TensorRT-LLM-style LookaheadDecodingConfig object
            self.speculative_config = SpeculativeConfig.coerce(self.speculative_config)
        check_field_types(self)
        if self.device.split(":")[0] not in DEVICES or not _device_index_ok(self.device):
            raise ValueError(
                f"device must be one of {list(DEVICES)} (cuda may name its index, cuda:1), got {self.device!r}"
            )
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        if self.dtype not in TORCH_DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(TORCH_DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_memory is None and (self.device == "cpu" or self.tensor_parallel_size > 1):
            self.kv_cache_memory = CPU_KV_CACHE_MEMORY  # ranks measuring free memory apart could disagree
        if any(not isinstance(s, int) or s < 1 for s in self.cuda_graph_batch_sizes or ()):
            raise ValueError(f"cuda_graph_batch_sizes must be positive integers, got {self.cuda_graph_batch_sizes!r}")
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_image_pixels",
            "encoder_cache_memory",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be a positive integer, got {self.kv_cache_memory!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
        self.speculative_config = SpeculativeConfig.coerce(self.speculative_config)
        for kind, limit in (self.limit_mm_per_prompt or {}).items():
            if kind not in ("image", "video") or not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
                raise ValueError(
                    f"limit_mm_per_prompt must map 'image' / 'video' to a count >= 0, got {self.limit_mm_per_prompt!r}"
                )
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.kv_transfer_port, int) or not 0 <= self.kv_transfer_port < 65536:
            raise ValueError(f"kv_transfer_port must be 0..65535, got {self.kv_transfer_port!r}")
        if not isinstance(self.kv_transfer_timeout, (int, float)) or self.kv_transfer_timeout <= 0:
            raise ValueError(f"kv_transfer_timeout must be > 0 seconds, got {self.kv_transfer_timeout!r}")
        self._check_kv_transfer()
        self._check_kv_tiers()
        from petrel.engine.attention_windows import check_window_options

        check_window_options(self.max_attention_window, self.sink_token_length)
        from petrel.engine.kv_retention import check_priority

        check_priority(self.secondary_offload_min_priority, "secondary_offload_min_priority")
        from petrel.model.quantization import QUANTIZATION_METHODS

        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization must be one of {list(QUANTIZATION_METHODS)} or None, got {self.quantization!r}"
            )
        from petrel.model.amx import PRECISIONS

        if self.float32_matmul_precision not in PRECISIONS:
            raise ValueError(
                f"float32_matmul_precision must be one of {list(PRECISIONS)}, got {self.float32_matmul_precision!r}"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads!r}")
        size = self.tensor_parallel_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {list(EXECUTOR_BACKENDS)}, "
                f"got {self.distributed_executor_backend!r}"
            )
        if size > 1 and self.enable_lora:
            raise ValueError(
                f"enable_lora is not supported with tensor_parallel_size={size} (LoRA runs in one process)"
            )
        if size > 1 and self.quantization not in (None, "none"):
            raise ValueError(
                f"quantization {self.quantization!r} is not supported with tensor_parallel_size={size} "
                "(quantized weights are not split over ranks)"
            )
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in TORCH_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be 'auto' or one of {sorted(TORCH_DTYPES)} (fp8 caches are not supported), "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.device == "cpu" and self.dtype == "bfloat16" and size == 1:
            # bfloat16 weights (half the memory, half the bytes a decode step reads; unless another quantization
            # holds them) and KV cache with float32 activations, which petrel's CPU kernels take: torch's own
            # bfloat16 CPU arithmetic ran W1 at 0.45x float32's speed (docs/benchmarks-history.md, 2026-12-03)
            self.dtype = "float32"
            if self.quantization in (None, "none"):
                self.quantization = "bf16"
            if self.kv_cache_dtype == "auto":
                self.kv_cache_dtype = "bfloat16"
        if self.kv_cache_dtype == "auto":
            self.kv_cache_dtype = self.dtype
        if self.kv_cache_dtype != self.dtype and not (
            self.device == "cpu" and self.dtype == "float32" and self.kv_cache_dtype == "bfloat16"
        ):
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} with dtype {self.dtype!r} on {self.device!r}: a cache of "
                "another dtype than the arithmetic's is a bfloat16 cache beside float32 on the CPU only"
            )

    def _check_kv_tiers(self) -> None:
        """Sizes, the disk path and the store's URL well formed; any tier or store needs the prefix cache, one rank."""
        for name in ("kv_host_tier_bytes", "kv_disk_tier_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive number of bytes, got {value!r}")
        if not self.kv_tier_fetch_timeout > 0:
            raise ValueError(
                f"kv_tier_fetch_timeout must be a positive number of seconds, got {self.kv_tier_fetch_timeout!r}"
            )
        if self.kv_disk_tier_path is not None and not self.kv_disk_tier_path.strip():
            raise ValueError("kv_disk_tier_path must be a directory path, got an empty string")
        if self.kv_store_url is not None and not self.kv_store_url.startswith(KV_STORE_SCHEMES):
            raise ValueError(
                f"kv_store_url must start with one of {list(KV_STORE_SCHEMES)} (a Redis or Valkey server), "
                f"got {self.kv_store_url.partition('://')[0]!r}"
            )
        if not self.kv_host_tier_bytes and not self.kv_disk_tier_path and not self.kv_store_url:
            return
        name = (
            "kv_host_tier_bytes"
            if self.kv_host_tier_bytes
            else "kv_disk_tier_path"
            if self.kv_disk_tier_path
            else "kv_store_url"
        )
        if not self.enable_prefix_caching:
            raise ValueError(f"{name} needs enable_prefix_caching (the tiers keep prefix-cache blocks)")
        if self.tensor_parallel_size > 1:
            raise ValueError(
                f"{name} is not supported with tensor_parallel_size={self.tensor_parallel_size} (the tiers copy "
                "one process's KV cache)"
            )

    def _check_kv_transfer(self) -> None:
        """A role needs a secret, and a decode role the peers it may fetch from: nothing is open by default."""
        role = self.kv_transfer_role
        if role is not None and role not in KV_TRANSFER_ROLES:
            raise ValueError(f"kv_transfer_role must be one of {list(KV_TRANSFER_ROLES)} or None (off), got {role!r}")
        for name in ("kv_transfer_max_pinned", "kv_transfer_max_fetches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        share = self.kv_transfer_max_pinned_share
        if not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ValueError(f"kv_transfer_max_pinned_share must be in (0, 1], got {share!r}")
        if isinstance(self.kv_transfer_peers, str):
            self.kv_transfer_peers = [self.kv_transfer_peers]
        self.kv_transfer_peers = [parse_endpoint(p, "kv_transfer_peers") for p in self.kv_transfer_peers or []]
        if role is None:
            return
        if not isinstance(self.kv_transfer_secret, str) or not self.kv_transfer_secret:
            raise ValueError(
                f"kv_transfer_role {role!r} needs kv_transfer_secret, the secret every prefill and "
                "decode instance shares (petrel serve --kv-transfer-secret, $PETREL_KV_TRANSFER_SECRET "
                "or --api-key)"
            )
        if role in ("decode", "both") and not self.kv_transfer_peers:
            raise ValueError(
                f"kv_transfer_role {role!r} needs kv_transfer_peers, the prefill instances' KV transfer "
                "servers (host:port) it may fetch from (petrel serve --kv-transfer-peers)"
            )

    @property
    def serves_kv(self) -> bool:
        """A prefill role: context_only requests pin their prompt's KV and a KV transfer server hands it out."""
        return self.kv_transfer_role in ("prefill", "both")

    @property
    def fetches_kv(self) -> bool:
        """A decode role: generation_only requests fetch their prompt's KV from one of kv_transfer_peers."""
        return self.kv_transfer_role in ("decode", "both")

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.kv_cache_dtype]


def has_lookahead_sizes(value: object) -> bool:
    """A lookahead config object (not a SpeculativeConfig nor a dict): max_window_size, max_ngram_size and
    max_verification_set_size attributes."""
    return not isinstance(value, (SpeculativeConfig, dict)) and all(hasattr(value, n) for n in LOOKAHEAD_SIZES)


def check_field_types(config: DataclassInstance) -> None:
    """TypeError naming the first field whose value is not of its annotated type (an int is a float too; a bool
    is no int): `seed="abc"` or `enable_prefix_caching="no"` are refused, not carried into the engine."""
    hints = _type_hints(type(config))
    for f in fields(config):
        value = getattr(config, f.name)
        if not _matches(value, hints[f.name]):
            raise TypeError(f"{f.name} must be {_describe(hints[f.name])}, got {value!r}")


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _matches(value: object, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is list:
        return isinstance(value, (list, tuple)) and all(_matches(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    return isinstance(value, origin or hint)


def _describe(hint: Any) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if hint is type(None):
        return "None"
    return getattr(hint, "__name__", str(hint))


def _device_index_ok(device: str) -> bool:
    kind, sep, index = device.partition(":")
    return not sep or (kind == "cuda" and index.isdigit())


def parse_endpoint(endpoint: object, name: str) -> str:
    """The endpoint in the one form endpoints are compared in, "host:port" (host lower-case, port 1..65535);
    ValueError naming `name` otherwise."""
    host, sep, port = endpoint.rpartition(":") if isinstance(endpoint, str) else ("", "", "")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name} must be host:port, got {endpoint!r}")
    return f"{host.lower()}:{int(port)}"
