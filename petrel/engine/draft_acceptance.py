"""The sampler's rule for a random row that verifies a draft token (speculative sampling).

A draft comes as a token alone (drawn deterministically: prompt lookup, a greedy draft model, the caller's tokens)
or with the distribution q it was drawn from (the caller's draft logits, TensorRT-LLM's
ExternalDraftTokensConfig.logits). With p the row's processed target distribution:
- a token alone is q = a point mass: accept d with probability p(d), else draw from p with d removed;
- with q: accept d when p(d) / q(d) >= u, u uniform in [0, 1) (so with probability min(1, p(d) / q(d))), else draw
  from the normalised max(0, p - q).
Either way the emitted token is distributed exactly as p (when d was drawn from q). With an acceptance_threshold t
(TensorRT-LLM's: a constant in place of the uniform draw), d is accepted when p(d) / q(d) >= t: deterministic,
and no longer exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftWithProbs:
    """A draft token with the distribution it was drawn from ([vocab], on any device), and maybe a threshold."""

    token: int
    probs: torch.Tensor
    threshold: float | None = None


Draft = int | DraftWithProbs  # what a sampler row verifies: a token alone, or with its distribution


def draft_token(draft: Draft) -> int:
    return draft.token if isinstance(draft, DraftWithProbs) else draft


def accepts(p: torch.Tensor, draft: Draft, generator: torch.Generator) -> bool:
    """Whether the row whose processed distribution is p ([vocab]) keeps the draft (one uniform draw from the
    generator, none with a threshold)."""
    if not isinstance(draft, DraftWithProbs):
        return torch.rand((), generator=generator, device=generator.device).item() < p[draft].item()
    q = draft.probs[draft.token].item()
    ratio = p[draft.token].item() / q if q > 0 else float("inf")
    if draft.threshold is not None:
        return ratio >= draft.threshold
    return torch.rand((), generator=generator, device=generator.device).item() < ratio


def reject(draw: torch.Tensor, p: torch.Tensor, draft: Draft) -> None:
    """Make `draw` (the row to draw the replacement from, a copy of p) what a rejected draft leaves: p without d,
    or the normalised max(0, p - q) (p itself when p <= q everywhere, which rounding alone can bring)."""
    if not isinstance(draft, DraftWithProbs):
        draw[draft] = 0.0
        return
    residual = (p - draft.probs.to(device=p.device, dtype=p.dtype)).clamp_(min=0.0)
    if residual.sum() > 0:
        draw.copy_(residual)


def draft_with_probs(tokens: list[int], logits: torch.Tensor, threshold: float | None) -> list[DraftWithProbs]:
    """The drafts with the distributions their logits rows give (softmax, float32)."""
    probs = torch.softmax(logits.float(), dim=-1)
    return [DraftWithProbs(token, probs[i], threshold) for i, token in enumerate(tokens)]


def checked_draft_logits(logits, num_tokens: int, name: str) -> torch.Tensor:
    """Draft logits as float32 on the CPU, checked: a floating-point [num_tokens, vocab] tensor of finite values or
    -inf, a finite value in every row (else a ValueError naming `name`)."""
    if not isinstance(logits, torch.Tensor):
        try:
            logits = torch.as_tensor(logits, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(
                f"{name} must be a tensor [num_draft_tokens, vocab], got {type(logits).__name__}"
            ) from None
    if logits.dim() != 2 or logits.shape[0] != num_tokens or not logits.is_floating_point():
        raise ValueError(
            f"{name} must be a floating-point tensor [num_draft_tokens = {num_tokens}, vocab], got {logits.dtype} "
            f"of shape {tuple(logits.shape)}"
        )
    logits = logits.detach().to("cpu", torch.float32)
    if logits.isnan().any() or (logits == float("inf")).any() or not logits.isfinite().any(dim=1).all():
        raise ValueError(f"{name} must hold finite values or -inf, with a finite value in every row")
    return logits
