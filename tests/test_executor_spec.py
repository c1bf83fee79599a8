"""The Executor's Request and ExecutorConfig fields from the executor spec (TensorRT-LLM's Executor API), on the tiny
random Llama:
embedding_bias, allotted_time_ms, lora_config, OutputConfig's full signature with perf metrics,
ExecutorConfig.additional_model_outputs and kv_cache_config, per-iteration request stats, the spec's logits
post-processor signatures (beams in one call), and the spec fields petrel refuses."""

from __future__ import annotations

import time

import pytest
import torch

from petrel.config import EngineConfig
from petrel.executor import (
    AdditionalModelOutput,
    Executor,
    ExecutorConfig,
    ExternalDraftTokensConfig,
    FinishReason,
    KvCacheConfig,
    LogitsPostProcessorConfig,
    LookaheadDecodingConfig,
    LoraConfig,
    MultimodalInput,
    OutputConfig,
    PromptTuningConfig,
    Request,
    RequestStatsPerIteration,
    SamplingConfig,
)

VOCAB = 256
EOS = 2
NO_EOS = [[EOS]]  # bad words that keep the tiny model from ending early
PROMPT = [5, 17, 33, 61, 99, 120, 7, 42]
CALLS: list[tuple] = []  # what the recording post-processors saw: (kind, shape, n token lists, stream)
BANNED: set[int] = set()


def _record(request_id, logits, beam_tokens, stream, client_id):
    CALLS.append(("named", tuple(logits.shape), len(beam_tokens), stream))
    for token in BANNED:
        logits[:, token] = float("-inf")
    return logits


def _record_batched(request_ids, logits_list, beam_tokens_list, stream, client_ids):
    for logits, tokens in zip(logits_list, beam_tokens_list):
        CALLS.append(("batched", tuple(logits.shape), len(tokens), stream))
        for token in BANNED:
            logits[:, token] = float("-inf")


def _old_form(request_id, logits, beam_tokens, client_id):
    logits[:, 77] = 1e4  # the 4-argument form (no stream) still works


def _slow(request_id, logits, beam_tokens, stream, client_id):
    time.sleep(0.02)


def _engine_config(tiny, tokenizer_dir, **options) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model=tiny(2, False).path,
        tokenizer=tokenizer_dir,
        kv_cache_memory=options.pop("kv_cache_memory", 1 << 20),
        **options,
    )


@pytest.fixture(scope="module")
def executor(tiny, tokenizer_dir):
    config = ExecutorConfig(
        max_beam_width=4,
        logits_post_processor_config=LogitsPostProcessorConfig(
            processor_map={"record": _record, "old": _old_form, "slow": _slow}, processor_batched=_record_batched
        ),
        additional_model_outputs=[AdditionalModelOutput("hidden_states")],
    )
    ex = Executor(_engine_config(tiny, tokenizer_dir), executor_config=config)
    yield ex
    ex.shutdown()


def collect(ex: Executor, request_id: int, limit: float = 60.0) -> list:
    responses, deadline = [], time.monotonic() + limit
    while time.monotonic() < deadline:
        for r in ex.await_responses(request_id, timeout=1.0):
            responses.append(r)
            if r.has_error() or r.result.is_final:
                return responses
    raise AssertionError(f"request {request_id} did not finish")


def run(ex: Executor, n: int = 8, **fields):
    fields.setdefault("output_config", OutputConfig(exclude_input_from_output=True))
    return collect(ex, ex.enqueue_request(Request(list(PROMPT), n, **fields)))[-1]


def error_of(ex: Executor, **fields) -> str:
    r = run(ex, **fields)
    assert r.has_error(), r
    return r.error_msg


def free_blocks(ex: Executor) -> int:
    return ex.engine.call(lambda core: core.block_manager.num_free_blocks)


