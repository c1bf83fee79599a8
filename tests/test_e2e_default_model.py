"""End to end on the real default model (SmolLM2-135M-Instruct), with transformers as the oracle."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from petrel import LLM, SamplingParams
from tests.conftest import free_blocks

pytestmark = pytest.mark.e2e

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "Write a poem about the sea.",
    "In a distant galaxy, far away, there was a small planet where " * 3,
    "def fibonacci(n):",
    "Question: What is 17 times 23? Answer:",
    "List three colors:",
    "The history of the Roman Empire " * 12,
]
GREEDY_64 = SamplingParams(temperature=0.0, max_tokens=64, min_tokens=64)  # min_tokens: as HF's min_new_tokens


@pytest.fixture(scope="module")
def hf_greedy(llm, hf_model):
    """transformers' greedy 64 tokens for each prompt, one prompt at a time (no padding)."""
    refs = []
    for prompt in PROMPTS:
        ids = torch.tensor([llm.tokenizer(prompt)["input_ids"]])
        with torch.inference_mode():
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, min_new_tokens=64,
                                    do_sample=False, pad_token_id=2)
        refs.append(out[0, ids.shape[1]:].tolist())
    return refs


def test_batched_greedy_equals_transformers(llm, hf_greedy):
    outputs = llm.generate(PROMPTS, GREEDY_64, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)


def test_one_at_a_time_equals_batched(llm, hf_greedy):
    for prompt, ref in zip(PROMPTS, hf_greedy):
        assert llm.generate(prompt, GREEDY_64).outputs[0].token_ids == ref


def test_prefix_cache_hit_and_salt_isolation(llm):
    long_prompt = "Once upon a time, in a quiet village by the mountains, " * 8
    params = SamplingParams(temperature=0, max_tokens=24)
    cold = llm.generate(long_prompt, params, cache_salt="cold-test")
    warm = llm.generate(long_prompt, params, cache_salt="cold-test")
    assert cold.num_cached_tokens == 0
    assert warm.num_cached_tokens > 0
    assert warm.num_cached_tokens <= len(warm.prompt_token_ids) - 1
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    other = llm.generate(long_prompt, params, cache_salt="another-tenant")
    assert other.num_cached_tokens == 0
    assert other.outputs[0].token_ids == cold.outputs[0].token_ids


def test_preemption_gives_the_same_outputs(hf_greedy):
    # 40 blocks of 16 tokens for 8 sequences of up to ~140 tokens (~70 blocks): preemption is forced
    from petrel.engine.model_runner import kv_bytes_per_block
    from petrel.model.loader import load_model_config, resolve_model
    per_block = kv_bytes_per_block(load_model_config(resolve_model(None)), 16, torch.float32)
    small = LLM(max_num_seqs=8, block_size=16, kv_cache_memory=40 * per_block)
    try:
        outputs = small.generate(PROMPTS, GREEDY_64, use_tqdm=False)
        preemptions = small.engine.call(lambda core: core.scheduler.num_preemptions)
        blocks = small.engine.call(lambda core: core.block_manager.num_blocks)
        assert preemptions > 0, f"no preemption happened with {blocks} blocks"
        assert [o.outputs[0].token_ids for o in outputs] == hf_greedy
        small.engine.call(lambda core: core.block_manager.check_integrity())
    finally:
        small.shutdown()


def test_n4_with_seed_is_reproducible(llm):
    params = SamplingParams(n=4, temperature=0.9, top_p=0.95, max_tokens=20, seed=1234)
    first = llm.generate("Tell me a joke about cats.", params)
    second = llm.generate("Tell me a joke about cats.", params)
    assert len(first.outputs) == 4
    assert [o.index for o in first.outputs] == [0, 1, 2, 3]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1, "4 seeded samples should not all be equal"
    # the same seeded request inside a busy batch samples the same tokens
    busy = llm.generate(["Tell me a joke about cats.", "Another prompt entirely"], [params, SamplingParams(max_tokens=20)],
                        use_tqdm=False)
    assert [o.token_ids for o in busy[0].outputs] == [o.token_ids for o in first.outputs]


