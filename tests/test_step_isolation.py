"""One request cannot fail the others in its engine step: sampling parameters are checked against the model,
and whatever still raises while one request's part of a step is computed (sampling, stop checks, prompt
logprobs) ends that request alone. Tiny random Llama, EngineCore driven directly."""

from __future__ import annotations

import math
import random

import pytest
from test_request_controls import drain, greedy, make_core, tokens_of
from tiny_llama import VOCAB, _tokens

from petrel.engine.sequence import EngineRequest
from petrel.sampling_params import SamplingParams


def add(core, request_id, prompt, params) -> None:
    core.validate(prompt, params)
    core.add_request(EngineRequest(request_id, prompt, params, eos_token_ids=(2,)))


@pytest.mark.parametrize("top_k", [VOCAB + 1, 2**63, 2**70])
def test_top_k_past_the_vocabulary_is_refused_naming_it(tiny, top_k):
    core = make_core(tiny(2, False))
    with pytest.raises(ValueError, match="top_k must be <= the vocabulary size"):
        core.validate(_tokens(4, 1), SamplingParams(top_k=top_k))
    core.validate(_tokens(4, 1), SamplingParams(top_k=VOCAB))  # every token: allowed


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": math.nan},
        {"temperature": math.inf},
        {"top_p": math.nan},
        {"min_p": math.nan},
        {"repetition_penalty": math.inf},
        {"presence_penalty": math.nan},
        {"frequency_penalty": -math.inf},
        {"n": True},
        {"max_tokens": True},
        {"top_k": False},
        {"logit_bias": {3: math.nan}},
        {"logit_bias": {True: 1.0}},
    ],
)
def test_non_finite_numbers_and_bools_are_refused(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_a_vanishing_temperature_is_greedy(tiny):
    """temperature 1e-45 divided the logits into inf/nan and the draw picked token 0: it must be greedy."""
    t = tiny(2, False)
    prompt = _tokens(7, 5)
    expected = greedy(t, prompt, max_tokens=6)
    for temperature in (1e-45, 1e-30, 1e-6):
        core = make_core(t)
        add(core, "r", prompt, SamplingParams(temperature=temperature, max_tokens=6))
        assert tokens_of(drain(core)[("r", 0)]) == expected, temperature


def _sabotaged(**changes) -> SamplingParams:
    """Parameters that passed validation, then changed: what a missed check would let through."""
    params = SamplingParams(temperature=0.8, max_tokens=6, seed=3)
    for name, value in changes.items():
        setattr(params, name, value)
    return params


@pytest.mark.parametrize(
    "sabotage,why",
    [
        ({"top_k": VOCAB + 1}, "sampling failed"),  # torch.topk: selected index k out of range
        ({"logit_bias": {VOCAB + 5: 1.0}}, "sampling failed"),  # an index past the vocabulary
        ({"stop_token_sequences": [None]}, "engine error in this request"),  # the stop check raises
        ({"prompt_logprobs": VOCAB + 1}, "engine error in this request"),  # prompt logprobs: topk past the vocab
    ],
)
def test_a_request_that_raises_in_the_step_fails_alone(tiny, sabotage, why):
    t = tiny(2, False)
    prompts = [_tokens(6, 40), _tokens(9, 41), _tokens(5, 42)]
    alone = greedy(t, prompts[1], max_tokens=6)
    seeded = SamplingParams(temperature=0.9, max_tokens=6, seed=11)
    core = make_core(t)
    core.add_request(EngineRequest("random", prompts[2], seeded))
    random_alone = tokens_of(drain(core)[("random", 0)])

    core = make_core(t)
    core.add_request(EngineRequest("bad", prompts[0], _sabotaged(**sabotage)))
    core.add_request(EngineRequest("good", prompts[1], SamplingParams(temperature=0.0, max_tokens=6)))
    core.add_request(EngineRequest("random", prompts[2], SamplingParams(temperature=0.9, max_tokens=6, seed=11)))
    outs = drain(core)  # drain also checks that every KV block came back
    bad = outs[("bad", 0)]
    assert bad[-1].finish_reason == "abort" and why in bad[-1].abort_message, bad[-1].abort_message
    assert tokens_of(outs[("good", 0)]) == alone and outs[("good", 0)][-1].finish_reason == "length"
    assert tokens_of(outs[("random", 0)]) == random_alone  # a seeded row draws the same in any batch
    assert not core.requests


# ----------------------------------------------------------------------------------------- the fuzz test

# each field: (values a client may well send, extremes that are absurd or invalid)
FIELDS = {
    "temperature": ([0.0, 1e-45, 1e-6, 0.7, 1.0, 2.0], [1e4, 1e30, math.nan, math.inf, -1.0]),
    "top_k": ([0, -1, 1, 5, VOCAB - 1, VOCAB], [VOCAB + 1, 2**31, 2**63, 2**70, -5]),
    "top_p": ([1e-45, 1e-9, 0.5, 1.0], [0.0, math.nan, 1.5]),
    "min_p": ([0.0, 1e-45, 0.5, 1.0], [math.nan, -0.1]),
    "repetition_penalty": ([1e-45, 0.5, 1.0, 2.0, 1e30], [0.0, math.nan]),
    "presence_penalty": ([-2.0, 0.0, 2.0], [3.0, math.nan]),
    "frequency_penalty": ([-2.0, 0.0, 2.0], [-3.0, math.inf]),
    "seed": ([None, 0, 2**63, 2**70, -1], []),
    "logprobs": ([None, 0, 5, VOCAB], [VOCAB + 1]),
    "prompt_logprobs": ([None, 0, 3, VOCAB], [VOCAB + 1]),
    "n": ([1, 2, 3], [0]),
    "min_tokens": ([0, 1, 3], [-1, 100]),
    "max_tokens": ([1, 4, 8], [0]),
    "stop_token_ids": ([None, [2], [5, 9]], [[VOCAB + 3]]),
    "bad_words_token_ids": ([None, [[7]], [[7, 8]]], [[[VOCAB + 3]]]),
    "logit_bias": ([None, {7: 100.0}, {7: -100.0}, {9: 3.5}], [{VOCAB + 7: 1.0}, {7: 1e30}]),
    "ignore_eos": ([False, True], []),
}
SABOTAGE = [
    ("top_k", VOCAB + 1),
    ("top_k", 2**63),
    ("temperature", math.nan),
    ("top_p", math.nan),
    ("logit_bias", {VOCAB + 2: 1.0}),
    ("stop_token_sequences", [None]),
    ("min_p", math.inf),
    ("prompt_logprobs", VOCAB + 9),
    ("logprobs", VOCAB + 9),
]


def _random_params(rng: random.Random) -> dict:
    kwargs = {}
    for name, (usual, extreme) in FIELDS.items():
        if rng.random() < 0.5:
            kwargs[name] = rng.choice(extreme if extreme and rng.random() < 0.08 else usual)
    if rng.random() < 0.15:
        kwargs.update(
            use_beam_search=True, beam_width=rng.choice([2, 3]), n=1, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0
        )
    return kwargs


def test_fuzz_random_sampling_params_never_fail_a_victim(tiny):
    """Rounds of a greedy and a seeded victim beside random (often absurd, sometimes sabotaged) requests: every
    hostile request is refused at submission or ends (normally or with its own error), and the victims always
    finish with the tokens they get alone, with every KV block back."""
    t = tiny(2, False)
    rng = random.Random(20)
    victims = {
        "greedy": (_tokens(8, 70), SamplingParams(temperature=0.0, max_tokens=8)),
        "seeded": (_tokens(6, 71), SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=5)),
    }
    expected = {}
    for name, (prompt, params) in victims.items():
        core = make_core(t)
        core.add_request(EngineRequest(name, prompt, params))
        expected[name] = tokens_of(drain(core)[(name, 0)])
    refused = admitted = sabotaged = failed = 0
    for round_ in range(30):
        core = make_core(t)
        for name, (prompt, params) in victims.items():
            core.add_request(EngineRequest(name, prompt, params))
        hostile = []
        for j in range(rng.randint(2, 5)):
            prompt = _tokens(rng.randint(1, 12), 100 * round_ + j)
            try:
                params = SamplingParams(**_random_params(rng))
                core.validate(prompt, params)
            except ValueError:
                refused += 1
                continue
            if rng.random() < 0.2:
                name, value = rng.choice(SABOTAGE)
                setattr(params, name, value)
                sabotaged += 1
            request_id = f"h{round_}.{j}"
            core.add_request(EngineRequest(request_id, prompt, params, eos_token_ids=(2,)))
            hostile.append((request_id, params))
            admitted += 1
        outs = drain(core)  # asserts every block is back
        for name in victims:
            assert tokens_of(outs[(name, 0)]) == expected[name], (round_, name)
            assert outs[(name, 0)][-1].finish_reason == "length"
        for request_id, params in hostile:
            ends = [outs[key][-1] for key in outs if key[0] == request_id]
            assert len(ends) == params.n and all(o.finish_reason is not None for o in ends), request_id
            failed += any(o.finish_reason == "abort" for o in ends)
        assert not core.requests
    assert refused and admitted and sabotaged and failed  # the fuzz reached every kind of request
