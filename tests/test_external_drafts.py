"""Per-request external draft tokens (TensorRT-LLM's ExternalDraftTokensConfig): petrel verifies a request's
SamplingParams.external_draft_tokens like its own drafts, with or without an engine-level speculative_config.
Greedy tokens equal a plain run's whatever the drafts; right drafts save engine steps."""

from __future__ import annotations

import pytest
from test_speculative import drain, make_core, run, tokens_of
from tiny_llama import _tokens

from petrel.engine.sequence import EngineRequest
from petrel.sampling_params import SamplingParams

MAX_TOKENS = 16


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def plain(tiny):
    """The plain greedy run's tokens of two prompts."""
    t = tiny(2, False)
    outs, _ = run(make_core(t, tiny, None), [("a", _tokens(7, 301), greedy()), ("b", _tokens(12, 302), greedy())])
    return {rid: tokens_of(outs[(rid, 0)]) for rid in ("a", "b")}


def draft_cases(expected: list[int]) -> dict[str, list[int]]:
    wrong = [(t + 1) % 50 + 3 for t in expected]
    return {
        "right": list(expected),
        "wrong": expected[:1] + wrong[1:],  # the first token (sampled at prefill) right: the rest are verified
        "all wrong": wrong,
        "partly right": expected[:6] + wrong[6:],
        "longer than max_tokens": expected + [5, 6, 7],
        "short": expected[:3],
    }


@pytest.mark.parametrize("method", [None, "ngram", "self"])
@pytest.mark.parametrize("case", ["right", "wrong", "all wrong", "partly right", "longer than max_tokens", "short"])
def test_greedy_output_equals_the_plain_run_whatever_the_drafts(tiny, plain, method, case):
    t = tiny(2, False)
    reqs = [
        ("a", _tokens(7, 301), greedy(external_draft_tokens=draft_cases(plain["a"])[case])),
        ("b", _tokens(12, 302), greedy()),  # a plain neighbour in the same batches
    ]
    outs, stats = run(make_core(t, tiny, method), reqs)
    assert tokens_of(outs[("a", 0)]) == plain["a"]
    assert tokens_of(outs[("b", 0)]) == plain["b"]
    assert outs[("a", 0)][-1].finish_reason == "length"
    verified = sum(s.num_draft_tokens for s in stats)
    accepted = sum(s.num_accepted_tokens for s in stats)
    if method is None:
        assert (verified > 0) == (case != "all wrong"), "external drafts verified: only while the output follows them"
        if case == "wrong":
            assert accepted == 0
        elif case == "right":
            assert accepted == MAX_TOKENS - 2  # the first token (prefill) and each round's own token are sampled


def test_a_drafted_sequence_reports_its_tokens_logprobs(tiny, plain):
    """Alone in its batch, a sequence verifying drafts is sampled from its first row only: each token's logprob is
    the plain run's (its neighbouring rows, the drafts' positions, once gave it the next token's id instead)."""
    t = tiny(2, False)

    def logprobs(params) -> list[float]:
        outs, _ = run(make_core(t, tiny, None), [("a", _tokens(7, 301), params)])
        return [lp for out in outs[("a", 0)] for lp in out.sampled_logprobs or []]

    alone = logprobs(greedy())
    assert logprobs(greedy(external_draft_tokens=plain["a"])) == pytest.approx(alone, abs=1e-4)


def count_steps(core, prompt, params) -> tuple[list[int], int]:
    core.add_request(EngineRequest("x", prompt, params, eos_token_ids=(2,)))
    outs, stats = drain(core)
    return tokens_of(outs[("x", 0)]), len(stats)


@pytest.mark.parametrize("method", [None, "ngram"])
def test_right_drafts_take_fewer_engine_steps(tiny, plain, method):
    t = tiny(2, False)
    prompt = _tokens(7, 301)
    tokens, plain_steps = count_steps(make_core(t, tiny, None), prompt, greedy())
    assert plain_steps == MAX_TOKENS  # one prefill step, then one step per token
    spec_tokens, steps = count_steps(make_core(t, tiny, method), prompt, greedy(external_draft_tokens=plain["a"]))
    assert spec_tokens == tokens
    assert steps == 2  # the prefill samples token 1, one verify round accepts the other 15 drafts
    wrong = [(t + 1) % 50 + 3 for t in plain["a"]]
    _, wrong_steps = count_steps(make_core(t, tiny, None), prompt, greedy(external_draft_tokens=wrong))
    assert wrong_steps == plain_steps


def test_sampled_request_verifies_its_drafts_with_the_acceptance_rule(tiny, plain):
    """A sampled row takes the sampler's acceptance rule (accept draft d with probability p(d)): at a low
    temperature the greedy continuation is nearly certain, so its drafts are accepted."""
    t = tiny(2, False)
    params = SamplingParams(temperature=0.01, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert not params.greedy
    params.external_draft_tokens = plain["a"]
    outs, stats = run(make_core(t, tiny, None), [("s", _tokens(7, 301), params)])
    tokens = tokens_of(outs[("s", 0)])
    assert len(tokens) == MAX_TOKENS and all(0 <= x < t.cfg.vocab_size for x in tokens)
    assert sum(s.num_accepted_tokens for s in stats) > 0
    assert len(stats) < MAX_TOKENS


@pytest.mark.parametrize(
    "kw",
    [
        dict(external_draft_tokens=[1, -2]),
        dict(external_draft_tokens=[1, "x"]),
        dict(external_draft_tokens=[3], use_beam_search=True, beam_width=2, max_tokens=4),
    ],
)
def test_bad_external_drafts_are_a_value_error_naming_the_field(kw):
    with pytest.raises(ValueError, match="external_draft_tokens"):
        SamplingParams(**kw)


def test_drafts_outside_the_vocabulary_are_refused_by_the_engine(tiny):
    t = tiny(2, False)
    core = make_core(t, tiny, None)
    with pytest.raises(ValueError, match="external_draft_tokens"):
        core.validate([5, 6], greedy(external_draft_tokens=[4, t.cfg.vocab_size]))


def test_long_drafts_are_verified_a_bounded_number_per_step(tiny):
    from petrel.engine.speculative import MAX_EXTERNAL_DRAFTS

    t = tiny(2, False)
    n = MAX_EXTERNAL_DRAFTS + 10
    prompt = _tokens(7, 303)
    plain_params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    plain_tokens, _ = count_steps(make_core(t, tiny, None), prompt, plain_params)
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, external_draft_tokens=plain_tokens)
    core = make_core(t, tiny, None)
    core.add_request(EngineRequest("x", prompt, params, eos_token_ids=(2,)))
    outs, stats = drain(core)
    assert tokens_of(outs[("x", 0)]) == plain_tokens
    assert [s.num_draft_tokens for s in stats] == [
        0,
        MAX_EXTERNAL_DRAFTS,
        n - 3 - MAX_EXTERNAL_DRAFTS,
    ]  # each round samples one token more
