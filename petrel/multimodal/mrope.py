"""Multimodal rotary positions (Qwen2-VL's M-RoPE): three position streams (temporal, height, width) per token.

Text tokens have three equal positions, counting on from the previous token. An image's or video's tokens (its
merged patch grid t x h x w, row-major) take (start + t * interval, start + row, start + column), and the text after
it goes on from start + max(h, w), as transformers' get_rope_index does. Past the prompt, a token's three positions
are its index + delta, delta = the prompt's largest position + 1 - its length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VisionSpan:
    """An item's placeholder tokens in the prompt: the first one's index and the merged grid they form."""

    start: int
    t: int
    h: int
    w: int
    interval: float = 1.0  # temporal position step per grid frame (Qwen2.5-VL videos: tokens_per_second * seconds)


def prompt_positions(num_tokens: int, spans: list[VisionSpan]) -> tuple[torch.Tensor, int]:
    """([3, num_tokens] positions, delta) of a prompt whose vision tokens are `spans` (ascending, not overlapping)."""
    parts, at, pos = [], 0, 0
    for span in spans:
        text = span.start - at
        parts.append(torch.arange(text).expand(3, -1) + pos)
        pos += text
        t = (torch.arange(span.t) * span.interval).long() + pos
        h, w = torch.arange(span.h) + pos, torch.arange(span.w) + pos
        grid = torch.meshgrid(t, h, w, indexing="ij")
        parts.append(torch.stack(grid).reshape(3, -1))
        pos += max(span.h, span.w)
        at = span.start + span.t * span.h * span.w
    parts.append(torch.arange(num_tokens - at).expand(3, -1) + pos)
    positions = torch.cat(parts, dim=1)
    if positions.shape[1] != num_tokens:
        raise ValueError(f"vision spans cover {positions.shape[1]} positions of a {num_tokens}-token prompt")
    return positions, int(positions.max()) + 1 - num_tokens if num_tokens else 0


def span_positions(mm, start: int, n: int) -> torch.Tensor:
    """[3, n] positions of tokens start .. start + n - 1 of a sequence whose MultiModalInputs is `mm` (None or
    without M-RoPE positions: a text-only prompt, three equal streams)."""
    index = torch.arange(start, start + n)
    table = getattr(mm, "mrope_positions", None)
    if table is None:
        return index.expand(3, -1)
    out = (index + mm.mrope_delta).expand(3, -1).clone()
    k = max(0, min(table.shape[1], start + n) - start)
    if k:
        out[:, :k] = table[:, start : start + k]
    return out
