"""Multi-LoRA: PEFT adapter loading, the LoRA-aware linear wrapper and the slot manager.

With enable_lora every projection of the decoder (fused qkv_proj and gate_up_proj, o_proj, down_proj) is wrapped by
a LoRALinear holding max_loras adapter slots: A [max_loras, s * max_lora_rank, in] and
B [max_loras, out, s * max_lora_rank]
(s = 3 for qkv_proj, 2 for gate_up_proj, else 1: the sub-projections' A matrices stacked along the rank, B block
diagonal over the output slices; unused rank rows and empty slots are zeros). Before each forward the runner gives
the manager one slot per token (-1: the base model); every wrapped layer then adds, for each slot present,
(x[rows] @ A^T) @ B^T to those rows (the alpha/r scale is folded into B when the adapter is loaded).
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from petrel.lora import LoRARequest

SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# PEFT module name -> (petrel module path inside a decoder layer, slice index in it)
TARGET_MAP = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
# a mixture of experts' weights (petrel/model/moe.py): its experts (Mixtral's block_sparse_moe too), shared expert,
# shared expert's gate and router
_EXPERT_KEY = re.compile(
    r"\.layers\.\d+\.((?:mlp|block_sparse_moe)\.(?:experts|shared_expert_gate|shared_expert|gate)\b\S*?)\.lora_"
)
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class LoRAAdapter:
    """An adapter's tensors on CPU: (layer, petrel module path) -> {slice: (A [r, in], B*scale [out_slice, r])}."""

    request: LoRARequest
    rank: int
    weights: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]]


def load_adapter(request: LoRARequest, cfg, max_rank: int) -> LoRAAdapter:
    """Read a PEFT LoRA adapter directory; ValueError for anything petrel cannot apply exactly."""
    path = request.lora_path
    where = f"lora_request {request.lora_name!r} ({path})"
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"{where}: no adapter_config.json there (expected a PEFT LoRA adapter directory)")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: adapter_config.json is unreadable: {exc}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise ValueError(f"{where}: adapter_config.json needs an integer r >= 1 and a number lora_alpha")
    if rank > max_rank:
        raise ValueError(f"{where}: rank {rank} exceeds max_lora_rank {max_rank}")
    unsupported = []
    if config.get("fan_in_fan_out"):
        unsupported.append("fan_in_fan_out=true")
    if config.get("use_dora"):
        unsupported.append("use_dora=true")
    if config.get("bias", "none") != "none":
        unsupported.append(f"bias={config['bias']!r}")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform", "trainable_token_indices"):
        if config.get(key):
            unsupported.append(f"{key}={config[key]!r}")
    targets = config.get("target_modules")
    if not isinstance(targets, list):
        unsupported.append(f"target_modules={targets!r} (a list of module names is needed)")
    else:
        bad = sorted(set(targets) - set(SUPPORTED_TARGETS))
        if bad:
            unsupported.append(f"target_modules {bad} (supported: {', '.join(SUPPORTED_TARGETS)})")
    if unsupported:
        raise ValueError(f"{where}: unsupported adapter option(s): {'; '.join(unsupported)}")
    scale = alpha / (rank**0.5 if config.get("use_rslora") else rank)

    weights_file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights_file):
        raise ValueError(f"{where}: no adapter_model.safetensors there")
    from safetensors.torch import load_file

    try:
        tensors = load_file(weights_file)
    except Exception as exc:  # noqa: BLE001 - a corrupt file, reported as the bad input it is
        raise ValueError(f"{where}: adapter_model.safetensors is unreadable: {exc}") from None
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if (expert := _EXPERT_KEY.search(key)) is not None:
            raise ValueError(
                f"{where}: tensor {key!r} adapts {expert.group(1)}: LoRA on a mixture of experts' weights (its "
                f"experts, shared expert and router) is not supported (attention LoRA is)"
            )
        m = _KEY.match(key)
        if m is None or m.group(3) not in TARGET_MAP:
            raise ValueError(
                f"{where}: unexpected tensor {key!r} (only lora_A/lora_B of "
                f"{', '.join(SUPPORTED_TARGETS)} in decoder layers are supported)"
            )
        layer = int(m.group(1))
        if layer >= cfg.num_hidden_layers:
            raise ValueError(f"{where}: tensor {key!r} names layer {layer}; the model has {cfg.num_hidden_layers}")
        if m.group(2) == "mlp" and cfg.is_moe_layer(layer):
            raise ValueError(
                f"{where}: tensor {key!r} adapts layer {layer}'s MLP, which is a mixture of experts: LoRA on "
                f"expert weights is not supported (attention LoRA is)"
            )
        pairs.setdefault((layer, m.group(3)), {})[m.group(4)] = tensor.float()
    sizes = _slice_sizes(cfg)
    weights: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (layer, name), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: layer {layer} {name} has lora_{''.join(ab)} only")
        module, index = TARGET_MAP[name]
        out_size, in_size = sizes[module][index], sizes[module + ".in"]
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (rank, in_size) or tuple(b.shape) != (out_size, rank):
            raise ValueError(
                f"{where}: layer {layer} {name} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                f"expected {(rank, in_size)} and {(out_size, rank)} (adapter for another model?)"
            )
        weights.setdefault((layer, module), {})[index] = (a, b * scale)
    return LoRAAdapter(request, rank, weights)


def _slice_sizes(cfg) -> dict:
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "self_attn.qkv_proj": [q, kv, kv],
        "self_attn.qkv_proj.in": h,
        "self_attn.o_proj": [h],
        "self_attn.o_proj.in": q,
        "mlp.gate_up_proj": [i, i],
        "mlp.gate_up_proj.in": h,
        "mlp.down_proj": [h],
        "mlp.down_proj.in": i,
    }


