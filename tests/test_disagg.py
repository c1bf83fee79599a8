"""Disaggregated serving: prefill (context_only) on one instance, decode (generation_only) on another, the
prompt's KV moved over TCP. The greedy tokens equal one instance doing both; pinned blocks return to the pool
after the fetch and after expiry; a bad or expired handle is a ValueError / HTTP 400 naming
disaggregated_params; a failed transfer fails only its request. First on a tiny random model in one process,
then on the real default model: two `petrel serve` processes and `petrel route --prefill --decode`."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from petrel import LLM, DisaggregatedParams, SamplingParams
from petrel.disagg.kv_transfer import KVTransferError
from petrel.route import build_disagg_app
from petrel.serve.server import BackgroundServer
from tests.conftest import free_blocks
from tests.test_engine_loop_death import tokenizer_dir  # noqa: F401 - a fixture
from tests.test_router import MODEL, backends  # noqa: F401 - a fixture: two real servers

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 31 + i * 7) % 250 + 3 for i in range(n)]


def generation_only(ctx) -> DisaggregatedParams:
    return DisaggregatedParams(**{**ctx.disaggregated_params.to_dict(), "request_type": "generation_only"})


# ------------------------------------------------------------------------------------ tiny model, one process
@pytest.fixture(scope="module")
def pair(tiny, tokenizer_dir):  # noqa: F811
    path = tiny(2, False).path
    prefill = LLM(path, tokenizer=tokenizer_dir, kv_cache_memory=1 << 20, block_size=4, kv_transfer_timeout=0.5)
    decode = LLM(path, tokenizer=tokenizer_dir, kv_cache_memory=1 << 20, block_size=16)
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


def test_split_gives_the_tokens_of_one_instance_and_frees_every_block(pair):
    prefill, decode = pair
    prompts = [prompt(i, n) for i, n in enumerate((5, 17, 33))]    # block sizes 4 and 16: partial last blocks
    base_p, base_d = free_blocks(prefill), free_blocks(decode)
    reference = decode.generate(prompts, GREEDY, use_tqdm=False)
    contexts = prefill.generate(prompts, GREEDY, use_tqdm=False,
                                disaggregated_params=DisaggregatedParams(request_type="context_only"))
    assert free_blocks(prefill) < base_p                              # the prompts' KV is pinned
    for ctx, ref in zip(contexts, reference):
        dp = ctx.disaggregated_params
        assert ctx.outputs[0].token_ids == dp.first_gen_tokens == ref.outputs[0].token_ids[:1]
        assert dp.opaque_state and dp.ctx_info_endpoint == prefill.kv_transfer_endpoint and dp.ctx_request_id is not None
    outs = decode.generate(prompts, GREEDY, use_tqdm=False, disaggregated_params=[generation_only(c) for c in contexts])
    cfg = decode.engine.model_config
    for p, out, ref in zip(prompts, outs, reference):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids and out.outputs[0].text == ref.outputs[0].text
        assert out.kv_transfer.num_tokens == len(p)
        assert out.kv_transfer.num_bytes == cfg.num_hidden_layers * 2 * len(p) * cfg.num_key_value_heads * cfg.head_dim * 4
        assert out.kv_transfer.seconds > 0
    assert free_blocks(prefill) == base_p and free_blocks(decode) == base_d
    prefill.engine.call(lambda core: core.block_manager.check_integrity())
    with pytest.raises(ValueError, match="disaggregated_params.opaque_state"):     # a handle is fetched once
        decode.generate(prompts[0], GREEDY, disaggregated_params=generation_only(contexts[0]))


def test_unfetched_kv_expires(pair):
    prefill, decode = pair
    base = free_blocks(prefill)
    ctx = prefill.generate(prompt(7, 20), GREEDY, disaggregated_params=DisaggregatedParams(request_type="context_only"))
    assert free_blocks(prefill) < base
    deadline = time.monotonic() + 10
    while free_blocks(prefill) < base and time.monotonic() < deadline:
        time.sleep(0.1)
    assert free_blocks(prefill) == base
    with pytest.raises(ValueError, match="disaggregated_params.opaque_state.*expired"):
        decode.generate(prompt(7, 20), GREEDY, disaggregated_params=generation_only(ctx))


def test_bad_params_name_the_field_and_a_failed_transfer_fails_only_its_request(pair):
    prefill, decode = pair
    ids = prompt(3, 9)
    ctx = prefill.generate(ids, GREEDY, disaggregated_params=DisaggregatedParams(request_type="context_only"))
    good = generation_only(ctx)
    for change, field in (({"request_type": "decode_only"}, "request_type"), ({"opaque_state": None}, "opaque_state"),
                          ({"first_gen_tokens": []}, "first_gen_tokens"), ({"ctx_info_endpoint": "x"}, "ctx_info_endpoint"),
                          ({"draft_tokens": [5]}, "draft_tokens")):
        with pytest.raises(ValueError, match=f"disaggregated_params.{field}"):
            decode.generate(ids, GREEDY, disaggregated_params=DisaggregatedParams(**{**good.to_dict(), **change}))
    with pytest.raises(ValueError, match="disaggregated_params: a context_only request cannot have n > 1"):
        prefill.generate(ids, SamplingParams(n=2), disaggregated_params={"request_type": "context_only"})
    with pytest.raises(KVTransferError, match="127.0.0.1:1"):
        decode.generate(ids, GREEDY, disaggregated_params=DisaggregatedParams(**{**good.to_dict(),
                                                                                 "ctx_info_endpoint": "127.0.0.1:1"}))
    out = decode.generate(ids, GREEDY, disaggregated_params=good)     # the pin was untouched: it still works
    assert out.outputs[0].token_ids == decode.generate(ids, GREEDY).outputs[0].token_ids


# ------------------------------------------------------------------------------------ two real servers + the router
@pytest.fixture(scope="module")
def split_url(backends):  # noqa: F811
    (_, prefill_url), (_, decode_url) = backends
    with BackgroundServer(build_disagg_app(prefill_url, decode_url, health_interval=0.5)) as srv:
        yield srv.url


def _post(url: str, path: str, **body) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": MODEL, "temperature": 0, **body}, timeout=120, trust_env=False)


def _events(r: httpx.Response) -> list[dict]:
    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _kv_usage(url: str) -> float:
    metrics = httpx.get(f"{url}/metrics", trust_env=False).text
    return float(next(line.split()[-1] for line in metrics.splitlines() if line.startswith("petrel_kv_cache_usage_perc")))


@pytest.mark.e2e
def test_router_split_answers_as_one_server(split_url, backends):  # noqa: F811
    (_, prefill_url), (_, decode_url) = backends
    prompt_text = "Seabirds such as the petrel spend most of their lives"
    messages = [{"role": "user", "content": "Name three seabirds."}]
    for path, body, text_of in (
            ("/v1/completions", {"prompt": prompt_text, "max_tokens": 16}, lambda c: c["text"]),
            ("/v1/chat/completions", {"messages": messages, "max_tokens": 16}, lambda c: c["message"]["content"])):
        one = _post(decode_url, path, **body).json()
        split = _post(split_url, path, **body)
        assert split.status_code == 200 and split.headers["x-petrel-prefill"] == prefill_url
        answer = split.json()
        assert text_of(answer["choices"][0]) == text_of(one["choices"][0])
        assert answer["usage"]["completion_tokens"] == one["usage"]["completion_tokens"]
        transfer = answer["usage"]["kv_transfer"]
        assert transfer["tokens"] == one["usage"]["prompt_tokens"] and transfer["bytes"] > 0 and transfer["seconds"] > 0

        streamed = _events(_post(split_url, path, stream=True, stream_options={"include_usage": True}, **body))
        if path == "/v1/completions":
            text = "".join(e["choices"][0]["text"] for e in streamed if e["choices"])
        else:
            text = "".join(e["choices"][0]["delta"].get("content") or "" for e in streamed if e["choices"])
        assert text == text_of(one["choices"][0])
        assert streamed[-1]["usage"]["kv_transfer"]["tokens"] == one["usage"]["prompt_tokens"]
    # a request the split cannot serve (n = 2) goes whole to the decode server
    r = _post(split_url, "/v1/completions", prompt=prompt_text, max_tokens=4, n=2)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2 and "x-petrel-prefill" not in r.headers
    assert _kv_usage(prefill_url) == 0.0 and _kv_usage(decode_url) == 0.0     # nothing left pinned or running


@pytest.mark.e2e
def test_servers_refuse_a_spent_handle_and_report_a_failed_transfer(backends):  # noqa: F811
    (_, prefill_url), (_, decode_url) = backends
    body = {"prompt": "The albatross", "max_tokens": 8}
    ctx = _post(prefill_url, "/v1/completions", disaggregated_params={"request_type": "context_only"}, **body).json()
    params = dict(ctx["choices"][0]["disaggregated_params"], request_type="generation_only")
    assert _post(decode_url, "/v1/completions", disaggregated_params=params, **body).status_code == 200
    spent = _post(decode_url, "/v1/completions", disaggregated_params=params, **body)
    assert spent.status_code == 400 and spent.json()["error"]["param"] == "disaggregated_params"
    assert "expired" in spent.json()["error"]["message"]
    broken = _post(decode_url, "/v1/completions", **body,
                   disaggregated_params=dict(params, ctx_info_endpoint="127.0.0.1:1"))
    assert broken.status_code == 502 and broken.json()["error"]["param"] == "disaggregated_params"
    streaming = _post(prefill_url, "/v1/completions", stream=True, disaggregated_params={"request_type": "context_only"},
                      **body)
    assert streaming.status_code == 400 and streaming.json()["error"]["param"] == "disaggregated_params"
    assert _post(decode_url, "/v1/completions", **body).status_code == 200