# ---------------------------------------------------------------------------------------------- embedding_bias
def test_embedding_bias_steers_greedy_tokens(executor):
    plain = run(executor, bad_words=NO_EOS).result.output_token_ids[0]
    forced = next(t for t in range(3, VOCAB) if t not in plain)
    bias = torch.zeros(VOCAB)
    bias[forced] = 1e4
    assert run(executor, embedding_bias=bias).result.output_token_ids[0] == [forced] * 8
    as_list = [0.0] * VOCAB
    as_list[forced + 1] = 1e4
    assert run(executor, embedding_bias=as_list).result.output_token_ids[0] == [forced + 1] * 8
    assert run(executor, embedding_bias=torch.zeros(VOCAB), bad_words=NO_EOS).result.output_token_ids[0] == plain
    assert "embedding_bias" in error_of(executor, embedding_bias=torch.zeros(VOCAB - 1))


# ---------------------------------------------------------------------------------------------- allotted_time_ms
def test_allotted_time_ms_times_out_one_request_and_frees_its_blocks(executor):
    baseline = free_blocks(executor)
    slow = executor.enqueue_request(
        Request(list(PROMPT), 200, bad_words=NO_EOS, allotted_time_ms=300, logits_post_processor_name="slow")
    )
    other = executor.enqueue_request(Request([9, 8, 7], 12, bad_words=NO_EOS))
    t0 = time.monotonic()
    [r] = collect(executor, slow)
    assert time.monotonic() - t0 < 3.0
    res = r.result
    assert res.is_final and res.finish_reasons == [FinishReason.TIMED_OUT]
    generated = len(res.output_token_ids[0]) - len(PROMPT)  # non-streaming: the prompt first
    assert 0 < generated < 200
    [o] = collect(executor, other)
    assert o.result.finish_reasons == [FinishReason.LENGTH] and len(o.result.output_token_ids[0]) == 3 + 12
    assert free_blocks(executor) == baseline
    assert "allotted_time_ms" in error_of(executor, allotted_time_ms=0)


# ---------------------------------------------------------------------------------------------- lora_config
def test_lora_config_caches_by_task_id_and_matches_the_llm_api(tiny, tokenizer_dir, tmp_path):
    from test_lora import make_adapter

    from petrel import LLM, LoRARequest, SamplingParams

    pytest.importorskip("peft")
    make_adapter(tiny(2, False).hf, tmp_path / "a1", seed=1)
    path = str(tmp_path / "a1")
    with LLM(tiny(2, False).path, tokenizer=tokenizer_dir, kv_cache_memory=1 << 20, enable_lora=True) as llm:
        params = SamplingParams(temperature=0, max_tokens=8)
        want = llm.generate(list(PROMPT), params, use_tqdm=False, lora_request=LoRARequest("a1", 1, path))
        base = llm.generate(list(PROMPT), params, use_tqdm=False)
    want, base = want.outputs[0].token_ids, base.outputs[0].token_ids
    assert want != base
    with Executor(_engine_config(tiny, tokenizer_dir, enable_lora=True)) as ex:
        assert "lora_config" in error_of(ex, lora_config=LoraConfig(7))  # unknown task_id, no path
        assert run(ex, lora_config=LoraConfig(1, path=path)).result.output_token_ids[0] == want
        assert run(ex, lora_config=LoraConfig(1)).result.output_token_ids[0] == want  # cached by task_id
        assert run(ex).result.output_token_ids[0] == base
        assert "lora_config" in error_of(ex, lora_config=LoraConfig(2, weights=torch.zeros(1, 3), config=None))
        assert "lora_config" in error_of(ex, lora_config=LoraConfig(3, path=str(tmp_path / "missing")))
    with Executor(_engine_config(tiny, tokenizer_dir)) as ex:  # LoRA not enabled
        assert "lora_config" in error_of(ex, lora_config=LoraConfig(1, path=path))