class LoRAMapping:
    """Which rows of the flat batch use which slot, for the forward about to run (shared by every LoRALinear)."""

    def __init__(self):
        self.num_tokens = 0
        self.segments: list[tuple[int, torch.Tensor | None]] = []  # (slot, row indices or None for all rows)

    def set(self, token_slots: list[int], device) -> None:
        self.num_tokens = len(token_slots)
        present = sorted(set(token_slots) - {-1})
        if not present:
            self.segments = []
            return
        if len(present) == 1 and -1 not in token_slots:
            self.segments = [(present[0], None)]
            return
        slots = torch.tensor(token_slots, device=device)
        self.segments = [(s, (slots == s).nonzero().squeeze(1)) for s in present]

    def clear(self) -> None:
        self.num_tokens, self.segments = 0, []


class LoRALinear(nn.Module):
    """A petrel Linear plus max_loras adapter slots over its output slices."""

    def __init__(self, base: nn.Module, slice_sizes: list[int], max_loras: int, max_rank: int, mapping: LoRAMapping):
        super().__init__()
        self.base = base
        self.slice_sizes = slice_sizes
        self.max_rank = max_rank
        self.mapping = mapping
        out_size, in_size = base.out_features, base.in_features
        width = len(slice_sizes) * max_rank
        like = base.weight if isinstance(base, nn.Linear) else base.marker  # QuantizedLinear: the model's dtype
        kw = dict(dtype=like.dtype, device=like.device)
        self.register_buffer("lora_a", torch.zeros(max_loras, width, in_size, **kw), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, out_size, width, **kw), persistent=False)

    def set_slot(self, slot: int, slices: dict[int, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """Load an adapter's (A, scaled B) per slice into a slot; None or a missing slice: zeros."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        offset = 0
        for index, size in enumerate(self.slice_sizes):
            if slices and index in slices:
                a, b = slices[index]
                r0 = index * self.max_rank
                self.lora_a[slot, r0 : r0 + a.shape[0]].copy_(a)
                self.lora_b[slot, offset : offset + size, r0 : r0 + a.shape[0]].copy_(b)
            offset += size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        m = self.mapping
        if not m.segments or x.dim() != 2 or x.shape[0] != m.num_tokens:
            return out
        for slot, rows in m.segments:
            if rows is None:
                out = out + (x @ self.lora_a[slot].t()) @ self.lora_b[slot].t()
            else:
                out.index_add_(0, rows, (x[rows] @ self.lora_a[slot].t()) @ self.lora_b[slot].t())
        return out


class LoRAManager:
    """Adapter slots of a model: a CPU cache of loaded adapters, slots filled on first use and evicted least
    recently used. The scheduler never lets more distinct adapters run at once than there are slots (a request whose
    adapter is not running waits while max_loras others are), so a slot that a running sequence needs is never
    evicted and every step's adapters fit."""

    def __init__(self, model: nn.Module, cfg, max_loras: int, max_rank: int):
        if getattr(cfg, "kv_lora_rank", 0):
            raise ValueError(f"enable_lora: LoRA adapters on {cfg.architecture}'s latent attention are not supported")
        self.cfg = cfg
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.mapping = LoRAMapping()
        self.device = next(model.parameters()).device
        self.layers: dict[tuple[int, str], LoRALinear] = {}
        sizes = _slice_sizes(cfg)
        for i, layer in enumerate(model.model.layers):
            for path in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
                parent_name, attr = path.split(".")
                parent = getattr(layer, parent_name)
                if not hasattr(parent, attr):  # a mixture of experts' layer: no dense MLP (load_adapter refuses one)
                    continue
                wrapped = LoRALinear(getattr(parent, attr), sizes[path], max_loras, max_rank, self.mapping)
                setattr(parent, attr, wrapped)
                self.layers[(i, path)] = wrapped
        self._cpu: dict[int, LoRAAdapter] = {}  # lora_int_id -> adapter (any thread, under the lock)
        self._lock = threading.Lock()
        self.slots: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first
        self.num_loads = 0

    def register(self, request: LoRARequest, adapter: LoRAAdapter | None = None) -> None:
        """Load the adapter into the CPU cache (the caller's thread): ValueError for a bad one. `adapter`: one built
        already (the Executor's packed tensors), kept under the request's id instead of reading its path."""
        with self._lock:
            known = self._cpu.get(request.lora_int_id)
        if known is not None:
            if os.path.abspath(known.request.lora_path) != os.path.abspath(request.lora_path):
                raise ValueError(
                    f"lora_request: lora_int_id {request.lora_int_id} is already used by adapter "
                    f"{known.request.lora_name!r} at {known.request.lora_path}"
                )
            return
        if adapter is None:
            adapter = load_adapter(request, self.cfg, self.max_rank)
        with self._lock:
            self._cpu.setdefault(request.lora_int_id, adapter)

    def activate(self, lora_ids: set[int], in_use: set[int]) -> dict[int, int]:
        """Give every adapter in lora_ids a slot (loading it there if needed, evicting the least recently used one
        no running sequence uses); returns lora_int_id -> slot."""
        for lid in lora_ids:
            if lid in self.slots:
                self.slots.move_to_end(lid)
                continue
            used = set(self.slots.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next((v for v in self.slots if v not in in_use and v not in lora_ids), None)
                if victim is None:
                    raise RuntimeError(f"all {self.max_loras} LoRA slots are in use by running sequences")
                slot = self.slots.pop(victim)
            with self._lock:
                adapter = self._cpu[lid]
            for key, layer in self.layers.items():
                layer.set_slot(slot, adapter.weights.get(key))
            self.slots[lid] = slot
            self.num_loads += 1
        return {lid: self.slots[lid] for lid in lora_ids}
