"""Request controls and extra outputs on the tiny random Llama, against transformers where there is an oracle:
bad words and stop words as token ids, logits post-processors (per request and batched), context and
generation logits, and final hidden states."""

from __future__ import annotations

import pytest
import torch
from tiny_llama import ATOL, RTOL, _tokens

from petrel.config import EngineConfig
from petrel.engine.engine_core import EngineCore
from petrel.engine.model_runner import kv_bytes_per_block
from petrel.engine.sequence import EngineRequest
from petrel.sampling_params import SamplingParams


def make_core(t, batched=None, **config) -> EngineCore:
    config.setdefault("kv_cache_memory", 256 * kv_bytes_per_block(t.cfg, 4, torch.float32))
    return EngineCore(EngineConfig(block_size=4, **config), t.model, t.cfg, batched_post_processor=batched)


def drain(core: EngineCore) -> dict:
    """{(request_id, index): [EngineOutput, ...]} until the core is idle."""
    outs: dict = {}
    while core.has_work:
        for out in core.step():
            outs.setdefault((out.request_id, out.index), []).append(out)
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    return outs


def tokens_of(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def greedy(t, prompt, max_tokens=8, **kw) -> list[int]:
    core = make_core(t)
    core.add_request(EngineRequest("r", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)))
    return tokens_of(drain(core)[("r", 0)])


def test_bad_word_single_and_multi_token(tiny):
    t = tiny(2, False)
    prompt = _tokens(7, 11)
    free = greedy(t, prompt)
    # a one-token bad word: its token never appears, the first step picks something else
    banned = free[0]
    out = greedy(t, prompt, bad_words_token_ids=[[banned]])
    assert banned not in out and out[0] != banned
    # a two-token bad word [a, b]: b is banned only right after a
    a, b = free[0], free[1]
    out = greedy(t, prompt, bad_words_token_ids=[[a, b]])
    assert out[0] == a and out[1] != b
    assert all(not (x == a and y == b) for x, y in zip(out, out[1:]))


def test_stop_word_token_sequence(tiny):
    t = tiny(2, False)
    prompt = _tokens(7, 12)
    free = greedy(t, prompt, max_tokens=10)
    word = free[3:5]
    core = make_core(t)
    core.add_request(
        EngineRequest(
            "r", prompt, SamplingParams(temperature=0.0, max_tokens=10, stop_token_sequences=[[3, 3, 3], word])
        )
    )
    outs = drain(core)[("r", 0)]
    assert tokens_of(outs) == free[:5]  # stops right after the word, which stays in the output
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == tuple(word)


def _ban(token):
    def fn(request_id, logits, beam_tokens, client_id):
        logits[..., token] = float("-inf")
        return logits

    return fn


def test_logits_post_processor_bans_and_sees_its_request(tiny):
    t = tiny(2, False)
    prompt = _tokens(6, 13)
    free = greedy(t, prompt)
    seen = []

    def spy(request_id, logits, beam_tokens, client_id):
        seen.append((request_id, client_id, list(beam_tokens[0]), tuple(logits.shape)))
        return _ban(free[0])(request_id, logits, beam_tokens, client_id)

    core = make_core(t)
    core.add_request(
        EngineRequest(
            "r", prompt, SamplingParams(temperature=0.0, max_tokens=4), client_id=7, logits_post_processor=spy
        )
    )
    out = tokens_of(drain(core)[("r", 0)])
    assert free[0] not in out
    assert seen[0] == ("r", 7, prompt, (1, t.cfg.vocab_size))
    assert seen[1][2] == prompt + out[:1]  # beam_tokens: the whole sequence so far


