"""The Executor API end to end on the default model: response ordering and flags as the executor spec gives
them, cancel, await with timeouts, errors as Responses, stop/bad words, end_id, logits post-processors,
beams, context logits against transformers, and statistics."""

from __future__ import annotations

import time

import pytest
import torch

from petrel.executor import (
    AdditionalModelOutput,
    Executor,
    ExecutorConfig,
    FinishReason,
    LogitsPostProcessorConfig,
    OutputConfig,
    Request,
    RequestStage,
    SamplingConfig,
)

pytestmark = pytest.mark.e2e

BANNED: set[int] = set()  # what the "ban" post-processor bans (set by the test that uses it)


def _ban(request_id, logits, beam_tokens, client_id):
    for token in BANNED:
        logits[..., token] = float("-inf")
    return logits


def _ban_batched(request_ids, logits_list, beam_tokens_list, client_ids):
    for logits in logits_list:
        for token in BANNED:
            logits[..., token] = float("-inf")


@pytest.fixture(scope="module")
def executor():
    config = ExecutorConfig(
        max_beam_width=4,
        logits_post_processor_config=LogitsPostProcessorConfig(
            processor_map={"ban": _ban}, processor_batched=_ban_batched
        ),
        additional_model_outputs=[AdditionalModelOutput("hidden_states", gather_context=True)],
    )
    ex = Executor(executor_config=config)
    yield ex
    ex.shutdown()


@pytest.fixture(scope="module")
def prompt_ids(executor):
    return executor.engine.tokenizer("The three primary colors are")["input_ids"]


def collect(ex: Executor, request_id: int, limit: float = 120.0) -> list:
    """All responses of one request, in arrival order, until its final one."""
    responses, deadline = [], time.monotonic() + limit
    while time.monotonic() < deadline:
        for r in ex.await_responses(request_id, timeout=1.0):
            responses.append(r)
            if r.has_error() or r.result.is_final:
                return responses
    raise AssertionError(f"request {request_id} did not finish")


def free_blocks(ex: Executor) -> int:
    return ex.engine.call(lambda core: core.block_manager.num_free_blocks)


def greedy_tokens(ex, ids, n) -> list[int]:
    [r] = collect(ex, ex.enqueue_request(Request(ids, n, output_config=OutputConfig(exclude_input_from_output=True))))
    return r.result.output_token_ids[0]


def test_non_streaming_returns_one_final_result(executor, prompt_ids, llm):
    from petrel import SamplingParams

    expected = (
        llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False).outputs[0].token_ids
    )
    [r] = collect(executor, executor.enqueue_request(Request(prompt_ids, 12)))
    res = r.result
    assert not r.has_error() and res.is_final and res.is_sequence_final and res.sequence_index == 0
    assert res.output_token_ids == [prompt_ids + expected]  # the prompt first, by default
    assert res.finish_reasons == [FinishReason.LENGTH] and res.decoding_iter == 12
    assert greedy_tokens(executor, prompt_ids, 12) == expected  # exclude_input_from_output


def test_three_sequences_stream_with_the_spec_flags(executor, prompt_ids):
    """num_return_sequences = 3, streaming: a Result per step per sequence; a sequence that ends early has
    is_sequence_final while is_final stays false until all three ended."""
    sampling = SamplingConfig(temperature=1.0, seed=11)
    # not streaming, n=3: one response per sequence, each with all its tokens
    first = collect(
        executor,
        executor.enqueue_request(
            Request(
                prompt_ids,
                16,
                sampling_config=sampling,
                num_return_sequences=3,
                output_config=OutputConfig(exclude_input_from_output=True),
            )
        ),
    )
    assert len(first) == 3 and all(x.result.is_sequence_final for x in first)
    assert [x.result.is_final for x in first] == [False, False, True]
    seqs = {x.result.sequence_index: x.result.output_token_ids[0] for x in first}
    assert sorted(seqs) == [0, 1, 2]
    # a stop word that only sequence 1 produces, at its 3rd token or later: it ends first
    stop = next(t for t in seqs[1][2:] if t not in seqs[0] and t not in seqs[2])
    cut = seqs[1].index(stop) + 1
    rid = executor.enqueue_request(
        Request(prompt_ids, 16, streaming=True, sampling_config=sampling, num_return_sequences=3, stop_words=[[stop]])
    )
    responses = collect(executor, rid)
    got = {0: [], 1: [], 2: []}
    ended = set()
    for resp in responses:
        res = resp.result
        i = res.sequence_index
        assert i not in ended, "a result after the sequence's final one"
        assert len(res.output_token_ids[0]) == 1  # streaming: the new token only
        got[i] += res.output_token_ids[0]
        if res.is_sequence_final:
            ended.add(i)
        assert res.is_final == (ended == {0, 1, 2})
    assert got == {0: seqs[0], 1: seqs[1][:cut], 2: seqs[2]}
    flags = [(x.result.sequence_index, x.result.is_sequence_final, x.result.is_final) for x in responses]
    assert flags.index((1, True, False)) < len(flags) - 2  # sequence 1 ended while the others went on
    assert responses[-1].result.is_final
    final_1 = next(x.result for x in responses if x.result.sequence_index == 1 and x.result.is_sequence_final)
    assert final_1.finish_reasons == [FinishReason.STOP_WORDS]


