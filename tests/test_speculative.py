"""Speculative decoding on the tiny random Llama: every method's greedy tokens (and logprobs) equal plain
decoding's, in batches mixed with plain requests, under preemption, with stop words and max_tokens; a draft
model equal to the target has every draft accepted; sampled tokens keep the target's distribution."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_llama import _tokens

from petrel.config import EngineConfig, SpeculativeConfig
from petrel.engine.engine_core import EngineCore
from petrel.engine.model_runner import kv_bytes_per_block
from petrel.engine.sampler import Sampler
from petrel.engine.sequence import EngineRequest, Sequence
from petrel.engine.speculative import NgramProposer
from petrel.sampling_params import SamplingParams

METHODS = ["ngram", "self", "draft-same", "draft-other"]


def make_core(t, tiny, method: str | None, num_blocks: int = 512, k: int = 3) -> EngineCore:
    spec, draft = None, None
    if method == "ngram":
        spec = SpeculativeConfig("ngram", k, prompt_lookup_min=1, prompt_lookup_max=3)
    elif method == "self":
        spec = SpeculativeConfig("self", k, draft_num_layers=1)
    elif method == "draft-same":
        spec, draft = SpeculativeConfig("draft_model", k, draft_model=t.path), (t.model, t.cfg)
    elif method == "draft-other":
        spec, draft = SpeculativeConfig("draft_model", k, draft_model=t.path), (perturbed(t.model), t.cfg)
    config = EngineConfig(
        block_size=4, kv_cache_memory=num_blocks * kv_bytes_per_block(t.cfg, 4, torch.float32), speculative_config=spec
    )
    return EngineCore(config, t.model, t.cfg, draft_model=draft)


def perturbed(model: torch.nn.Module, scale: float = 0.15) -> torch.nn.Module:
    """A copy of the model with noise on every weight: a draft that agrees with the target often, not always."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=g))
    return draft


def drain(core: EngineCore) -> tuple[dict, list]:
    """({(request_id, index): [EngineOutput, ...]}, [IterationStats]) until idle; all blocks come back."""
    outs, stats = {}, []
    while core.has_work:
        for out in core.step():
            outs.setdefault((out.request_id, out.index), []).append(out)
        stats.append(core.last_stats)
    core.block_manager.check_integrity()
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    return outs, stats


def tokens_of(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def run(core, requests) -> tuple[dict, list]:
    for rid, prompt, params in requests:
        core.add_request(EngineRequest(rid, prompt, params, eos_token_ids=(2,)))
    return drain(core)


def repetitive(n: int, seed: int) -> list[int]:
    """A prompt that repeats a short random phrase, so prompt lookup finds n-grams to continue."""
    phrase = _tokens(5, seed)
    return (phrase * (n // 5 + 1))[:n]


def batch_requests():
    reqs = []
    for i, (n, max_tokens) in enumerate([(3, 20), (17, 9), (40, 25), (8, 1), (26, 14), (11, 30)]):
        prompt = repetitive(n, 100 + i) if i % 2 else _tokens(n, 100 + i)
        reqs.append(
            (f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2))
        )
    reqs.append(("n2", _tokens(9, 120), SamplingParams(temperature=0.0, max_tokens=12, n=2, ignore_eos=True)))
    reqs.append(("beam", _tokens(6, 121), SamplingParams(max_tokens=6, use_beam_search=True, beam_width=2, n=2)))
    return reqs


@pytest.fixture(scope="module")
def plain_outputs(tiny):
    t = tiny(2, False)
    outs, _ = run(make_core(t, tiny, None), batch_requests())
    return outs


@pytest.mark.parametrize("method", METHODS)
def test_greedy_tokens_and_logprobs_equal_plain_decoding(tiny, plain_outputs, method):
    t = tiny(2, False)
    outs, stats = run(make_core(t, tiny, method), batch_requests())
    assert outs.keys() == plain_outputs.keys()
    for key, expected in plain_outputs.items():
        got = outs[key]
        assert tokens_of(got) == tokens_of(expected), key
        assert got[-1].finish_reason == expected[-1].finish_reason
        lps = [lp for o in got for lp in (o.new_logprobs or [])]
        ref = [lp for o in expected for lp in (o.new_logprobs or [])]
        assert len(lps) == len(ref)
        for a, b in zip(lps, ref):
            assert a.token_id == b.token_id and a.rank == b.rank
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [i for i, _ in a.top] == [i for i, _ in b.top]
    drafted = sum(s.num_draft_tokens for s in stats)
    accepted = sum(s.num_accepted_tokens for s in stats)
    assert drafted > 0, "no draft was ever verified"
    if method == "draft-same":
        assert accepted == drafted  # the draft is the target: every draft is right
    if method == "draft-other":
        assert 0 < accepted < drafted  # both paths: accepted drafts and rolled-back ones
    # per-sequence stats on the final output
    final = outs[("r2", 0)][-1]
    assert final.spec_verify_ct is not None and final.spec_verify_ct > 0
    assert final.accept_draft_tokens is not None and 0 <= final.accept_draft_tokens <= 3


@pytest.mark.parametrize("method", ["ngram", "draft-other"])
def test_preemption_with_drafts_gives_the_same_tokens(tiny, method):
    t = tiny(2, False)
    reqs = [
        (f"p{i}", repetitive(10 + 3 * i, 200 + i), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        for i in range(6)
    ]
    plain, _ = run(make_core(t, tiny, None), reqs)
    core = make_core(t, tiny, method, num_blocks=30)
    outs, _ = run(core, reqs)
    assert core.scheduler.num_preemptions > 0
    for key in plain:
        assert tokens_of(outs[key]) == tokens_of(plain[key])


def test_max_tokens_stop_tokens_and_stop_words_cut_where_plain_decoding_does(tiny):
    t = tiny(2, False)
    prompt = repetitive(12, 300)
    free = tokens_of(
        run(make_core(t, tiny, None), [("f", prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))])[
            0
        ][("f", 0)]
    )
    for params in [
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[free[9]], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, stop=None, ignore_eos=True, stop_token_sequences=[free[4:6]]),
    ]:
        expected = tokens_of(run(make_core(t, tiny, None), [("e", prompt, params)])[0][("e", 0)])
        got = tokens_of(run(make_core(t, tiny, "draft-same", k=4), [("e", prompt, params)])[0][("e", 0)])
        assert got == expected
        assert len(got) < 30


def test_ngram_lookup_continues_the_latest_longest_match():
    p = NgramProposer(min_n=1, max_n=3)
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 5, 6, 9, 1, 5, 6]
    assert p.lookup(tokens, 2) == [9, 1]  # latest earlier "5 6" is at 4..5
    assert p.lookup(tokens + [9], 3) == [1, 5, 6]  # "5 6 9" (3-gram) wins over shorter ones
    assert p.lookup([1, 2, 3, 4], 3) == []  # no earlier occurrence of any suffix
    assert p.lookup([7], 3) == []
    assert NgramProposer(min_n=2, max_n=2).lookup([4, 1, 2, 4, 9, 4], 2) == []  # only 1-grams would match
    assert p.lookup([3, 3, 3, 3], 5) == [3]  # never past the end


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(method="medusa"), "method"),
        (dict(num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_min"),
        (dict(method="draft_model"), "draft_model"),
        (dict(method="self", draft_num_layers=0), "draft_num_layers"),
        (dict(nonsense=1), "nonsense"),
    ],
)
def test_bad_speculative_config_is_a_value_error_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(speculative_config=bad)


