"""Executor Requests and ExecutorConfig -> the engine's SamplingParams, request options and EngineConfig.

Every field petrel cannot honour is a ValueError naming it (the Executor turns it into an error Response)."""

from __future__ import annotations

import dataclasses
import math

import torch

from petrel.config import EngineConfig
from petrel.engine.kv_retention import KvRetention, make_retention
from petrel.executor.packed_lora import packed_digest, packed_request
from petrel.executor.speculation import speculation_fields
from petrel.executor.types import ExecutorConfig, KvCacheConfig, KvCacheRetentionConfig, LoraConfig, Request
from petrel.lora import LoRARequest
from petrel.sampling_params import ADDITIONAL_OUTPUTS, SamplingParams

_ENCODER = "encoder-decoder models only: petrel's models are decoder-only (no encoder)"
_CROSS = "cross-attention: petrel's models are decoder-only (they have no cross-attention)"
# Request fields petrel refuses when set, and why
UNSUPPORTED_FIELDS = {
    "encoder_input_token_ids": _ENCODER,
    "encoder_input_features": _ENCODER,
    "encoder_output_length": _ENCODER,
    "cross_attention_mask": _CROSS,
    "skip_cross_attn_blocks": _CROSS,
    "eagle_config": "EAGLE needs a model's EAGLE draft heads, which petrel does not load",
    "language_adapter_uid": "language adapters belong to models built with them; petrel loads none",
}
# KvCacheConfig fields that become EngineConfig options (of the same name unless mapped here)
KV_CACHE_ENGINE_OPTIONS = (
    "max_attention_window",
    "sink_token_length",
    "secondary_offload_min_priority",
    "host_cache_size",
    "enable_partial_reuse",
    "copy_on_partial_reuse",
)
KV_CACHE_ENGINE_NAMES = {"host_cache_size": "kv_host_tier_bytes"}


def speculation_and_prompt_tuning(request: Request, vocab_size: int) -> dict:
    """The SamplingParams fields of a request's speculative decoding (petrel/executor/speculation.py) and
    prompt_tuning_config (ValueError for the parts petrel cannot honour)."""
    extra = speculation_fields(request, vocab_size)
    tuning = request.prompt_tuning_config
    if tuning is not None:
        extra["prompt_embedding_table"] = tuning.embedding_table
    return extra


def token_extra_ids_of(request: Request, vocab_size: int) -> list[int] | None:
    """prompt_tuning_config.input_token_extra_ids, one per prompt token, kept for the virtual tokens (ids >=
    vocab_size; 0 for the others, as they key nothing): None when none is set or every kept one is 0."""
    tuning = request.prompt_tuning_config
    given = None if tuning is None else tuning.input_token_extra_ids
    if given is None:
        return None
    field = "prompt_tuning_config.input_token_extra_ids"
    if isinstance(given, torch.Tensor):
        given = given.tolist()
    if not isinstance(given, (list, tuple)) or not all(
        isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in given
    ):
        raise ValueError(f"{field} must be a list of integers >= 0, one per prompt token")
    ids = request.input_token_ids
    if len(given) != len(ids):
        raise ValueError(f"{field} has {len(given)} ids for {len(ids)} prompt tokens; give one per token")
    kept = [e if t >= vocab_size else 0 for t, e in zip(ids, given)]
    return kept if any(kept) else None


def configured_outputs(config: ExecutorConfig) -> set[str]:
    """The names of ExecutorConfig.additional_model_outputs (ValueError for one petrel cannot produce)."""
    names = {o.name for o in config.additional_model_outputs or []}
    unknown = sorted(names - set(ADDITIONAL_OUTPUTS))
    if unknown:
        raise ValueError(
            f"ExecutorConfig.additional_model_outputs has unknown names {unknown}; known: {list(ADDITIONAL_OUTPUTS)}"
        )
    return names


