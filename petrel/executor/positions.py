"""An Executor Request's rotary positions: `position_ids` (a text model's prompt positions) and `mrope_config` (an
M-RoPE model's rotary table and position delta, TensorRT-LLM's MropeConfig). Every failure is a ValueError naming
the field.

position_ids: one position (an integer >= 0) per prompt token; a generated token's position goes on from the last
prompt token's (last + 1, + 2, ...). Positions 0, 1, 2, ... are the default and change nothing. Other positions
key the prefix cache too (EngineRequest.block_key), since the KV depends on them.

mrope_config (Qwen2-VL): the prompt tokens' rotary angles as a table of (cos, sin) per frequency, used as given
(petrel/model/llama.py's rotary_rows), and the delta of the later tokens' positions (index + delta on all three
streams). A request whose image rows come as embeddings needs it: the rows alone cannot tell the image grid's
positions. Its digest keys every block of the request in the prefix cache.
"""

from __future__ import annotations

import hashlib

import torch

from petrel.multimodal.inputs import MultiModalInputs


def position_ids_of(request, model_config) -> list[int] | None:
    """The request's prompt positions for the engine (None: the default 0, 1, 2, ..., given or not)."""
    given = request.position_ids
    if given is None:
        return None
    if model_config.mrope_section:
        raise ValueError(
            "Request.position_ids: this model's rotary positions are multimodal (M-RoPE); give Request.mrope_config"
        )
    if isinstance(given, torch.Tensor):
        given = given.tolist()
    if not isinstance(given, (list, tuple)) or not all(
        isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in given
    ):
        raise ValueError("Request.position_ids must be a list of integers >= 0, one per prompt token")
    n = len(request.input_token_ids)
    if len(given) != n:
        raise ValueError(f"Request.position_ids has {len(given)} positions for {n} prompt tokens; give one per token")
    last = max(given) if given else 0
    limit = model_config.max_position_embeddings
    if max(last, given[-1] + request.max_tokens) >= limit:
        raise ValueError(
            f"Request.position_ids: positions up to {max(last, given[-1] + request.max_tokens)} (the prompt's and "
            f"max_tokens after its last) pass the model's {limit} rotary positions"
        )
    given = list(given)
    return None if given == list(range(n)) else given


def apply_mrope_config(request, multi_modal: MultiModalInputs | None, model_config) -> MultiModalInputs | None:
    """The request's MultiModalInputs with its mrope_config's rotary table and delta (a new one for a text prompt);
    an M-RoPE model's embedding request without mrope_config is refused."""
    config = request.mrope_config
    if config is None:
        if model_config.mrope_section and multi_modal is not None:
            raise ValueError(
                "Request.mrope_config is needed with multimodal_embedding on this M-RoPE model: the rows alone do not "
                "tell the image grid's rotary positions"
            )
        return multi_modal
    if not model_config.mrope_section:
        raise ValueError(
            "Request.mrope_config: this model has no multimodal rotary embedding (M-RoPE); use position_ids"
        )
    for name in ("mrope_rotary_cos_sin", "mrope_position_deltas"):
        if not hasattr(config, name):
            raise ValueError(f"Request.mrope_config must be an executor MropeConfig (it has no {name})")
    n, head_dim = len(request.input_token_ids), model_config.head_dim
    try:
        table = torch.as_tensor(config.mrope_rotary_cos_sin).detach().to("cpu", torch.float32)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"Request.mrope_config.mrope_rotary_cos_sin must be a tensor ({exc})") from None
    if table.numel() % head_dim or table.numel() // head_dim < n:
        raise ValueError(
            f"Request.mrope_config.mrope_rotary_cos_sin has {table.numel()} values; it needs rows of head_dim "
            f"({head_dim}) values ((cos, sin) per frequency), one row per prompt token ({n})"
        )
    table = table.reshape(-1, head_dim // 2, 2)[:n].contiguous()
    if not torch.isfinite(table).all() or table.abs().max() > 1.0 + 1e-3:
        raise ValueError("Request.mrope_config.mrope_rotary_cos_sin must hold cosines and sines (finite, in [-1, 1])")
    delta = config.mrope_position_deltas
    if isinstance(delta, torch.Tensor):
        if delta.numel() != 1:
            raise ValueError("Request.mrope_config.mrope_position_deltas must be one integer")
        delta = int(delta.item())
    if isinstance(delta, bool) or not isinstance(delta, int):
        raise ValueError(f"Request.mrope_config.mrope_position_deltas must be an integer, got {delta!r}")
    limit = model_config.max_position_embeddings
    if n + delta < 0 or n + request.max_tokens + delta >= limit:
        raise ValueError(
            f"Request.mrope_config.mrope_position_deltas {delta}: generated tokens' positions (index + delta) must be "
            f"in 0 .. {limit - 1}"
        )
    mm = multi_modal if multi_modal is not None else MultiModalInputs([])
    mm.mrope_positions = torch.arange(n).expand(3, -1)  # the table stands for the prompt's; these only index it
    mm.mrope_delta = delta
    mm.rope_cos_sin = table
    digest = hashlib.sha256(f"mrope:{delta}:".encode())
    digest.update(table.numpy().tobytes())
    mm.rope_digest = digest.digest()
    return mm