def test_return_all_generated_tokens(executor, prompt_ids):
    expected = greedy_tokens(executor, prompt_ids, 6)
    responses = collect(
        executor, executor.enqueue_request(Request(prompt_ids, 6, streaming=True, return_all_generated_tokens=True))
    )
    assert [r.result.output_token_ids[0] for r in responses] == [expected[:k] for k in range(1, 7)]


def test_cancel_mid_stream_ends_with_a_final_response_and_frees_blocks(executor, prompt_ids):
    baseline = free_blocks(executor)
    rid = executor.enqueue_request(Request(prompt_ids, 400, streaming=True))
    first = executor.await_responses(rid, timeout=60)
    assert first and not first[0].result.is_final
    executor.cancel_request(rid)
    rest = collect(executor, rid)
    assert rest[-1].result.is_final and rest[-1].result.finish_reasons == [FinishReason.CANCELLED]
    assert sum(len(r.result.output_token_ids[0]) for r in first + rest) < 400
    assert free_blocks(executor) == baseline


def test_await_with_timeout_returns_empty_in_time(executor, prompt_ids):
    rid = executor.enqueue_request(Request(prompt_ids, 200))  # not streaming: nothing until it is done
    t0 = time.monotonic()
    assert executor.await_responses(rid, timeout=0.3) == []
    assert executor.await_responses([rid], timeout=0.2) == [[]]
    assert time.monotonic() - t0 < 2.0
    executor.cancel_request(rid)
    [r] = collect(executor, rid)
    assert r.result.finish_reasons == [FinishReason.CANCELLED]
    with pytest.raises(ValueError, match="not in flight"):  # finished and taken: waiting would never end
        executor.await_responses(rid)
    with pytest.raises(ValueError, match="not in flight"):
        executor.await_responses(10**9, timeout=1)
    t0 = time.monotonic()
    assert executor.await_responses() == []  # nothing in flight: no wait at all
    assert time.monotonic() - t0 < 0.5


def test_malformed_requests_get_error_responses_and_others_go_on(executor, prompt_ids):
    vocab = executor.engine.model_config.vocab_size
    bad = [
        Request([], 4),
        Request([vocab + 5], 4),
        Request(prompt_ids, 0),
        Request(prompt_ids, 4, sampling_config=SamplingConfig(beam_width=9)),
        Request(prompt_ids, 4, logits_post_processor_name="nope"),
        Request(prompt_ids, 4, sampling_config=SamplingConfig(top_p=2.0)),
        Request(prompt_ids, 4, stop_words=[[]]),
        Request(prompt_ids, 4, num_return_sequences=1000),
    ]
    good = executor.enqueue_request(Request(prompt_ids, 5))
    ids = executor.enqueue_requests(bad)
    for rid, needle in zip(
        ids, ["empty", "vocabulary", "max_tokens", "max_beam_width", "nope", "top_p", "stop", "num_return_sequences"]
    ):
        [r] = executor.await_responses(rid, timeout=10)
        assert r.has_error() and r.result is None and needle in r.error_msg, r.error_msg
    [r] = collect(executor, good)
    assert not r.has_error() and len(r.result.output_token_ids[0]) == len(prompt_ids) + 5


def test_stop_words_bad_words_and_end_id(executor, prompt_ids):
    free = greedy_tokens(executor, prompt_ids, 10)
    word = free[4:6]
    [r] = collect(
        executor,
        executor.enqueue_request(
            Request(prompt_ids, 10, stop_words=[word], output_config=OutputConfig(exclude_input_from_output=True))
        ),
    )
    assert r.result.output_token_ids[0] == free[:6] and r.result.finish_reasons == [FinishReason.STOP_WORDS]
    [r] = collect(
        executor,
        executor.enqueue_request(
            Request(prompt_ids, 10, bad_words=[[free[0]]], output_config=OutputConfig(exclude_input_from_output=True))
        ),
    )
    assert free[0] not in r.result.output_token_ids[0]
    end = free[3]
    [r] = collect(
        executor,
        executor.enqueue_request(
            Request(prompt_ids, 10, end_id=end, output_config=OutputConfig(exclude_input_from_output=True))
        ),
    )
    assert r.result.output_token_ids[0] == free[: free.index(end) + 1]
    assert r.result.finish_reasons == [FinishReason.END_ID]


