"""The executor's logits post-processors, as the executor spec gives them: a named callback
fn(request_id, logits, beam_tokens, stream, client_id) per request and one batched
fn(request_ids, logits_list, beam_tokens_list, stream, client_ids). A beam-search request's beams come in one call
([beam_width, vocab] logits, beam_width token lists); other sequences one at a time ([1, vocab]). The older form
without `stream` (4 arguments) is still accepted."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from petrel.engine.sequence import Sequence

BatchedPostProcessor = Callable[[list, list[torch.Tensor], list[list[list[int]]], object, list], None]


def _stream_of(logits: torch.Tensor):
    """The stream the executor's post-processors get: None on CPU, the current CUDA stream on CUDA."""
    return torch.cuda.current_stream(logits.device) if logits.device.type == "cuda" else None


def _takes_stream(fn) -> bool:
    """The executor spec's callbacks take a stream (5 arguments); the old 4-argument form has none."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return True
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) >= 5


def _post_processor_groups(seqs: list[Sequence], rows: list[int]) -> list[list[int]]:
    """Rows that go to a post-processor in one call: all beams of a beam-search request together ([beam_width,
    vocab]), every other sequence alone ([1, vocab])."""
    groups: dict = {}
    for i in rows:
        seq = seqs[i]
        key = id(seq.request) if seq.params.use_beam_search else (id(seq.request), seq.index)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def _beam_block(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> tuple[torch.Tensor, list[list[int]]]:
    """A copy of the group's logits and its token lists. A beam-search request's first step (one row, from the
    prompt) is tiled to [beam_width, vocab], as every beam starts from it; its first row is kept."""
    seq = seqs[rows[0]]
    block, tokens = logits[rows], [seqs[i].token_ids for i in rows]
    width = seq.params.num_beams if seq.params.use_beam_search else 1
    if len(rows) == 1 and width > 1 and seq.num_output_tokens == 0:
        block, tokens = block.expand(width, -1).clone(), tokens * width
    return block, tokens


def run_post_processors(
    logits: torch.Tensor, seqs: list[Sequence], batched_fn: BatchedPostProcessor | None, errors: dict[int, str]
) -> None:
    """Named post-processors, then the batched one, on the rows not in `errors` (edited in place); a callback that
    raises adds its rows to `errors`."""
    stream = _stream_of(logits)
    named = [i for i, s in enumerate(seqs) if s.request.logits_post_processor is not None and i not in errors]
    for rows in _post_processor_groups(seqs, named):
        req = seqs[rows[0]].request
        fn = req.logits_post_processor
        block, tokens = _beam_block(logits, seqs, rows)
        try:
            if _takes_stream(fn):
                out = fn(req.request_id, block, tokens, stream, req.client_id)
            else:
                out = fn(req.request_id, block, tokens, req.client_id)
            out = block if out is None else out
            logits[rows] = out.reshape(block.shape[0], -1)[: len(rows)].to(logits.dtype)
        except Exception as exc:  # noqa: BLE001
            errors.update({i: f"logits processor failed: {type(exc).__name__}: {exc}" for i in rows})
    batched = [i for i, s in enumerate(seqs) if s.request.use_batched_post_processor and i not in errors]
    if batched:
        groups = _post_processor_groups(seqs, batched)
        blocks, tokens = zip(*(_beam_block(logits, seqs, rows) for rows in groups))
        blocks, tokens = list(blocks), list(tokens)  # copies: written back after the callback edits them
        reqs = [seqs[rows[0]].request for rows in groups]
        fn = batched_fn
        try:
            if _takes_stream(fn):
                fn([r.request_id for r in reqs], blocks, tokens, stream, [r.client_id for r in reqs])
            else:
                fn([r.request_id for r in reqs], blocks, tokens, [r.client_id for r in reqs])
            for rows, block in zip(groups, blocks):
                logits[rows] = block.reshape(block.shape[0], -1)[: len(rows)].to(logits.dtype)
        except Exception as exc:  # noqa: BLE001
            errors.update({i: f"batched logits post-processor failed: {type(exc).__name__}: {exc}" for i in batched})
