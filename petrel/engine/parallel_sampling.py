"""New sequences and parallel sampling (n > 1 without beams).

A request's first sequence is made at admission; when its prompt is done, a request with n > 1 forks it into n
sequences that share the prompt's KV blocks and sample from one row of logits. Every sequence gets its own sampling
state: a generator when the request is seeded (one per output index), a grammar matcher when it is guided.
"""

from __future__ import annotations

import torch

from petrel.engine.grammar import GrammarCompiler
from petrel.engine.sequence import EngineRequest, Sequence


def new_sequence(req: EngineRequest, index: int, token_ids: list[int], num_prompt_tokens: int) -> Sequence:
    """Sequence `index` of `req`, with its own sampling state."""
    seq = Sequence(req, index, token_ids, num_prompt_tokens)
    seed = seq.params.seed
    if seed is not None:
        seq.generator = torch.Generator().manual_seed(hash((seed, index)) & 0x7FFF_FFFF_FFFF_FFFF)
    if req.compiled_grammar is not None:
        seq.grammar = GrammarCompiler.matcher(req.compiled_grammar)
    return seq


def fork_parallel_samples(sample_seqs: list[Sequence], scheduler, block_manager) -> tuple[list[Sequence], list[int]]:
    """The sequences to sample and the logits row of each: a request with n > 1 whose prompt just finished forks
    its sequence into n (running right after it, sharing its blocks); all n sample from the prompt's row."""
    seqs, rows = [], []
    for row, seq in enumerate(sample_seqs):
        seqs.append(seq)
        rows.append(row)
        req = seq.request
        if req.params.n == 1 or req.params.use_beam_search or len(req.seqs) > 1 or seq.num_output_tokens:
            continue
        prev = seq
        for i in range(1, req.params.n):
            child = new_sequence(req, i, seq.token_ids, seq.num_prompt_tokens)
            block_manager.fork(seq, child)
            scheduler.add_running(child, after=prev)
            req.seqs.append(child)
            seqs.append(child)
            rows.append(row)
            prev = child
    return seqs, rows