def apply_kv_cache_config(kv: KvCacheConfig | None, engine_config: EngineConfig) -> EngineConfig:
    """KvCacheConfig onto the engine's options: prefix caching, and the cache's size (kv_cache_memory bytes) from
    max_tokens and/or free_gpu_memory_fraction (the smaller when both are set)."""
    if kv is None:
        return engine_config
    check_kv_cache_placement(kv, engine_config)
    size = kv.event_buffer_max_size
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
        raise ValueError(f"kv_cache_config.event_buffer_max_size must be an integer >= 0, got {size!r}")
    changes: dict = {"enable_prefix_caching": bool(kv.enable_block_reuse)}
    for name in KV_CACHE_ENGINE_OPTIONS:
        if getattr(kv, name) is not None:
            value = getattr(kv, name)
            if name == "max_attention_window" and isinstance(value, (int, tuple)) and not isinstance(value, bool):
                value = [value] if isinstance(value, int) else list(value)  # older bindings took one window
            changes[KV_CACHE_ENGINE_NAMES.get(name, name)] = value
    budgets = []
    if kv.max_tokens is not None:
        if not isinstance(kv.max_tokens, int) or kv.max_tokens < 1:
            raise ValueError(f"kv_cache_config.max_tokens must be an integer >= 1, got {kv.max_tokens!r}")
        from petrel.engine.model_runner import kv_bytes_per_block
        from petrel.model.loader import load_model_config, resolve_model

        cfg = load_model_config(resolve_model(engine_config.model))
        bs = engine_config.block_size
        per_block = kv_bytes_per_block(cfg, bs, engine_config.kv_cache_torch_dtype, engine_config.tensor_parallel_size)
        budgets.append(math.ceil(kv.max_tokens / bs) * per_block)
    fraction = kv.free_gpu_memory_fraction
    if fraction is not None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"kv_cache_config.free_gpu_memory_fraction must be in (0, 1], got {fraction!r}")
        if not str(engine_config.device).startswith("cuda"):
            raise ValueError(
                f"kv_cache_config.free_gpu_memory_fraction needs a CUDA device (device={engine_config.device!r})"
            )
        budgets.append(int(torch.cuda.mem_get_info(torch.device(engine_config.device))[0] * fraction))
    if budgets:
        changes["kv_cache_memory"] = min(budgets)
    try:
        return dataclasses.replace(engine_config, **changes)
    except (TypeError, ValueError) as exc:  # a malformed window or sink count: named as the caller gave it
        raise ValueError(f"kv_cache_config: {exc}") from None


def check_kv_cache_placement(kv: KvCacheConfig, engine_config: EngineConfig) -> None:
    """The KvCacheConfig fields about where blocks live: what petrel does already is accepted, the rest refused
    saying why."""
    if kv.cross_kv_cache_fraction is not None:
        raise ValueError(
            "kv_cache_config.cross_kv_cache_fraction: petrel's models are decoder-only (no cross-attention KV cache)"
        )
    if kv.onboard_blocks is False:
        raise ValueError(
            "kv_cache_config.onboard_blocks=False: petrel attends only to blocks in its KV cache, so a block found "
            "in a lower tier is always brought back (onboarded)"
        )
    if kv.use_uvm and not str(engine_config.device).startswith("cpu"):
        raise ValueError(
            "kv_cache_config.use_uvm: petrel allocates a CUDA KV cache in device memory (unified memory is not "
            "supported); on the CPU the cache is host memory already"
        )