def test_stop_strings_cut_the_text(llm):
    prompt = "Count: 1, 2, 3, 4, 5, 6,"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30)).outputs[0]
    assert " 9" in full.text, full.text
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop=[" 9"])).outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == " 9"
    assert cut.text == full.text[:full.text.index(" 9")]
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop=[" 9"],
                                               include_stop_str_in_output=True)).outputs[0]
    assert kept.text == full.text[:full.text.index(" 9") + 2]


def test_stop_token_ids(llm):
    prompt = "Count: 1, 2, 3, 4, 5, 6,"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30)).outputs[0]
    stop_tok = full.token_ids[5]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_tok])).outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.token_ids == full.token_ids[:full.token_ids.index(stop_tok) + 1]


def _forcing(token_ids):
    """A logits processor that makes the model emit exactly these tokens, then EOS."""
    def force(output_ids, logits):
        want = token_ids[len(output_ids)] if len(output_ids) < len(token_ids) else 2
        forced = torch.full_like(logits, float("-inf"))
        forced[want] = 0.0
        return forced
    return force


def test_streamed_text_diffs_concatenate_to_the_final_text(llm):
    target = "Café ☕ 你好 🎉🦜 done"
    ids = llm.tokenizer(target, add_special_tokens=False)["input_ids"]
    # at least one multi-byte character is split across tokens
    assert any("\ufffd" in llm.tokenizer.decode([t]) for t in ids)
    params = SamplingParams(temperature=0, max_tokens=len(ids) + 5, logits_processors=[_forcing(ids)])
    future = llm.generate_async("Say something:", params, streaming=True)
    pieces, token_pieces = [], []
    for partial in future:
        pieces.append(partial.outputs[0].text_diff)
        token_pieces.extend(partial.outputs[0].token_ids_diff)
        assert "\ufffd" not in partial.outputs[0].text
    final = future.result()
    assert final.outputs[0].text == target
    assert "".join(pieces) == target
    assert token_pieces == final.outputs[0].token_ids
    assert final.outputs[0].finish_reason == "stop"


def test_stop_string_never_streamed_partially(llm):
    prompt = "Count: 1, 2, 3, 4, 5, 6,"
    params = SamplingParams(temperature=0, max_tokens=30, stop=[" 8, 9"])
    future = llm.generate_async(prompt, params, streaming=True)
    streamed = "".join(p.outputs[0].text_diff for p in future)
    final = future.result().outputs[0]
    assert streamed == final.text
    assert " 8" not in final.text.split(" 7,")[-1]


def test_cold_and_warm_cache_same_greedy_tokens(llm):
    prompt = "The quick brown fox jumps over the lazy dog. " * 10
    params = SamplingParams(temperature=0, max_tokens=32)
    cold = llm.generate(prompt, params, cache_salt="warm-cold")
    warm = llm.generate(prompt, params, cache_salt="warm-cold")
    assert warm.num_cached_tokens > 0
    assert cold.outputs[0].token_ids == warm.outputs[0].token_ids


def test_abort_returns_blocks(llm):
    baseline = free_blocks(llm)
    future = llm.generate_async("Write a very long essay about the ocean.",
                                SamplingParams(temperature=0, max_tokens=400, ignore_eos=True), streaming=True)
    for i, partial in enumerate(future):
        if i == 3:
            future.abort()
    out = future.result(timeout=30)
    assert out.outputs[0].finish_reason == "cancelled"
    assert 0 < len(out.outputs[0].token_ids) < 400
    assert free_blocks(llm) == baseline
    llm.engine.call(lambda core: core.block_manager.check_integrity())


