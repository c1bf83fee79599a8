"""The one token-level stop check: does the next token end a sequence, and why.

Plain decoding, speculative verification (each accepted draft is appended like a sampled token) and beam search
(each candidate token of each beam) all ask `check_stop`. Stop strings are text: the output processor finds them
after detokenizing and ends the sequence through `EngineCore.finish_sequence`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from petrel.engine.sequence import Sequence

logger = logging.getLogger("petrel")


@dataclass(frozen=True)
class Stop:
    finish_reason: str  # 'stop' | 'length'
    stop_reason: int | tuple[int, ...] | None = None  # the stop token, the stop token sequence, or None


def check_stop(seq: Sequence, token: int, max_model_len: int, grammar_accepted: bool | None = None) -> Stop | None:
    """Whether `token`, appended next to `seq` (seq.token_ids does not hold it yet), ends the sequence.

    In this order: its grammar (a token it refused, which happens only when a logits processor masked every
    token; or the grammar's end), a stop token id or an end-of-sequence token (unless ignore_eos), a stop token
    sequence it completes, then the length limits (max_tokens, the model's context).
    grammar_accepted: what seq's grammar said when it was fed `token`; None when it was not fed (no grammar, or a
    beam's candidate: a beam's grammar follows only the token chosen for it)."""
    p, req = seq.params, seq.request
    if grammar_accepted is False:
        logger.warning("request %r: token %d is outside its grammar; ending it", req.request_id, token)
        return Stop("stop")
    stop_token_ids = p.stop_token_ids or ()  # a list once SamplingParams is made
    is_stop_token = token in stop_token_ids or token in req.eos_token_ids
    if grammar_accepted and seq.grammar is not None and seq.grammar.is_terminated():
        return Stop("stop", token if is_stop_token else None)
    if token in stop_token_ids or (token in req.eos_token_ids and not p.ignore_eos):
        return Stop("stop", token)
    num_output = seq.num_output_tokens + 1
    for word in p.stop_token_sequences or ():
        if (
            num_output >= len(word)
            and word[-1] == token
            and seq.token_ids[seq.num_tokens - len(word) + 1 :] == word[:-1]
        ):
            return Stop("stop", tuple(word))
    if p.max_tokens is not None and num_output >= p.max_tokens:
        return Stop("length")
    if seq.num_tokens + 1 >= max_model_len:
        return Stop("length")
    return None
