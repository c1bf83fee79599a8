"""The sampler reads the logits' device once per step on the common path (greedy, temperature, top-k / top-p /
min-p, penalties, bias, min_tokens; no logprobs): each read from a GPU waits for every kernel queued before it.
Counted on CPU by wrapping every Tensor method that hands a value to the host."""

from __future__ import annotations

import torch
from test_sampler import make_seq

from petrel.engine.sampler import Sampler
from petrel.sampling_params import SamplingParams

HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


def test_a_step_without_logprobs_reads_the_device_once(monkeypatch):
    vocab = 64
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.8, top_k=5, logit_bias={3: 2.0}),
        SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05, presence_penalty=0.5),
        SamplingParams(temperature=0.7, min_tokens=4, frequency_penalty=0.2),
    ]
    seqs = [make_seq(p, [5, 6, 7], output=[8, 9]) for p in params]
    logits = torch.randn(len(seqs), vocab, generator=torch.Generator().manual_seed(0))
    reads = []
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, _f=original, _n=name, **k: reads.append(_n) or _f(self, *a, **k)
        )
    result = Sampler(vocab).sample(logits.clone(), seqs)
    monkeypatch.undo()
    assert reads == ["tolist"]

    penalised = logits[0].double().clone()
    seen = torch.tensor([5, 6, 7, 8, 9])
    penalised[seen] = torch.where(penalised[seen] > 0, penalised[seen] / 1.3, penalised[seen] * 1.3)
    assert result.token_ids[0] == int(penalised.argmax())
    assert abs(result.sampled_logprobs[0] - float(penalised.log_softmax(0)[result.token_ids[0]])) < 1e-5
    assert all(0 <= t < vocab for t in result.token_ids) and all(lp <= 0 for lp in result.sampled_logprobs)