def test_timeout_finishes_with_timeout(llm):
    baseline = free_blocks(llm)
    out = llm.generate("Write a long story.", SamplingParams(max_tokens=2000, ignore_eos=True), timeout=0.5)
    assert out.outputs[0].finish_reason == "timeout"
    assert len(out.outputs[0].token_ids) < 2000
    assert free_blocks(llm) == baseline


def test_result_timeout_raises_and_request_goes_on(llm):
    future = llm.generate_async("Tell me about the moon.", SamplingParams(max_tokens=64, ignore_eos=True))
    with pytest.raises(TimeoutError):
        future.result(timeout=0.001)
    assert future.result(timeout=60).outputs[0].length == 64


def test_await_and_async_for(llm):
    async def run():
        awaited = await llm.generate_async("Hi there", SamplingParams(temperature=0, max_tokens=8))
        future = llm.generate_async("Hi there", SamplingParams(temperature=0, max_tokens=8), streaming=True)
        diffs = [p.outputs[0].token_ids_diff async for p in future]
        return awaited, diffs
    awaited, diffs = asyncio.run(run())
    assert sum(diffs, []) == awaited.outputs[0].token_ids
    assert len(diffs) > 1


def test_concurrent_threads_batch_together(llm):
    results = {}

    def worker(i):
        results[i] = llm.generate_async(PROMPTS[i], SamplingParams(temperature=0, max_tokens=16)).result(60)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(6):
        alone = llm.generate(PROMPTS[i], SamplingParams(temperature=0, max_tokens=16))
        assert results[i].outputs[0].token_ids == alone.outputs[0].token_ids


def test_logprobs_match_transformers(llm, hf_model):
    prompt = "The capital of France is"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, logprobs=5, prompt_logprobs=3))
    co = out.outputs[0]
    ids = out.prompt_token_ids + co.token_ids
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    n = len(out.prompt_token_ids)
    assert len(co.logprobs) == 8
    total = 0.0
    for i, (tok, entry) in enumerate(zip(co.token_ids, co.logprobs)):
        assert entry[tok].rank == 1                      # greedy picks the top token
        assert entry[tok].logprob == pytest.approx(ref[n - 1 + i, tok].item(), abs=1e-3)
        assert len(entry) == 5                            # sampled token is among the top 5
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks == [1, 2, 3, 4, 5]
        total += entry[tok].logprob
    assert co.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n
    for pos in range(1, n):
        tok = out.prompt_token_ids[pos]
        entry = out.prompt_logprobs[pos]
        assert entry[tok].logprob == pytest.approx(ref[pos - 1, tok].item(), abs=1e-3)
        assert entry[tok].rank == int((ref[pos - 1] > ref[pos - 1, tok]).sum()) + 1


def test_perf_metrics(llm):
    out = llm.generate("Hello", SamplingParams(max_tokens=10, ignore_eos=True, return_perf_metrics=True))
    m = out.outputs[0].request_perf_metrics
    assert m is not None
    assert 0 <= m.queue_time <= m.ttft <= m.e2e
    assert m.tpot > 0 and m.throughput > 0
    assert llm.generate("Hello", SamplingParams(max_tokens=2)).outputs[0].request_perf_metrics is None


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(n=0), "n"), (dict(max_tokens=0), "max_tokens"), (dict(top_k=-3), "top_k"),
    (dict(min_p=2.0), "min_p"), (dict(logprobs=-1), "logprobs"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_requests_raise_and_engine_goes_on(llm):
    baseline = free_blocks(llm)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate("word " * 9000, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([1, 2, 10 ** 7], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate("hi", SamplingParams(max_tokens=4, stop_token_ids=[10 ** 7]))
    assert llm.generate("Still alive?", SamplingParams(max_tokens=4, ignore_eos=True)).outputs[0].length == 4
    assert free_blocks(llm) == baseline


def test_chat_applies_template(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=20))
    assert "<|im_start|>assistant" in out.prompt
    assert "Paris" in out.outputs[0].text
