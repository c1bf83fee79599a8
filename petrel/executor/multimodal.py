"""An Executor Request's multimodal fields -> the engine's MultiModalInputs.

`multimodal_embedding` ([rows, hidden]) gives the rows of the prompt's image placeholder tokens (the model's image
token id in input_token_ids, in order), as the vision encoder and connector would make them: the encoder is skipped
for them. `multimodal_input` (TensorRT-LLM's MultimodalInput) splits those rows into items: item k starts at prompt
position multimodal_positions[k] and takes the next multimodal_lengths[k] placeholder rows. Each item's hash (the
prefix cache's key) is the hash of its embedding rows, so equal tokens over other embeddings never share KV blocks.
Every failure is a ValueError naming the field."""

from __future__ import annotations

import hashlib

import torch

from petrel.multimodal.inputs import MultiModalInputs, MultiModalItem
from petrel.multimodal.prompts import TEXT_ONLY


def embedding_hash(rows: torch.Tensor) -> bytes:
    """The content hash of an item's given embedding rows (float32, as petrel keeps them)."""
    h = hashlib.sha256(f"embedding:{tuple(rows.shape)}:".encode())
    h.update(rows.numpy().tobytes())
    return h.digest()


def _embedding(value, hidden_size: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"Request.multimodal_embedding must be a [rows, hidden] tensor ({exc})") from None
    if value.dim() != 2 or value.shape[1] != hidden_size or not value.is_floating_point():
        raise ValueError(
            f"Request.multimodal_embedding must be a floating-point [rows, {hidden_size}] tensor (the model's hidden "
            f"size), got {value.dtype} {tuple(value.shape)}"
        )
    value = value.detach().to(device="cpu", dtype=torch.float32).contiguous()
    if not torch.isfinite(value).all():
        raise ValueError("Request.multimodal_embedding has NaN or infinite values")
    return value


def _int_list(value, name: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"Request.multimodal_input.{name} must be a list of integers, got {value!r}")
    return list(value)


def _spans(mm_input, rows: list[int]) -> list[tuple[int, int]]:
    """[start, end) indices into `rows` of each item of a MultimodalInput (or one item for all rows without one)."""
    if mm_input is None:
        return [(0, len(rows))]
    for name in ("multimodal_hashes", "multimodal_positions", "multimodal_lengths"):
        if not hasattr(mm_input, name):
            raise ValueError(f"Request.multimodal_input must be an executor MultimodalInput (it has no {name})")
    hashes = mm_input.multimodal_hashes
    if not isinstance(hashes, (list, tuple)) or not hashes:
        raise ValueError("Request.multimodal_input.multimodal_hashes must be a non-empty list, one hash per item")
    for k, h in enumerate(hashes):
        _int_list(h, f"multimodal_hashes[{k}]")
    positions = _int_list(mm_input.multimodal_positions, "multimodal_positions")
    lengths = _int_list(mm_input.multimodal_lengths, "multimodal_lengths")
    if not len(hashes) == len(positions) == len(lengths):
        raise ValueError(
            f"Request.multimodal_input: {len(hashes)} hashes, {len(positions)} positions and {len(lengths)} lengths; "
            f"give one of each per item"
        )
    index = {p: i for i, p in enumerate(rows)}
    spans, at = [], 0
    for k, (position, length) in enumerate(zip(positions, lengths)):
        if length < 1:
            raise ValueError(f"Request.multimodal_input.multimodal_lengths[{k}] must be >= 1, got {length}")
        if index.get(position) != at:
            expected = f"prompt position {rows[at]}" if at < len(rows) else "none is left"
            raise ValueError(
                f"Request.multimodal_input.multimodal_positions[{k}] = {position}: item {k} must start at the first "
                f"image placeholder token after the previous item's ({expected})"
            )
        spans.append((at, at + length))
        at += length
    if at != len(rows):
        raise ValueError(
            f"Request.multimodal_input.multimodal_lengths sum to {at}, but input_token_ids has {len(rows)} image "
            f"placeholder tokens"
        )
    return spans


def multimodal_inputs(request, processor, hidden_size: int) -> MultiModalInputs | None:
    """The MultiModalInputs of a Request's multimodal_embedding / multimodal_input (None without them).
    processor: the engine's multimodal processor (None for a text-only model)."""
    embedding, mm_input = request.multimodal_embedding, request.multimodal_input
    ids = list(request.input_token_ids)
    if embedding is None and mm_input is None:
        if processor is not None and processor.image_token_id in ids:
            raise ValueError(
                f"input_token_ids has {ids.count(processor.image_token_id)} image placeholder token(s) "
                f"(id {processor.image_token_id}) but the request gives no multimodal_embedding for them"
            )
        return None
    name = "multimodal_embedding" if embedding is not None else "multimodal_input"
    if processor is None:
        raise ValueError(f"Request.{name}: {TEXT_ONLY}")
    if not getattr(processor, "takes_embeddings", False):
        raise ValueError(f"Request.{name} is not supported for {type(processor).__name__} models")
    if embedding is None:
        raise ValueError(
            "Request.multimodal_input needs Request.multimodal_embedding: petrel has no image data to encode, "
            "the hashes alone cannot stand for it"
        )
    table = _embedding(embedding, hidden_size)
    video = getattr(processor, "video_token_id", None)
    if video is not None and video in ids:
        raise ValueError(
            f"Request.multimodal_embedding: input_token_ids has video placeholder tokens (id {video}); given "
            "embeddings stand for images only"
        )
    rows = [i for i, t in enumerate(ids) if t == processor.image_token_id]
    if len(rows) != table.shape[0]:
        raise ValueError(
            f"Request.multimodal_embedding has {table.shape[0]} rows, but input_token_ids has {len(rows)} image "
            f"placeholder tokens (id {processor.image_token_id}); give one row per placeholder, in order"
        )
    items = []
    for start, end in _spans(mm_input, rows):
        part = table[start:end]
        items.append(MultiModalItem("embedding", embedding_hash(part), tuple(rows[start:end]), part))
    return MultiModalInputs(items)