# ---------------------------------------------------------------------------------------------- OutputConfig
def test_output_config_positional_and_perf_metrics(executor):
    outputs = [AdditionalModelOutput("hidden_states")]
    oc = OutputConfig(False, False, False, True, False, False, outputs)
    assert oc.exclude_input_from_output and not oc.return_perf_metrics and oc.additional_model_outputs == outputs
    r = run(executor, output_config=oc).result
    assert r.additional_outputs[0].output.shape == (1, len(r.output_token_ids[0]), 64)
    assert r.request_perf_metrics is None
    long_prompt = list(range(3, 3 + 40))  # 2 full blocks of 16
    before = time.monotonic()
    results = []
    for _ in range(2):
        oc = OutputConfig(exclude_input_from_output=True, return_perf_metrics=True)
        results.append(
            collect(executor, executor.enqueue_request(Request(long_prompt, 4, bad_words=NO_EOS, output_config=oc)))[
                -1
            ].result
        )
    for res in results:
        m = res.request_perf_metrics
        t = m.timing_metrics
        assert before <= t.arrival_time <= t.first_scheduled_time <= t.first_token_time <= t.last_token_time
        assert t.last_token_time <= time.monotonic() and m.num_generated_tokens == 4
    first, second = (res.request_perf_metrics.kv_cache_metrics for res in results)
    assert second.num_reused_blocks == 2 and second.num_missed_blocks == 0 and second.kv_cache_hit_rate == 1.0
    assert first.num_reused_blocks + first.num_missed_blocks == 2
    assert "return_encoder_output" in error_of(executor, output_config=OutputConfig(return_encoder_output=True))


# ---------------------------------------------------------------------------------------------- ExecutorConfig
def test_kv_cache_config_and_configured_additional_outputs(tiny, tokenizer_dir):
    config = ExecutorConfig(
        kv_cache_config=KvCacheConfig(enable_block_reuse=False, max_tokens=64), request_stats_max_iterations=3
    )
    with Executor(_engine_config(tiny, tokenizer_dir), executor_config=config) as ex:
        assert ex.engine.config.enable_prefix_caching is False
        assert ex.engine.kv_cache_tokens == 64
        msg = error_of(
            ex, output_config=OutputConfig(additional_model_outputs=[AdditionalModelOutput("hidden_states")])
        )
        assert "hidden_states" in msg
        for _ in range(2):
            run(ex, n=4, bad_words=NO_EOS, output_config=OutputConfig(return_perf_metrics=True))
        stats = ex.get_latest_request_stats()
        assert len(stats) == 3  # bounded by request_stats_max_iterations (8 steps ran)
    with Executor(
        _engine_config(tiny, tokenizer_dir),
        executor_config=ExecutorConfig(kv_cache_config=KvCacheConfig(enable_block_reuse=True, max_tokens=48)),
    ) as ex:
        assert ex.engine.config.enable_prefix_caching is True and ex.engine.kv_cache_tokens == 48
    with pytest.raises(ValueError, match="cross_kv_cache_fraction"):
        Executor(
            _engine_config(tiny, tokenizer_dir),
            ExecutorConfig(kv_cache_config=KvCacheConfig(cross_kv_cache_fraction=0.5)),
        )
    with pytest.raises(ValueError, match="free_gpu_memory_fraction"):
        Executor(
            _engine_config(tiny, tokenizer_dir),
            ExecutorConfig(kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=0.5)),
        )
    with pytest.raises(ValueError, match="replicate"):
        Executor(
            _engine_config(tiny, tokenizer_dir),
            ExecutorConfig(logits_post_processor_config=LogitsPostProcessorConfig(replicate="no")),
        )
    with pytest.raises(ValueError, match="top_k_logits"):
        Executor(
            _engine_config(tiny, tokenizer_dir),
            ExecutorConfig(additional_model_outputs=[AdditionalModelOutput("top_k_logits")]),
        )