def test_self_speculation_needs_fewer_layers_than_the_model(tiny):
    t = tiny(2, False)
    config = EngineConfig(
        block_size=4,
        kv_cache_memory=64 * kv_bytes_per_block(t.cfg, 4, torch.float32),
        speculative_config={"method": "self", "draft_num_layers": t.cfg.num_hidden_layers},
    )
    with pytest.raises(ValueError, match="draft_num_layers"):
        EngineCore(config, t.model, t.cfg)


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of observed counts against expected probabilities; bins expecting < 5 are pooled."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat.double() / 2))


def test_verification_rule_keeps_the_target_distribution():
    """Sampler rows that verify a draft token: the token drawn is distributed as the target p, for a
    likely draft, an unlikely one and one outside top-k."""
    torch.manual_seed(0)
    logits = torch.randn(12) * 1.5
    for draft, top_k in [(int(logits.argmax()), 0), (int(logits.argmin()), 0), (int(logits.argmin()), 5)]:
        n = 6000
        params = SamplingParams(temperature=1.0, top_k=top_k)
        seqs = [Sequence(EngineRequest(f"s{i}", [1], params), 0, [1], 1) for i in range(n)]
        result = Sampler(12, seed=draft * 31 + top_k).sample(logits.repeat(n, 1), seqs, [draft] * n)
        counts = torch.bincount(torch.tensor(result.token_ids), minlength=12).double()
        target = logits.clone()
        if top_k:
            target[target < target.topk(top_k).values[-1]] = float("-inf")
        probs = torch.softmax(target.double(), dim=0)
        assert _chi_square_p_value(counts, probs) > 1e-3, (draft, top_k, counts.tolist(), (probs * n).tolist())
        if top_k:
            assert counts[probs == 0].sum() == 0


def test_sampled_outputs_keep_the_target_distribution_end_to_end(tiny):
    """Second output token of many seeded requests, with a draft model that disagrees with the target:
    its frequencies match the exact marginal sum_t1 p(t1) p(t2 | t1) computed from transformers."""
    t = tiny(2, False)
    prompt = _tokens(6, 400)
    params = dict(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True)
    core = make_core(t, tiny, "draft-other", num_blocks=2048)
    n = 1500
    outs, stats = run(core, [(i, prompt, SamplingParams(seed=i, **params)) for i in range(n)])
    assert sum(s.num_draft_tokens for s in stats) >= n  # the second token was verified every time
    second = torch.tensor([tokens_of(outs[(i, 0)])[1] for i in range(n)])

    def top4_probs(ids):
        logits = t.hf_logits(ids)[-1].double()
        logits[logits < logits.topk(4).values[-1]] = float("-inf")
        return torch.softmax(logits, dim=0)

    first = top4_probs(prompt)
    marginal = sum(first[a] * top4_probs(prompt + [a]) for a in first.nonzero().flatten().tolist())
    counts = torch.bincount(second, minlength=marginal.numel()).double()
    assert counts[marginal == 0].sum() == 0
    assert _chi_square_p_value(counts, marginal) > 1e-3
