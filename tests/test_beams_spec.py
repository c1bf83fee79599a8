"""Beams and cumulative_logprob as the specs give them, on the tiny random Llama: the Executor returns every beam
unless num_return_sequences limits them, a beam's generation logits / hidden states follow its own history
(transformers as the oracle), and the LLM API's cumulative_logprob is there for every sequence."""

from __future__ import annotations

import pytest
import torch
from test_beam_search import hf_beams
from tiny_llama import _tokens

from petrel import LLM, SamplingParams
from petrel.executor import AdditionalModelOutput, Executor, ExecutorConfig, OutputConfig, Request, SamplingConfig

PROMPT = _tokens(6, seed=1)  # its beams part after two tokens, so later beams are forks


@pytest.fixture(scope="module")
def executor(tiny, tokenizer_dir):
    ex = Executor(
        tiny(2, False).path,
        executor_config=ExecutorConfig(
            max_beam_width=4, additional_model_outputs=[AdditionalModelOutput("hidden_states")]
        ),
        tokenizer=tokenizer_dir,
        kv_cache_memory=1 << 20,
    )
    yield ex
    ex.shutdown()


@pytest.fixture(scope="module")
def llm(tiny, tokenizer_dir):
    engine = LLM(tiny(2, False).path, tokenizer=tokenizer_dir, kv_cache_memory=1 << 20)
    yield engine
    engine.shutdown()


def results(ex: Executor, request: Request) -> list:
    rid, out = ex.enqueue_request(request), []
    while not out or not out[-1].is_final:
        # a streamed request's steps queue up while this reader is slow: take every response waiting, in order
        responses = ex.await_responses(rid, timeout=60.0)
        assert responses, "no response within 60 s"
        for r in responses:
            assert not r.has_error(), r.error_msg
            out.append(r.result)
    return out


def beam_request(width: int, n: int | None = None, max_tokens: int = 6, **kw) -> Request:
    oc = kw.pop("output_config", OutputConfig(exclude_input_from_output=True))
    return Request(
        PROMPT, max_tokens, num_return_sequences=n, sampling_config=SamplingConfig(beam_width=width), output_config=oc
    )


def test_executor_returns_every_beam_unless_limited(executor, tiny):
    [res] = results(executor, beam_request(3))
    assert res.sequence_index == 0 and res.is_final
    beams, _ = hf_beams(tiny(2, False), PROMPT, 3, 3, 6, (), 1.0, False)
    assert res.output_token_ids == beams
    [res] = results(executor, beam_request(3, n=2))
    assert res.output_token_ids == beams[:2]


# after prompt seed 5, end id 218 ends a hypothesis at its third token while the others go on
@pytest.mark.parametrize("seed,end_id", [(1, None), (5, 218)], ids=["no-end", "ends-early"])
def test_beam_generation_logits_and_hidden_states_follow_each_beam(executor, tiny, seed, end_id):
    t = tiny(2, False)
    oc = OutputConfig(
        exclude_input_from_output=True,
        return_generation_logits=True,
        additional_model_outputs=[AdditionalModelOutput("hidden_states", gather_context=False)],
    )
    prompt = _tokens(6, seed=seed)
    request = beam_request(3, max_tokens=8, output_config=oc)
    request.input_token_ids, request.end_id = prompt, end_id
    [res] = results(executor, request)
    beams = res.output_token_ids
    assert len(beams) == 3 and len({tuple(b) for b in beams}) == 3
    longest = max(len(b) for b in beams)
    assert end_id is None or any(b[-1] == end_id and len(b) < 8 for b in beams)
    logits = res.generation_logits
    assert isinstance(logits, torch.Tensor) and logits.shape == (3, longest, t.cfg.vocab_size)
    [hidden] = [o.output for o in res.additional_outputs if o.name == "hidden_states" and not o.context]
    assert hidden.shape == (3, longest, t.cfg.hidden_size)
    P = len(prompt)
    for b, beam in enumerate(beams):
        k = len(beam)
        with torch.no_grad():
            ref = t.hf(torch.tensor([prompt + beam]), output_hidden_states=True)
        # row i: the distribution the beam's token i was chosen from, at its own prefix (a forked beam's early
        # rows are its parent's); rows past a beam that ended early are zero
        torch.testing.assert_close(logits[b, :k], ref.logits[0, P - 1 : P - 1 + k].float(), atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(
            hidden[b, :k], ref.hidden_states[-1][0, P - 1 : P - 1 + k].float(), atol=2e-4, rtol=1e-4
        )
        assert not logits[b, k:].any() and not hidden[b, k:].any()


def test_llm_beams_keep_n_hypotheses(llm, tiny):
    params = SamplingParams(use_beam_search=True, beam_width=3, n=2, max_tokens=6)
    out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False).outputs
    beams, _ = hf_beams(tiny(2, False), PROMPT, 3, 3, 6, (), 1.0, False)
    assert [o.token_ids for o in out] == beams[:2]
    assert out[0].cumulative_logprob >= out[1].cumulative_logprob


