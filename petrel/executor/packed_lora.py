"""TensorRT-LLM's packed LoRA (Executor LoraConfig(task_id, weights, config)) as petrel's LoRA adapter.

config: [rows, 3] (or 4: DoRA's is_dora flag, which must be 0) of (module id, layer, adapter size r).
weights: [rows, width] (a leading dimension of 1 is dropped): row i is module i's in weights [r, in] (PEFT's
lora_A) flattened, then its out weights [out, r] (lora_B) flattened, then padding. The out weights carry the
adapter's scale already (TensorRT-LLM's converter multiplies them by alpha / r), so they are used as given.

Module ids (TensorRT-LLM's) and where they go in petrel's fused projections (petrel/model/lora.py):
0 attn_qkv (one A, B over q, k and v), 1 attn_q, 2 attn_k, 3 attn_v, 4 attn_dense (o_proj), 5 mlp_h_to_4h
(gate_proj), 6 mlp_4h_to_h (down_proj), 7 mlp_gate (up_proj), 18 mlp_gate_up (one A, B over gate and up, in that
order). A fused module's A serves each of its slices, with the slice's rows of B: the same product. Cross-attention
modules (8-12) are refused (decoder-only models), as are the mixture-of-experts ones (13-17: petrel's LoRA wraps
dense projections only).
"""

from __future__ import annotations

import hashlib

import torch

from petrel.lora import LoRARequest
from petrel.model.lora import LoRAAdapter, _slice_sizes

FIELD = "lora_config"
# module id -> (petrel module path, the slices its out weights cover, in order)
MODULES = {
    0: ("self_attn.qkv_proj", (0, 1, 2)),
    1: ("self_attn.qkv_proj", (0,)),
    2: ("self_attn.qkv_proj", (1,)),
    3: ("self_attn.qkv_proj", (2,)),
    4: ("self_attn.o_proj", (0,)),
    5: ("mlp.gate_up_proj", (0,)),
    6: ("mlp.down_proj", (0,)),
    7: ("mlp.gate_up_proj", (1,)),
    18: ("mlp.gate_up_proj", (0, 1)),
}
CROSS_ATTENTION = range(8, 13)
MIXTURE_OF_EXPERTS = range(13, 18)


def packed_request(task_id: int) -> LoRARequest:
    """The LoRARequest a packed adapter is registered under (no directory: its `lora_path` names the task)."""
    return LoRARequest(f"task-{task_id}", task_id, f"trtllm-packed-lora:task-{task_id}")


def packed_digest(weights, config) -> str:
    """What tells two packings apart (a task_id given again must bring the same ones)."""
    h = hashlib.sha256()
    for t in (weights, config):
        t = torch.as_tensor(t).detach().cpu().contiguous()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _matrix(value, name: str, columns: tuple[int, ...] | None = None) -> torch.Tensor:
    try:
        t = torch.as_tensor(value).detach().cpu()
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{FIELD}.{name} must be a tensor: {exc}") from None
    if t.dim() == 3 and t.shape[0] == 1:  # TensorRT-LLM's converter saves them with a batch dimension
        t = t[0]
    if t.dim() != 2 or t.shape[0] == 0 or (columns is not None and t.shape[1] not in columns):
        want = f"[rows, {' or '.join(map(str, columns))}]" if columns else "[rows, width]"
        raise ValueError(f"{FIELD}.{name} must be a 2-D tensor {want}, got shape {tuple(t.shape)}")
    return t


def adapter_from_packed(request: LoRARequest, weights, config, cfg, max_rank: int) -> LoRAAdapter:
    """The adapter of TensorRT-LLM's packed tensors for the model of ModelConfig `cfg` (ValueError naming the field
    for anything petrel cannot apply exactly)."""
    if weights is None or config is None:
        raise ValueError(f"{FIELD}: packed weights need their config, and a config its weights")
    config = _matrix(config, "config", (3, 4))
    weights = _matrix(weights, "weights")
    if config.dtype.is_floating_point and not torch.equal(config, config.round()):
        raise ValueError(f"{FIELD}.config must hold integers (module id, layer, adapter size)")
    config = config.long()
    if weights.shape[0] != config.shape[0]:
        raise ValueError(f"{FIELD}: weights has {weights.shape[0]} rows, config {config.shape[0]}; one per module")
    weights = weights.float()
    sizes = _slice_sizes(cfg)
    out: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    rank = 0
    for i, row in enumerate(config.tolist()):
        module_id, layer, r = row[:3]
        where = f"{FIELD}.config[{i}]"
        if len(row) == 4 and row[3]:
            raise ValueError(f"{where}: DoRA adapters (is_dora) are not supported")
        if module_id in CROSS_ATTENTION:
            raise ValueError(f"{where}: module {module_id} adapts cross-attention; petrel's models are decoder-only")
        if module_id in MIXTURE_OF_EXPERTS:
            raise ValueError(
                f"{where}: module {module_id} adapts mixture-of-experts layers; petrel's LoRA "
                "adapts the dense projections"
            )
        if module_id not in MODULES:
            raise ValueError(f"{where}: unknown module id {module_id} (known: {sorted(MODULES)})")
        if not 0 <= layer < cfg.num_hidden_layers:
            raise ValueError(f"{where}: layer {layer} outside the model's {cfg.num_hidden_layers} layers")
        if not 1 <= r <= max_rank:
            raise ValueError(f"{where}: adapter size {r} must be 1..max_lora_rank ({max_rank})")
        module, slices = MODULES[module_id]
        in_size = sizes[module + ".in"]
        out_sizes = [sizes[module][s] for s in slices]
        need = r * in_size + sum(out_sizes) * r
        if need > weights.shape[1]:
            raise ValueError(
                f"{FIELD}.weights[{i}]: module {module_id} with adapter size {r} needs {need} values "
                f"({r} x {in_size} in, {sum(out_sizes)} x {r} out), the row has {weights.shape[1]}"
            )
        a = weights[i, : r * in_size].reshape(r, in_size).clone()
        b = weights[i, r * in_size : need].reshape(sum(out_sizes), r)
        target = out.setdefault((layer, module), {})
        offset = 0
        for s, size in zip(slices, out_sizes):
            if s in target:
                raise ValueError(f"{where}: layer {layer} {module} slice {s} is adapted twice")
            target[s] = (a, b[offset : offset + size].clone())
            offset += size
        rank = max(rank, r)
    return LoRAAdapter(request, rank, out)
