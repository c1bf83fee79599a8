"""The model outputs a request asked for besides its tokens, gathered from a step's rows onto its sequences:
prompt logprobs and the prompt's logits / hidden states (context), and per sampled token its logits / hidden
state (generation). engine_output.build_output reports them."""

from __future__ import annotations

import torch

from petrel.engine.model_runner import ContextRows
from petrel.engine.sampler import prompt_logprobs
from petrel.engine.sequence import Sequence


def gather_context_rows(rows: ContextRows) -> None:
    """Keep a prompt span's logits / hidden states and score its prompt logprobs (after a preemption, the
    recomputed positions already kept are skipped)."""
    seq, p, gathered = rows.seq, rows.seq.params, rows.seq.extra_outputs
    skip = gathered.num_context_rows - rows.first
    new = {"logits": rows.logits, "hidden_states": rows.hidden}
    k = next(t.shape[0] for t in new.values() if t is not None)
    if skip >= k:
        return
    for name, tensor in new.items():
        if tensor is not None:
            gathered.context.setdefault(name, []).append(tensor[skip:])
    if p.prompt_logprobs is not None:
        start = rows.first + skip
        end = min(rows.first + k, seq.num_prompt_tokens - 1)  # the last prompt position has no next prompt token
        if end > start:
            nxt = seq.token_ids[start + 1 : end + 1]
            gathered.prompt_logprobs.extend(
                prompt_logprobs(rows.logits[skip : skip + end - start], nxt, p.prompt_logprobs)
            )


def generation_rows(
    seqs: list[Sequence], logits: torch.Tensor, hidden: torch.Tensor | None, rows: list[int]
) -> list[dict]:
    """Per sampling row: the raw logits / hidden state ({name: row}), for the sequences that asked for them.
    logits: one row per sequence; hidden: the step's sampling rows, rows[i] being sequence i's."""
    extras = []
    for i, seq in enumerate(seqs):
        p = seq.params
        entry = {}
        if p.return_generation_logits:
            entry["logits"] = logits[i].clone()
        if "hidden_states" in p.additional_model_outputs and hidden is not None:
            entry["hidden_states"] = hidden[rows[i]].clone()
        extras.append(entry)
    return extras