def test_named_and_batched_post_processors(executor, prompt_ids):
    free = greedy_tokens(executor, prompt_ids, 8)
    BANNED.clear()
    BANNED.update(free[:2])
    try:
        outs = {}
        for name in ("ban", Request.BATCHED_POST_PROCESSOR_NAME):
            [r] = collect(
                executor,
                executor.enqueue_request(
                    Request(
                        prompt_ids,
                        8,
                        logits_post_processor_name=name,
                        output_config=OutputConfig(exclude_input_from_output=True),
                    )
                ),
            )
            outs[name] = r.result.output_token_ids[0]
            assert not BANNED & set(outs[name])
        assert outs["ban"] == outs[Request.BATCHED_POST_PROCESSOR_NAME]
    finally:
        BANNED.clear()


def test_beams(executor, prompt_ids):
    greedy = greedy_tokens(executor, prompt_ids, 8)
    [r] = collect(
        executor,
        executor.enqueue_request(
            Request(
                prompt_ids,
                8,
                sampling_config=SamplingConfig(beam_width=1),
                output_config=OutputConfig(exclude_input_from_output=True),
            )
        ),
    )
    assert r.result.output_token_ids == [greedy]
    rid = executor.enqueue_request(
        Request(
            prompt_ids,
            8,
            streaming=True,
            num_return_sequences=3,
            sampling_config=SamplingConfig(beam_width=4),
            output_config=OutputConfig(return_log_probs=True),
        )
    )
    *steps, r = collect(executor, rid)  # streaming beams: a Result per step, then the final one
    assert steps and not any(s.result.is_final for s in steps)
    assert all(len(s.result.output_token_ids) == 3 for s in steps)
    res = r.result
    assert res.is_final and res.sequence_index == 0 and len(res.output_token_ids) == 3
    assert len({tuple(b) for b in res.output_token_ids}) == 3
    assert res.cum_log_probs == sorted(res.cum_log_probs, reverse=True)
    for beam, lps, cum in zip(res.output_token_ids, res.log_probs, res.cum_log_probs):
        assert len(beam) == len(lps) == 8 and sum(lps) == pytest.approx(cum, abs=1e-4)
    assert res.cum_log_probs[0] >= _greedy_logprob(executor, prompt_ids, 8) - 1e-4


def _greedy_logprob(ex, ids, n) -> float:
    [r] = collect(ex, ex.enqueue_request(Request(ids, n, output_config=OutputConfig(return_log_probs=True))))
    return r.result.cum_log_probs[0]


def test_context_logits_and_hidden_states_match_transformers(executor, prompt_ids, hf_model):
    config = OutputConfig(
        return_context_logits=True,
        return_generation_logits=True,
        additional_model_outputs=[AdditionalModelOutput("hidden_states", gather_context=True)],
        exclude_input_from_output=True,
    )
    [r] = collect(executor, executor.enqueue_request(Request(prompt_ids, 4, output_config=config)))
    res = r.result
    tokens = res.output_token_ids[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt_ids + tokens]), output_hidden_states=True)
    logits = ref.logits[0].float()
    P = len(prompt_ids)
    assert res.context_logits.shape == (P, logits.shape[1])
    torch.testing.assert_close(res.context_logits, logits[:P], atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(res.generation_logits[0], logits[P - 1 : P + 3], atol=2e-3, rtol=1e-3)
    named = {(o.name, o.context): o.output for o in res.additional_outputs}
    torch.testing.assert_close(
        named[("hidden_states", True)], ref.hidden_states[-1][0, :P].float(), atol=2e-3, rtol=1e-3
    )
    assert named[("hidden_states", False)].shape == (1, 4, hf_model.config.hidden_size)


def test_iteration_and_request_stats(executor, prompt_ids):
    executor.get_latest_iteration_stats()  # drop older ones
    rid = executor.enqueue_request(Request(prompt_ids, 300, streaming=True))
    executor.await_responses(rid, timeout=60)
    [req] = [s for s in executor.get_latest_request_stats()[-1].request_stats if s.id == rid]
    assert req.stage is RequestStage.GENERATION_IN_PROGRESS and req.scheduled
    assert req.context_prefill_position == len(prompt_ids) and req.allocated_blocks >= 1
    executor.cancel_request(rid)
    collect(executor, rid)
    stats = executor.get_latest_iteration_stats()
    assert stats and [s.iteration for s in stats] == sorted(s.iteration for s in stats)
    total = executor.engine.call(lambda core: core.block_manager.num_blocks)
    for s in stats:
        assert s.kv_blocks_used + s.kv_blocks_free == total and s.step_time > 0
    assert stats[0].num_prompt_tokens == len(prompt_ids) and stats[-1].num_generation_tokens >= 1
    assert sum(s.num_generation_tokens for s in stats) >= 1