def test_batched_post_processor_equals_per_request(tiny):
    t = tiny(2, True)
    prompts = [_tokens(6, 20 + i) for i in range(3)]
    bias = torch.randn(t.cfg.vocab_size, generator=torch.Generator().manual_seed(0)) * 5

    def per_request(request_id, logits, beam_tokens, client_id):
        return logits + bias * (client_id + 1) - 0.1 * len(beam_tokens[0])

    calls = []

    def batched(request_ids, logits_list, beam_tokens_list, client_ids):
        calls.append(list(request_ids))
        for logits, beams, cid in zip(logits_list, beam_tokens_list, client_ids):
            logits += bias * (cid + 1) - 0.1 * len(beams[0])

    def run(**kw):
        core = make_core(t, batched=batched)
        for i, p in enumerate(prompts):
            core.add_request(EngineRequest(i, p, SamplingParams(temperature=0.0, max_tokens=6), client_id=i, **kw))
        outs = drain(core)
        return [tokens_of(outs[(i, 0)]) for i in range(len(prompts))]

    one_by_one = run(logits_post_processor=per_request)
    together = run(use_batched_post_processor=True)
    assert together == one_by_one
    assert together != [greedy(t, p, max_tokens=6) for p in prompts]  # the processor did change something
    assert max(len(c) for c in calls) == len(prompts)  # one call for the whole step


