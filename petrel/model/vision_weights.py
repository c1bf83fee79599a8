"""The vision half of a vision-language checkpoint: its tensors copied into the transformers modules petrel builds
for the tower (and connector), every name and shape checked."""

from __future__ import annotations

import torch
from torch import nn


def copy_tower_weights(model: nn.Module, prefixes: tuple[str, ...], tensors: dict[str, torch.Tensor]) -> None:
    """Copy `tensors` (module names, e.g. 'visual.blocks.0.attn.qkv.weight') into the model's parameters whose names
    start with one of `prefixes`; ValueError naming what is missing, unexpected or of the wrong shape."""
    params = {n: p for n, p in model.named_parameters() if n.startswith(prefixes)}
    missing, unexpected = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise ValueError(f"vision weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, tensor in tensors.items():
        if params[name].shape != tensor.shape:
            expected = tuple(params[name].shape)
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
        params[name].data.copy_(tensor)