# ---------------------------------------------------------------------------------------------- request stats
def test_request_stats_per_iteration_since_the_last_call(executor):
    executor.get_latest_request_stats()  # drop older ones
    rid = executor.enqueue_request(Request(list(PROMPT), 6, bad_words=NO_EOS))
    collect(executor, rid)
    first = executor.get_latest_request_stats()
    assert first and all(isinstance(s, RequestStatsPerIteration) for s in first)
    iters = [s.iter for s in first]
    assert iters == sorted(iters) and len(set(iters)) == len(iters)
    mine = [s for it in first for s in it.request_stats if s.id == rid]
    assert len(mine) >= 5  # one per step it was in flight after (prefill + 5 decodes; the last step ends it)
    assert max(s.num_generated_tokens for s in mine) >= 5
    assert executor.get_latest_request_stats() == []
    rid2 = executor.enqueue_request(Request(list(PROMPT), 3, bad_words=NO_EOS))
    collect(executor, rid2)
    second = executor.get_latest_request_stats()
    assert second and min(s.iter for s in second) > max(iters)
    assert not any(s.id == rid for it in second for s in it.request_stats)


# ---------------------------------------------------------------------------------------------- post-processors
def test_post_processors_get_the_spec_arguments_and_beams_in_one_call(executor):
    CALLS.clear()
    BANNED.clear()
    run(executor, n=3, logits_post_processor_name="record")
    assert CALLS and all(c == ("named", (1, VOCAB), 1, None) for c in CALLS)
    beam = SamplingConfig(beam_width=3, num_return_sequences=3)
    free = run(executor, n=4, sampling_config=beam, bad_words=NO_EOS).result.output_token_ids
    for name, kind in (("record", "named"), (Request.BATCHED_POST_PROCESSOR_NAME, "batched")):
        CALLS.clear()
        r = run(executor, n=4, sampling_config=beam, bad_words=NO_EOS, logits_post_processor_name=name).result
        assert r.output_token_ids == free  # recording changes nothing
        assert CALLS and all(c == (kind, (3, VOCAB), 3, None) for c in CALLS)
    BANNED.update({free[0][0], free[1][0], free[2][0]})
    try:
        for name in ("record", Request.BATCHED_POST_PROCESSOR_NAME):
            r = run(executor, n=4, sampling_config=beam, bad_words=NO_EOS, logits_post_processor_name=name).result
            assert len(r.output_token_ids) == 3
            for tokens in r.output_token_ids:
                assert not BANNED & set(tokens)
    finally:
        BANNED.clear()
    assert run(executor, n=3, logits_post_processor_name="old").result.output_token_ids[0] == [77] * 3


# ---------------------------------------------------------------------------------------------- refused fields
@pytest.mark.parametrize(
    "name, value",
    [
        ("lookahead_config", LookaheadDecodingConfig(4, 3, 4)),
        ("mrope_config", object()),  # a text model has no M-RoPE
        ("encoder_input_token_ids", [1, 2]),
        ("multimodal_embedding", torch.zeros(2, 64)),
        ("multimodal_input", MultimodalInput([[1] * 8], [0], [1])),  # a text-only model takes no images
        ("position_ids", [0, 1]),  # one per prompt token
    ],
)
def test_unsupported_request_fields_are_refused_by_name(executor, name, value):
    assert name in error_of(executor, **{name: value})


