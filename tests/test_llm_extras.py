"""The LLM API's beam search, extra outputs, bad words, and TextGenerationRequest, on the default model."""

from __future__ import annotations

import time

import pytest
import torch

from petrel import SamplingParams, TextGenerationRequest

pytestmark = pytest.mark.e2e

PROMPT = "List three facts about the moon:"


def greedy(llm, prompt, n=8, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, **kw), use_tqdm=False).outputs[0]


def test_beam_search_through_llm(llm):
    g = greedy(llm, PROMPT, 8, logprobs=0)
    out = llm.generate(PROMPT, SamplingParams(use_beam_search=True, beam_width=1, max_tokens=8), use_tqdm=False)
    assert out.outputs[0].token_ids == g.token_ids
    out = llm.generate(
        PROMPT, SamplingParams(use_beam_search=True, beam_width=4, n=2, max_tokens=8, logprobs=1), use_tqdm=False
    )
    beams = out.outputs
    assert [b.index for b in beams] == [0, 1] and beams[0].token_ids != beams[1].token_ids
    assert beams[0].cumulative_logprob >= beams[1].cumulative_logprob
    assert beams[0].cumulative_logprob >= g.cumulative_logprob - 1e-4
    for b in beams:
        assert b.text == llm.tokenizer.decode(b.token_ids, skip_special_tokens=True)
        assert len(b.logprobs) == len(b.token_ids)
        assert sum(entry[tok].logprob for entry, tok in zip(b.logprobs, b.token_ids)) == pytest.approx(
            b.cumulative_logprob, abs=1e-4
        )


def test_beam_search_streams_its_beams(llm):
    params = SamplingParams(use_beam_search=True, beam_width=3, n=3, max_tokens=6)
    snapshots = list(llm.generate_async(PROMPT, params, streaming=True))
    final = llm.generate(PROMPT, params, use_tqdm=False)
    assert len(snapshots) > 1 and snapshots[-1].finished and not snapshots[0].finished
    assert [o.token_ids for o in snapshots[-1].outputs] == [o.token_ids for o in final.outputs]