def test_context_and_generation_logits_match_transformers(tiny):
    t = tiny(4, False)
    prompt = _tokens(11, 14)
    core = make_core(t, max_num_batched_tokens=4)  # the prompt is prefilled in 3 chunks
    params = SamplingParams(
        temperature=0.0,
        max_tokens=5,
        return_context_logits=True,
        return_generation_logits=True,
        additional_model_outputs=["hidden_states"],
    )
    core.add_request(EngineRequest("r", prompt, params))
    outs = drain(core)[("r", 0)]
    tokens = tokens_of(outs)
    with torch.no_grad():
        ref = t.hf(torch.tensor([prompt + tokens]), output_hidden_states=True)
    logits, hidden = ref.logits[0].float(), ref.hidden_states[-1][0].float()
    P = len(prompt)
    torch.testing.assert_close(outs[0].context_logits, logits[:P], atol=ATOL, rtol=RTOL)
    gen = torch.cat([o.generation_logits for o in outs])
    assert gen.shape == (len(tokens), t.cfg.vocab_size)
    torch.testing.assert_close(gen, logits[P - 1 : P - 1 + len(tokens)], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(outs[0].additional_context_outputs["hidden_states"], hidden[:P], atol=ATOL, rtol=RTOL)
    gen_hidden = torch.cat([o.additional_generation_outputs["hidden_states"] for o in outs])
    torch.testing.assert_close(gen_hidden, hidden[P - 1 : P - 1 + len(tokens)], atol=ATOL, rtol=RTOL)


def test_context_outputs_are_computed_even_for_a_cached_prefix(tiny):
    """A request that asks for context outputs never takes its prompt from the prefix cache."""
    t = tiny(2, False)
    prompt = _tokens(12, 15)
    core = make_core(t)
    core.add_request(EngineRequest("warm", prompt, SamplingParams(temperature=0.0, max_tokens=2)))
    drain(core)
    core.add_request(
        EngineRequest("r", prompt, SamplingParams(temperature=0.0, max_tokens=2, return_context_logits=True))
    )
    outs = drain(core)[("r", 0)]
    assert outs[0].num_cached_tokens == 0
    assert outs[0].context_logits.shape == (len(prompt), t.cfg.vocab_size)


def test_priority_orders_admission(tiny):
    t = tiny(2, False)
    core = make_core(t, max_num_seqs=1)
    for rid, prio in (("low", 0.1), ("mid", 0.5), ("high", 0.9)):
        core.add_request(
            EngineRequest(rid, _tokens(5, 16), SamplingParams(temperature=0.0, max_tokens=2), priority=prio)
        )
    order = []
    while core.has_work:
        for out in core.step():
            if out.finish_reason:
                order.append(out.request_id)
    assert order == ["high", "mid", "low"]


def test_bad_params_name_the_field():
    with pytest.raises(ValueError, match="bad_words_token_ids"):
        SamplingParams(bad_words_token_ids=[[]])
    with pytest.raises(ValueError, match="stop_token_sequences"):
        SamplingParams(stop_token_sequences=[[1, -2]])
    with pytest.raises(ValueError, match="additional_model_outputs"):
        SamplingParams(additional_model_outputs=["attention_maps"])


def test_bans_that_leave_no_token_are_refused_naming_the_field(tiny):
    """Bad words covering the whole vocabulary, or leaving only what min_tokens bans (the stop token ids, EOS):
    a ValueError naming the field before the request is queued, never a request that emits banned tokens."""
    t = tiny(2, False)
    core, vocab, eos = make_core(t), t.cfg.vocab_size, (2,)
    every = [[i] for i in range(vocab)]
    with pytest.raises(ValueError, match="bad_words_token_ids ban every token"):
        SamplingParams(bad_words_token_ids=every).validate_for_model(vocab)
    with pytest.raises(ValueError, match="bad_words_token_ids ban every token"):
        core.validate(_tokens(4, 1), SamplingParams(bad_words_token_ids=every + [[5, 6]]), eos)
    all_but_ends = [[i] for i in range(vocab) if i not in (2, 7)]
    with pytest.raises(ValueError, match="^min_tokens"):
        core.validate(
            _tokens(4, 1), SamplingParams(bad_words_token_ids=all_but_ends, stop_token_ids=[7], min_tokens=1), eos
        )
    # one token left to generate: served
    core.validate(_tokens(4, 1), SamplingParams(bad_words_token_ids=all_but_ends, stop_token_ids=[7]), eos)
    core.validate(_tokens(4, 1), SamplingParams(bad_words_token_ids=all_but_ends, min_tokens=1, ignore_eos=True), eos)
    core.validate(_tokens(4, 1), SamplingParams(bad_words_token_ids=every[1:]), eos)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_sequence_whose_every_token_gets_banned_ends_there_without_one(tiny, temperature):
    """Every token but a banned, and two-token bad words [a, x] for every x: once a is written nothing is left. The
    sequence ends right after a ('stop', no banned token; it used to emit token 0 until max_tokens), greedy or
    sampled, and the request beside it in the batch gets exactly its tokens alone."""
    t = tiny(2, False)
    vocab, a = t.cfg.vocab_size, 5
    prompt, other = _tokens(7, 11), _tokens(6, 12)
    words = [[x] for x in range(vocab) if x != a] + [[a, x] for x in range(vocab)]
    trap = SamplingParams(temperature=temperature, seed=3, max_tokens=8, bad_words_token_ids=words)
    alone = greedy(t, other)
    core = make_core(t)
    core.add_request(EngineRequest("trap", prompt, trap))
    core.add_request(EngineRequest("other", other, SamplingParams(temperature=0.0, max_tokens=8)))
    outs = drain(core)
    trapped = outs[("trap", 0)]
    assert tokens_of(trapped) == [a]
    assert trapped[-1].finish_reason == "stop" and trapped[-1].new_token_ids == []
    assert tokens_of(outs[("other", 0)]) == alone


def test_a_failing_logits_processor_fails_only_its_request(tiny):
    t = tiny(2, False)
    prompts = [_tokens(6, 40), _tokens(9, 41)]
    alone = greedy(t, prompts[1], max_tokens=6)
    calls = []

    def explode(output_ids, logits):
        calls.append(len(output_ids))
        if len(output_ids) == 2:
            raise RuntimeError("boom")
        return logits

    core = make_core(t)
    core.add_request(
        EngineRequest("bad", prompts[0], SamplingParams(temperature=0.0, max_tokens=6, logits_processors=[explode]))
    )
    core.add_request(EngineRequest("good", prompts[1], SamplingParams(temperature=0.0, max_tokens=6)))
    outs = drain(core)  # drain also checks that every block came back
    bad = outs[("bad", 0)]
    assert len(tokens_of(bad)) == 2 and bad[-1].finish_reason == "abort"
    assert "logits processor failed: RuntimeError: boom" in bad[-1].abort_message
    assert tokens_of(outs[("good", 0)]) == alone and outs[("good", 0)][-1].finish_reason == "length"
    assert "bad" not in core.requests