# ---------------------------------------------------------------------------------------------- speculation, tuning
def test_external_draft_tokens_config_is_verified_and_never_changes_greedy_tokens(executor):
    plain = run(executor, bad_words=NO_EOS).result.output_token_ids[0]
    wrong = [(t + 1) % VOCAB for t in plain]
    for drafts in (plain, plain[:3] + wrong[3:], wrong):
        got = run(executor, bad_words=NO_EOS, external_draft_tokens_config=ExternalDraftTokensConfig(list(drafts)))
        assert got.result.output_token_ids[0] == plain, drafts
    logits = torch.zeros(2, VOCAB)  # with the logits the drafts were drawn from: greedy still equals plain
    for config in (
        ExternalDraftTokensConfig(plain[:2], logits=logits),
        ExternalDraftTokensConfig(plain[:2], logits=logits, acceptance_threshold=0.5, fast_logits=True),
    ):
        got = run(executor, bad_words=NO_EOS, external_draft_tokens_config=config)
        assert got.result.output_token_ids[0] == plain
    for name, kw in (
        ("logits", dict(logits=torch.zeros(3, VOCAB))),
        ("logits", dict(logits=torch.zeros(2, VOCAB - 1))),
        ("logits", dict(logits=torch.full((2, VOCAB), float("nan")))),
        ("fast_logits", dict(logits=torch.zeros(1, 5), fast_logits=True)),
        ("fast_logits", dict(fast_logits="yes")),
        ("acceptance_threshold", dict(acceptance_threshold=0.5)),
        ("acceptance_threshold", dict(logits=logits, acceptance_threshold=1.5)),
        ("tokens", dict()),
    ):
        config = ExternalDraftTokensConfig([] if name == "tokens" else plain[:2], **kw)
        assert f"external_draft_tokens_config.{name}" in error_of(executor, external_draft_tokens_config=config)


def test_prompt_tuning_config_virtual_tokens_take_table_rows(executor):
    real = PROMPT[2:5]
    with torch.no_grad():  # virtual ids VOCAB..VOCAB+2 stand for the real tokens: their embedding rows
        table = executor.engine.call(lambda core: core.runner.model.model.embed_tokens(torch.tensor(real)).clone())
    virtual = PROMPT[:2] + [VOCAB, VOCAB + 1, VOCAB + 2] + PROMPT[5:]

    def tuned(ids, config):
        r = collect(executor, executor.enqueue_request(Request(ids, 8, bad_words=NO_EOS, prompt_tuning_config=config)))
        return r[-1]

    plain = run(executor, bad_words=NO_EOS).result.output_token_ids[0]
    assert tuned(virtual, PromptTuningConfig(table)).result.output_token_ids[-1][-8:] == plain
    other = tuned(virtual, PromptTuningConfig(torch.randn_like(table) * 3)).result.output_token_ids[-1][-8:]
    assert other != plain
    past = tuned(PROMPT + [VOCAB + 3], PromptTuningConfig(table))
    assert past.has_error() and "prompt_tuning_config" in past.error_msg


def test_input_token_extra_ids_key_the_prefix_cache_per_virtual_token(executor):
    """Same table: requests with the same extra ids on the virtual tokens share the block holding them, other extra
    ids never do (the tokens stay the table's); extra ids of vocabulary tokens key nothing."""
    table = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    ids = [VOCAB, VOCAB + 1, VOCAB + 2] + [(i * 11 + 4) % 200 + 3 for i in range(17)]  # 20 tokens: 1 full block

    def tuned(extra_ids):
        oc = OutputConfig(exclude_input_from_output=True, return_perf_metrics=True)
        config = PromptTuningConfig(table, input_token_extra_ids=extra_ids)
        request = Request(list(ids), 6, bad_words=NO_EOS, prompt_tuning_config=config, output_config=oc)
        r = collect(executor, executor.enqueue_request(request))[-1]
        assert not r.has_error(), r.error_msg
        return r.result.output_token_ids[0], r.result.request_perf_metrics.kv_cache_metrics.num_reused_blocks

    first, reused = tuned([7] * len(ids))
    assert reused == 0
    assert tuned([7] * len(ids)) == (first, 1)
    assert tuned([8] * len(ids)) == (first, 0)  # other extra ids: computed again, the same table's tokens
    assert tuned([7, 7, 7] + [99] * 17) == (first, 1)  # the vocabulary tokens' extra ids key nothing
    for bad in ([7] * 3, [-1] * len(ids), ["a"] * len(ids)):
        config = PromptTuningConfig(table, input_token_extra_ids=bad)
        r = collect(executor, executor.enqueue_request(Request(list(ids), 2, prompt_tuning_config=config)))[-1]
        assert r.has_error() and "input_token_extra_ids" in r.error_msg