def test_context_and_generation_logits(llm, hf_model):
    params = SamplingParams(
        temperature=0,
        max_tokens=4,
        return_context_logits=True,
        return_generation_logits=True,
        additional_model_outputs=["hidden_states"],
    )
    out = llm.generate(PROMPT, params, use_tqdm=False)
    co = out.outputs[0]
    ids = out.prompt_token_ids + co.token_ids
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids]), output_hidden_states=True)
    logits, P = ref.logits[0].float(), len(out.prompt_token_ids)
    torch.testing.assert_close(out.context_logits, logits[:P], atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(co.generation_logits, logits[P - 1 : P + 3], atol=2e-3, rtol=1e-3)
    hidden = ref.hidden_states[-1][0].float()
    torch.testing.assert_close(co.additional_context_outputs["hidden_states"], hidden[:P], atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(
        co.additional_generation_outputs["hidden_states"], hidden[P - 1 : P + 3], atol=2e-3, rtol=1e-3
    )


def test_bad_words_strings(llm):
    g = greedy(llm, PROMPT, 12)
    word = llm.tokenizer.decode(g.token_ids[1:2]).strip()
    out = greedy(llm, PROMPT, 12, bad_words=[word])
    assert word not in out.text.split()
    assert out.token_ids[:1] == g.token_ids[:1] and out.token_ids != g.token_ids


def test_many_bad_words_are_prepared_in_linear_time(llm):
    """20,000 bad words (40,000 spellings to tokenize and de-duplicate) are ready in about a second; a list search
    for each spelling made it ~10 s, on the caller's thread (a gRPC or HTTP event loop)."""
    words = [f"zq{i}x" for i in range(20_000)]
    t0 = time.monotonic()
    out = greedy(llm, PROMPT, 2, bad_words=words)
    seconds = time.monotonic() - t0
    assert len(out.token_ids) == 2 and seconds < 4.0, f"{seconds:.1f} s"


def test_text_generation_request_messages_equal_chat(llm):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    params = SamplingParams(temperature=0, max_tokens=8)
    expected = llm.chat(messages, params, use_tqdm=False)
    out = llm.generate(
        TextGenerationRequest("req-a", model_name="SmolLM2-135M-Instruct", messages=messages, sampling_params=params),
        use_tqdm=False,
    )
    assert out.request_id == "req-a"
    assert out.prompt_token_ids == expected.prompt_token_ids
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids


def test_text_generation_request_prompt_logprobs_echo_salt(llm):
    params = SamplingParams(temperature=0, max_tokens=4)
    outs = llm.generate(
        [
            TextGenerationRequest(
                "p1", prompt=PROMPT, logprobs=2, echo=True, sampling_params=params, cache_salt="tenant-a"
            ),
            TextGenerationRequest("p2", prompt=llm.tokenizer(PROMPT)["input_ids"], sampling_params=params),
        ],
        use_tqdm=False,
    )
    a, b = outs
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert len(a.outputs[0].logprobs) == 4 and all(len(e) >= 2 for e in a.outputs[0].logprobs)
    assert (
        a.prompt_logprobs is not None
        and a.prompt_logprobs[0] is None
        and len(a.prompt_logprobs) == len(a.prompt_token_ids)
    )
    assert b.outputs[0].logprobs is None and b.prompt_logprobs is None


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(prompt="x", messages=[{"role": "user", "content": "y"}]), "exactly one"),
        (dict(), "exactly one"),
        (dict(prompt="x", cache_salt="s" * 513), "cache_salt"),
        (dict(prompt="x", response_format={"type": "yaml"}), "response_format"),
        (dict(prompt="x", response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "schema"),
        (dict(prompt="x", logprobs=-1), "logprobs"),
    ],
)
def test_text_generation_request_rejects_bad_fields(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        TextGenerationRequest("bad", **kwargs)


def test_text_generation_request_unknown_model_and_duplicate_id(llm):
    with pytest.raises(ValueError, match="model_name"):
        llm.generate_async(TextGenerationRequest("m", model_name="gpt-9", prompt="hi"))
    first = llm.generate_async(
        TextGenerationRequest("dup", prompt=PROMPT, sampling_params=SamplingParams(max_tokens=50, temperature=0))
    )
    with pytest.raises(ValueError, match="already in flight"):
        llm.generate_async(TextGenerationRequest("dup", prompt=PROMPT))
    assert first.result(timeout=60).outputs[0].finish_reason == "length"


def test_output_chunks_are_the_gateway_stream(llm):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, prompt_logprobs=1, n=1)
    future = llm.generate_async(PROMPT, params, streaming=True)
    chunks = list(future.output_chunks())
    final = future.result(timeout=30)
    co = final.outputs[0]
    assert [t for c in chunks for t in c.output_ids] == co.token_ids
    assert "".join(c.text for c in chunks) == co.text
    assert [c.completion_tokens for c in chunks] == list(range(1, 7))
    assert all(c.prompt_tokens == len(final.prompt_token_ids) for c in chunks)
    assert chunks[-1].finish_reason == "length" and chunks[-1].finish_details.type == "length"
    assert all(c.finish_reason is None for c in chunks[:-1])
    values, tokens = chunks[0].input_token_logprobs  # carried once, None for the first position
    assert values[0] is None and tokens == final.prompt_token_ids
    assert all(c.input_token_logprobs is None for c in chunks[1:])
    assert [lp for c in chunks for lp in c.output_token_logprobs] == pytest.approx(
        [e[t].logprob for e, t in zip(co.logprobs, co.token_ids)]
    )
    assert all(len(c.output_top_logprobs[0]) == 2 for c in chunks)
    assert chunks[0].spec_verify_ct is None and chunks[0].accept_draft_tokens is None  # no speculation here
