"""External drafts with the logits they were drawn from (TensorRT-LLM's ExternalDraftTokensConfig.logits): a sampled
row verifies them by speculative sampling and keeps the target's distribution; acceptance_threshold makes the
acceptance the constant test p / q >= t; greedy rows ignore the logits; bad logits and thresholds are refused by
name."""

from __future__ import annotations

import pytest
import torch
from test_speculative import _chi_square_p_value, make_core, run, tokens_of
from tiny_llama import _tokens

from petrel.engine.draft_acceptance import DraftWithProbs
from petrel.engine.sampler import Sampler
from petrel.engine.sequence import EngineRequest, Sequence
from petrel.sampling_params import SamplingParams

V = 12


def rows_of(n: int, params: SamplingParams) -> list[Sequence]:
    return [Sequence(EngineRequest(f"s{i}", [1], params), 0, [1], 1) for i in range(n)]


@pytest.mark.parametrize("top_k", [0, 5])
def test_speculative_sampling_rule_keeps_the_target_distribution(top_k):
    """Sampler rows verifying drafts d ~ q with q given: the token drawn is distributed as the target p, for a q
    close to p and one far from it (most drafts rejected: the max(0, p - q) residual path)."""
    torch.manual_seed(0)
    logits = torch.randn(V) * 1.5
    target = logits.clone()
    if top_k:
        target[target < target.topk(top_k).values[-1]] = float("-inf")
    probs = torch.softmax(target.double(), dim=0)
    n = 6000
    for q_logits in (logits + 0.3 * torch.randn(V), -logits):
        q = torch.softmax(q_logits, dim=0)
        drafts_drawn = torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(1))
        drafts = [DraftWithProbs(int(d), q) for d in drafts_drawn]
        result = Sampler(V, seed=7).sample(logits.repeat(n, 1), rows_of(n, SamplingParams(top_k=top_k)), drafts)
        tokens = torch.tensor(result.token_ids)
        counts = torch.bincount(tokens, minlength=V).double()
        assert _chi_square_p_value(counts, probs) > 1e-3, (counts.tolist(), (probs * n).tolist())
        assert counts[probs == 0].sum() == 0
        kept = (tokens == drafts_drawn).float().mean().item()
        expected = torch.minimum(q.double(), probs).sum().item()  # P(accept) = sum_d min(q(d), p(d))
        assert kept == pytest.approx(expected, abs=0.05)