def lora_request_for(
    lora: LoraConfig, known: dict[int, LoRARequest], packed_digests: dict[int, str]
) -> tuple[LoRARequest, tuple | None]:
    """The adapter of a LoraConfig, and (weights, config, digest) when its packed tensors must be loaded first. A new
    task_id needs `path` (a PEFT directory) or packed `weights` and `config`; a known one may leave them out (given
    again, they must be the ones it is cached with)."""
    if not isinstance(lora, LoraConfig):
        raise ValueError(f"lora_config must be an executor LoraConfig, got {type(lora).__name__}")
    task = lora.task_id
    if not isinstance(task, int) or isinstance(task, bool) or task < 1:
        raise ValueError(f"lora_config.task_id must be an integer >= 1, got {task!r}")
    packed = lora.weights is not None or lora.config is not None
    if packed and lora.path is not None:
        raise ValueError("lora_config: give either a PEFT adapter path or packed weights / config, not both")
    cached = known.get(task)
    if packed:
        if lora.weights is None or lora.config is None:
            raise ValueError("lora_config: packed weights need their config, and a config its weights")
        digest = packed_digest(lora.weights, lora.config)
        if cached is not None:
            if packed_digests.get(task) != digest:
                raise ValueError(f"lora_config: task_id {task} is cached with another adapter")
            return cached, None
        return packed_request(task), (lora.weights, lora.config, digest)
    if lora.path is None:
        if cached is None:
            raise ValueError(
                f"lora_config: task_id {task} is not cached; its first request must give a path or packed weights"
            )
        return cached, None
    if cached is not None and cached.lora_path != str(lora.path):
        raise ValueError(f"lora_config: task_id {task} is cached with another adapter ({cached.lora_path})")
    return LoRARequest(f"task-{task}", task, str(lora.path)), None


class _EmbeddingBias:
    """A logits processor adding a [vocab] bias (moved to the logits' device on first use)."""

    def __init__(self, bias: torch.Tensor):
        self.bias = bias

    def __call__(self, output_ids, row: torch.Tensor) -> torch.Tensor:
        if self.bias.device != row.device:
            self.bias = self.bias.to(row.device)
        return row + self.bias


def embedding_bias_processor(bias, vocab_size: int) -> _EmbeddingBias:
    tensor = torch.as_tensor(bias, dtype=torch.float32).detach().cpu()
    if tensor.dim() != 1 or tensor.shape[0] != vocab_size:
        raise ValueError(
            f"embedding_bias must be a 1-D tensor of the vocabulary's size {vocab_size}, got shape "
            f"{tuple(tensor.shape)}"
        )
    return _EmbeddingBias(tensor)


