"""Speculative decoding end to end on the default model: each method's greedy tokens equal plain decoding's
for a batch of prompts; a draft model equal to the target has every draft accepted; guided decoding, stop
strings, logprobs, n > 1 and streaming work with drafts; acceptance shows in outputs and /metrics."""

from __future__ import annotations

import json

import pytest

from petrel import LLM, GuidedDecodingParams, SamplingParams
from petrel.model.loader import default_model_path

pytestmark = pytest.mark.e2e

TEXT = (
    "Petrels are seabirds that spend most of their lives over the open ocean. They feed on fish, squid and "
    "krill, and come to land only to breed, often on remote islands."
)
QUESTIONS = [
    f"Repeat this text exactly: {TEXT}",
    f"Rewrite this text in the past tense: {TEXT}",
    "Write a short poem about the sea.",
    "What is 17 times 23?",
    "List three colors and one fact about each.",
    "Explain what a binary search does, step by step.",
    "Hi!",
    "Write a Python function that reverses a string, then explain it.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "self": {"method": "self", "num_speculative_tokens": 2, "draft_num_layers": 20},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3, "draft_model": default_model_path()},
    "lookahead": {"method": "lookahead", "max_window_size": 4, "max_ngram_size": 4, "max_verification_set_size": 4},
}


@pytest.fixture(scope="module")
def prompts(llm):
    return [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def plain(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module", params=list(METHODS))
def spec_llm(request):
    engine = LLM(speculative_config=METHODS[request.param])
    yield request.param, engine
    engine.shutdown()


def _draft_totals(llm) -> tuple[int, int]:
    return llm.engine.call(lambda core: (core.num_draft_tokens, core.num_accepted_tokens))


def test_greedy_batch_equals_plain_decoding(spec_llm, prompts, plain):
    method, llm = spec_llm
    before = _draft_totals(llm)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == plain
    drafted, accepted = (a - b for a, b in zip(_draft_totals(llm), before))
    assert drafted > 0
    if method == "draft_model":  # the draft is the target itself
        assert accepted == drafted
    if method == "ngram":  # the repeat and rewrite prompts copy their text
        assert accepted > 0.3 * drafted
    if method == "lookahead":  # a tree of candidates and window rows: most nodes are alternatives, some are right
        assert accepted > 0
    rounds = [o.outputs[0].spec_verify_ct for o in outputs]
    assert all(r is not None for r in rounds) and sum(rounds) > 0
    assert all(o.outputs[0].accept_draft_tokens is not None for o in outputs)


# a chain of drafts and a tree (lookahead) for the feature mix; the tiny-model tests cover every method
@pytest.mark.parametrize("spec_llm", ["ngram", "lookahead"], indirect=True)
def test_guided_json_stop_strings_logprobs_and_n_with_drafts(llm, spec_llm, prompts):
    _, sllm = spec_llm
    schema = {
        "type": "object",
        "properties": {
            # bounded strings: greedy, the 135M model can repeat inside a string until max_tokens
            "name": {"type": "string", "maxLength": 20},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        },
        "required": ["name", "tags"],
    }
    cases = [
        SamplingParams(temperature=0.0, max_tokens=60, guided_decoding=GuidedDecodingParams(json=schema)),
        SamplingParams(temperature=0.0, max_tokens=60, stop=["ocean", "\n"]),
        SamplingParams(temperature=0.0, max_tokens=24, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, n=2, ignore_eos=True),
    ]
    for params in cases:
        want = llm.generate(prompts[:2], params, use_tqdm=False)
        got = sllm.generate(prompts[:2], params, use_tqdm=False)
        for w, g in zip(want, got):
            for wo, go in zip(w.outputs, g.outputs):
                assert go.token_ids == wo.token_ids and go.text == wo.text
                assert go.finish_reason == wo.finish_reason and go.stop_reason == wo.stop_reason
                if params.logprobs:
                    assert [list(d) for d in go.logprobs] == [list(d) for d in wo.logprobs]
                    for dw, dg in zip(wo.logprobs, go.logprobs):
                        for tok in dw:
                            assert dg[tok].logprob == pytest.approx(dw[tok].logprob, abs=1e-3)
                            assert dg[tok].rank == dw[tok].rank
        if params.guided_decoding is not None:
            json.loads(got[0].outputs[0].text)


@pytest.mark.parametrize("spec_llm", ["ngram"], indirect=True)  # streaming is method-independent
def test_streamed_diffs_concatenate_with_several_tokens_per_step(spec_llm, prompts, plain):
    _, llm = spec_llm
    text, ids, steps = "", [], 0
    for partial in llm.generate_async(prompts[0], GREEDY, streaming=True):
        text += partial.outputs[0].text_diff
        ids += partial.outputs[0].token_ids_diff
        steps += 1
    assert ids == plain[0]
    assert text == llm.tokenizer.decode(plain[0], skip_special_tokens=True)
    assert steps < len(ids)  # drafts were accepted: some steps streamed more than one token