def test_acceptance_threshold_is_the_constant_test_p_over_q():
    """With a threshold t a draft is kept exactly when p(d) / q(d) >= t; a rejected one is replaced from the
    normalised max(0, p - q), so never by itself."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0] + [-9.0] * (V - 4))
    p = torch.softmax(logits, dim=0)
    q = torch.softmax(torch.tensor([0.0, 2.0, 0.5, -1.0] + [-9.0] * (V - 4)), dim=0)
    ratios = p / q
    for t in (0.3, 0.6, 1.0):
        for d in range(4):
            n = 50
            drafts = [DraftWithProbs(d, q, threshold=t)] * n
            tokens = Sampler(V, seed=d).sample(logits.repeat(n, 1), rows_of(n, SamplingParams()), drafts).token_ids
            if ratios[d] >= t:
                assert tokens == [d] * n, (t, d)
            else:
                assert d not in tokens and all(p[x] > q[x] for x in tokens), (t, d)


def _top_probs(t, ids, k: int) -> torch.Tensor:
    logits = t.hf_logits(ids)[-1].double()
    logits[logits < logits.topk(k).values[-1]] = float("-inf")
    return torch.softmax(logits, dim=0)


def test_sampled_requests_with_draft_logits_keep_the_target_distribution_end_to_end(tiny):
    """Seeded sampled requests whose second token is an external draft drawn from a q unlike the target (given as
    its logits): every second token is verified, many are rejected, and their frequencies match the exact
    marginal sum p(t1) p(t2 | t1) from transformers."""
    t = tiny(2, False)
    prompt = _tokens(6, 410)
    k, n = 4, 1200
    params = dict(temperature=1.0, top_k=k, max_tokens=3, ignore_eos=True)
    plain, _ = run(
        make_core(t, tiny, None, num_blocks=2048), [(i, prompt, SamplingParams(seed=i, **params)) for i in range(n)]
    )
    firsts = [tokens_of(plain[(i, 0)])[0] for i in range(n)]  # the first token of each seed (sampled at prefill)
    g = torch.Generator().manual_seed(3)
    q_logits = {}  # per first token: a draft model's logits: the target's, noisy
    for a in set(firsts):
        q_logits[a] = t.hf_logits(prompt + [a])[-1] + torch.randn(t.cfg.vocab_size, generator=g)
    reqs = []
    for i, a in enumerate(firsts):
        d = int(torch.multinomial(torch.softmax(q_logits[a], dim=0), 1, generator=g))  # the draft, drawn from q
        logits = torch.stack([torch.zeros(t.cfg.vocab_size), q_logits[a]])  # row 0: the first token's (unverified)
        sp = SamplingParams(seed=i, external_draft_tokens=[a, d], external_draft_logits=logits, **params)
        reqs.append((i, prompt, sp))
    outs, stats = run(make_core(t, tiny, None, num_blocks=2048), reqs)
    assert sum(s.num_draft_tokens for s in stats) == n
    accepted = sum(s.num_accepted_tokens for s in stats)
    assert 0.1 * n < accepted < 0.9 * n  # both ways: drafts kept, and drafts replaced from max(0, p - q)
    first = _top_probs(t, prompt, k)
    marginal = sum(first[a] * _top_probs(t, prompt + [a], k) for a in first.nonzero().flatten().tolist())
    counts = torch.bincount(torch.tensor([tokens_of(outs[(i, 0)])[1] for i in range(n)]), minlength=t.cfg.vocab_size)
    assert counts[marginal == 0].sum() == 0
    assert _chi_square_p_value(counts.double(), marginal) > 1e-3


def test_threshold_end_to_end_and_greedy_ignores_the_logits(tiny):
    """A draft whose p / q clears the threshold is always kept, one that does not never is; a greedy request's
    tokens are plain decoding's whatever the logits say."""
    t = tiny(2, False)
    prompt = _tokens(6, 411)
    greedy = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = tokens_of(run(make_core(t, tiny, None), [("g", prompt, SamplingParams(**greedy))])[0][("g", 0)])
    wrong = [(x + 1) % t.cfg.vocab_size for x in expected]
    for drafts in (expected, expected[:1] + wrong[1:]):
        sp = SamplingParams(
            external_draft_tokens=drafts, external_draft_logits=torch.zeros(8, t.cfg.vocab_size), **greedy
        )
        assert tokens_of(run(make_core(t, tiny, None), [("g", prompt, sp)])[0][("g", 0)]) == expected
    sampled = dict(temperature=1.0, max_tokens=3, ignore_eos=True)
    a = tokens_of(run(make_core(t, tiny, None), [("a", prompt, SamplingParams(seed=5, **sampled))])[0][("a", 0)])[0]
    p = torch.softmax(t.hf_logits(prompt + [a])[-1].double(), dim=0)
    d = int(p.argsort()[len(p) // 2])  # a middling token: p(d) well below 1
    for q_of_d, kept in ((p[d].item() / 0.9, True), (p[d].item() / 0.1, False)):  # p / q = 0.9 or 0.1, t = 0.5
        q_logits = torch.full((t.cfg.vocab_size,), -1e4)
        q_logits[d] = 0.0
        q_logits[(d + 1) % len(p)] = torch.log(torch.tensor(1 / q_of_d - 1))
        logits = torch.stack([torch.zeros(t.cfg.vocab_size), q_logits])
        reqs = [
            (
                seed,
                prompt,
                SamplingParams(
                    seed=seed,
                    external_draft_tokens=[a, d],
                    external_draft_logits=logits,
                    external_draft_acceptance_threshold=0.5,
                    **sampled,
                ),
            )
            for seed in range(5, 25)
        ]
        outs, _ = run(make_core(t, tiny, None), reqs)
        seconds = [tokens_of(outs[(s, 0)])[1] for s in range(5, 25) if tokens_of(outs[(s, 0)])[0] == a]
        assert seconds and all((x == d) == kept for x in seconds), (kept, seconds)


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(external_draft_logits=torch.zeros(2, V)), "external_draft_logits"),  # no tokens
        (dict(external_draft_tokens=[1, 2], external_draft_logits=torch.zeros(3, V)), "external_draft_logits"),
        (dict(external_draft_tokens=[1, 2], external_draft_logits=torch.zeros(2, V, 1)), "external_draft_logits"),
        (
            dict(external_draft_tokens=[1], external_draft_logits=torch.zeros(1, V, dtype=torch.long)),
            "external_draft_logits",
        ),
        (
            dict(external_draft_tokens=[1], external_draft_logits=torch.full((1, V), float("nan"))),
            "external_draft_logits",
        ),
        (
            dict(external_draft_tokens=[1], external_draft_logits=torch.full((1, V), float("inf"))),
            "external_draft_logits",
        ),
        (
            dict(external_draft_tokens=[1], external_draft_logits=torch.full((1, V), float("-inf"))),
            "external_draft_logits",
        ),
        (
            dict(external_draft_tokens=[1], external_draft_acceptance_threshold=0.5),
            "external_draft_acceptance_threshold",
        ),
        (
            dict(
                external_draft_tokens=[1],
                external_draft_logits=torch.zeros(1, V),
                external_draft_acceptance_threshold=0,
            ),
            "external_draft_acceptance_threshold",
        ),
        (
            dict(
                external_draft_tokens=[1],
                external_draft_logits=torch.zeros(1, V),
                external_draft_acceptance_threshold=1.5,
            ),
            "external_draft_acceptance_threshold",
        ),
    ],
)
def test_bad_draft_logits_and_thresholds_are_a_value_error_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_logits_of_another_vocabulary_are_refused_by_the_engine(tiny):
    t = tiny(2, False)
    params = SamplingParams(external_draft_tokens=[3], external_draft_logits=torch.zeros(1, t.cfg.vocab_size + 1))
    with pytest.raises(ValueError, match="external_draft_logits"):
        make_core(t, tiny, None).validate([5, 6], params)