def _generate(llm, **kw):
    return llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=8, **kw), use_tqdm=False).outputs


@pytest.mark.parametrize(
    "kw", [dict(temperature=0.0), dict(temperature=0.8, n=3, seed=7), dict(temperature=1.3, top_k=20, seed=5)]
)
def test_cumulative_logprob_is_the_sum_of_token_logprobs(llm, kw):
    with_lp = _generate(llm, logprobs=1, **kw)
    without = _generate(llm, **kw)
    assert len(with_lp) == kw.get("n", 1)
    for a, b in zip(with_lp, without):
        assert a.token_ids == b.token_ids and b.logprobs is None
        total = sum(entry[tok].logprob for entry, tok in zip(a.logprobs, a.token_ids))
        assert a.cumulative_logprob == pytest.approx(total, abs=1e-4) and a.cumulative_logprob < 0
        assert b.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_cumulative_logprob_when_streamed(llm):
    [whole] = _generate(llm, temperature=0.0, logprobs=0)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    snapshots = list(llm.generate_async({"prompt_token_ids": PROMPT}, params, streaming=True))
    assert len(snapshots) > 1
    for snap in snapshots:  # each step: the sum over the tokens so far
        out = snap.outputs[0]
        k = len(out.token_ids)
        assert out.token_ids == whole.token_ids[:k]
        total = sum(entry[tok].logprob for entry, tok in zip(whole.logprobs[:k], whole.token_ids[:k]))
        assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_executor_streams_beams_step_by_step(executor):
    [final] = results(executor, beam_request(3, max_tokens=6))
    streamed = results(executor, Request(PROMPT, 6, streaming=True, sampling_config=SamplingConfig(beam_width=3)))
    assert len(streamed) == 6  # no end token: one per step, the last being the final beams
    for step, res in enumerate(streamed[:-1], start=1):
        assert not res.is_final and res.sequence_index == 0
        assert [len(b) for b in res.output_token_ids] == [step] * 3
    last = streamed[-1]
    assert last.is_final and last.output_token_ids == final.output_token_ids


def test_llm_streams_beams_step_by_step(llm):
    params = SamplingParams(use_beam_search=True, beam_width=3, n=2, max_tokens=6, logprobs=0)
    final = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
    snapshots = list(llm.generate_async({"prompt_token_ids": PROMPT}, params, streaming=True))
    assert len(snapshots) > 1 and snapshots[-1].finished
    lengths = [len(snap.outputs[0].token_ids) for snap in snapshots[:-1]]
    assert lengths == sorted(set(lengths)) and lengths[-1] <= 5  # a slow reader may skip steps, never repeat one
    for step, snap in zip(lengths, snapshots[:-1]):
        outs = snap.outputs
        assert not snap.finished and [len(o.token_ids) for o in outs] == [step, step]
        assert outs[0].cumulative_logprob >= outs[1].cumulative_logprob
        for o in outs:  # the whole beam so far, its logprobs its own
            assert o.token_ids_diff == o.token_ids and len(o.logprobs) == step
            total = sum(entry[tok].logprob for entry, tok in zip(o.logprobs, o.token_ids))
            assert o.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert [o.token_ids for o in snapshots[-1].outputs] == [o.token_ids for o in final.outputs]
    assert [o.cumulative_logprob for o in snapshots[-1].outputs] == [o.cumulative_logprob for o in final.outputs]