def translate_request(
    request: Request,
    config: ExecutorConfig,
    post_processors: dict,
    outputs_configured: set[str],
    vocab_size: int,
    loras: dict[int, LoRARequest],
    packed_digests: dict[int, str] | None = None,
) -> tuple[SamplingParams, dict]:
    """The request's SamplingParams and its engine request options (with 'timeout' and 'lora_request'; and
    'lora_packed', the Executor's to load, for a new task_id's packed LoRA tensors)."""
    packed_digests = {} if packed_digests is None else packed_digests
    if not isinstance(request, Request):
        raise TypeError(f"enqueue_request takes an executor Request, got {type(request).__name__}")
    if not request.input_token_ids:
        raise ValueError("input_token_ids is empty: at least one token is needed")
    if not isinstance(request.max_tokens, int) or request.max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {request.max_tokens!r}")
    for name, why in UNSUPPORTED_FIELDS.items():
        if getattr(request, name) is not None:
            raise ValueError(f"Request.{name} is not supported: {why}")
    extra = speculation_and_prompt_tuning(request, vocab_size)
    sc, oc = request.sampling_config, request.output_config
    if oc.return_encoder_output:
        raise ValueError("output_config.return_encoder_output: the model is decoder-only (no encoder output)")
    guided = request.guided_decoding_params.to_params() if request.guided_decoding_params is not None else None
    width = sc.beam_width
    if not isinstance(width, int) or width < 1:
        raise ValueError(f"sampling_config.beam_width must be an integer >= 1, got {width!r}")
    if width > config.max_beam_width:
        raise ValueError(
            f"sampling_config.beam_width {width} exceeds ExecutorConfig.max_beam_width ({config.max_beam_width})"
        )
    n = request.num_return_sequences or sc.num_return_sequences or width  # beams: all `width` by default
    if n > (width if width > 1 else config.max_num_return_sequences):
        raise ValueError(
            f"num_return_sequences {n} exceeds "
            + (
                f"the beam width ({width})"
                if width > 1
                else f"ExecutorConfig.max_num_return_sequences ({config.max_num_return_sequences})"
            )
        )
    names = [o.name for o in (oc.additional_model_outputs or [])]
    missing = [name for name in names if name not in outputs_configured]
    if missing:
        raise ValueError(
            f"output_config.additional_model_outputs {missing} are not in ExecutorConfig.additional_model_outputs "
            f"({sorted(outputs_configured)})"
        )
    processors = []
    if request.embedding_bias is not None:
        processors.append(embedding_bias_processor(request.embedding_bias, vocab_size))
    sampling = any(v is not None for v in (sc.temperature, sc.top_k, sc.top_p, sc.min_p))
    early = sc.early_stopping
    if isinstance(early, int) and not isinstance(early, bool):
        early = bool(early)
    params = SamplingParams(
        n=n,
        max_tokens=request.max_tokens,
        min_tokens=sc.min_tokens or 0,
        temperature=(1.0 if sc.temperature is None else sc.temperature) if sampling and width == 1 else 0.0,
        top_k=sc.top_k or 0,
        top_p=1.0 if sc.top_p in (None, 0.0) else sc.top_p,
        min_p=sc.min_p or 0.0,
        seed=sc.seed,
        repetition_penalty=sc.repetition_penalty or 1.0,
        presence_penalty=sc.presence_penalty or 0.0,
        frequency_penalty=sc.frequency_penalty or 0.0,
        stop_token_sequences=[list(w) for w in request.stop_words or []],
        bad_words_token_ids=[list(w) for w in request.bad_words or []],
        use_beam_search=width > 1,
        beam_width=width if width > 1 else None,
        length_penalty=1.0 if sc.length_penalty is None else sc.length_penalty,
        early_stopping=False if early is None else early,
        logprobs=0 if oc.return_log_probs else None,
        return_context_logits=oc.return_context_logits,
        return_generation_logits=oc.return_generation_logits,
        additional_model_outputs=names,
        detokenize=False,
        guided_decoding=guided,
        ignore_eos=request.end_id is not None,
        stop_token_ids=[request.end_id] if request.end_id is not None else None,
        logits_processors=processors or None,
        **extra,
    )
    options: dict = {"client_id": request.client_id, "priority": request.priority}
    if request.streaming and width > 1:
        options["stream_beams"] = True
    name = request.logits_post_processor_name
    if name is not None:
        if name == Request.BATCHED_POST_PROCESSOR_NAME:
            options["use_batched_post_processor"] = True
        elif name in post_processors:
            options["logits_post_processor"] = post_processors[name]
        else:
            raise ValueError(
                f"logits_post_processor_name {name!r} is not configured; known: "
                f"{sorted(post_processors) + [Request.BATCHED_POST_PROCESSOR_NAME]}"
            )
    if not 0.0 <= request.priority <= 1.0:
        raise ValueError(f"priority must be in [0, 1], got {request.priority!r}")
    if request.allotted_time_ms is not None:
        ms = request.allotted_time_ms
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or ms <= 0:
            raise ValueError(f"allotted_time_ms must be > 0, got {ms!r}")
        options["timeout"] = ms / 1000.0
    if request.lora_config is not None:
        options["lora_request"], packed = lora_request_for(request.lora_config, loras, packed_digests)
        if packed is not None:
            options["lora_packed"] = packed  # loaded by the Executor before the request is queued
    if request.kv_cache_retention_config is not None:
        options["kv_retention"] = retention_of(request.kv_cache_retention_config)
    extra_ids = token_extra_ids_of(request, vocab_size)
    if extra_ids is not None:
        options["token_extra_ids"] = extra_ids
    return params, options


def retention_of(config) -> KvRetention:
    """Request.kv_cache_retention_config as the engine's KvRetention (ValueError naming the field)."""
    field = "kv_cache_retention_config"
    if not isinstance(config, (KvCacheRetentionConfig, dict)):
        raise ValueError(f"{field} must be a KvCacheRetentionConfig, got {type(config).__name__}")
    mode = getattr(config, "transfer_mode", "DRAM")
    if str(getattr(mode, "name", mode)).upper() != "DRAM" or getattr(config, "directory", None):
        raise ValueError(
            f"{field}.transfer_mode / directory: only DRAM (TensorRT-LLM's default; its other modes are debug "
            "options) is supported"
        )
    return make_retention(config, field)
