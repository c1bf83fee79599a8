"""Two engines on one shared KV store (a real redis-server; skipped without it): what the first computes, the second
fetches instead of recomputing, with the same greedy tokens and logprobs; a dkv_cache_hint prefetches the hinted
blocks of the request's own chain and ignores (and counts) the rest; another cache_salt or model never reuses a
block; the store going away mid-run degrades to recomputation with no failed request and no leaked block."""

from __future__ import annotations

import time

import pytest
from test_kv_store import server  # noqa: F401 - a fixture
from test_kv_tiers import (
    GREEDY,
    PROMPT,
    REUSED,
    _assert_same,
    _check_no_leak,
    _llm,
    _run,
    _tier_stats,
    model,  # noqa: F401 - a fixture
    recomputed,  # noqa: F401 - a fixture
)

from petrel.engine.sequence import EngineRequest, Sequence


def _store_stats(llm) -> tuple[dict, dict]:
    stats = _tier_stats(llm)
    return stats["all"], stats["store"]


def _published(llm, blocks: int, timeout: float = 10.0) -> None:
    """Wait until the engine's asynchronous puts have written `blocks` blocks to the store."""
    deadline = time.monotonic() + timeout
    while _store_stats(llm)[1]["puts"] < blocks:
        assert time.monotonic() < deadline, _store_stats(llm)
        time.sleep(0.05)


@pytest.fixture
def pair(model, tokenizer_dir, server):  # noqa: F811
    """(writer, reader, server): two engines of the same model on the store; the reader has no local tiers."""
    writer = _llm(model, tokenizer_dir, kv_store_url=server.url)
    reader = _llm(model, tokenizer_dir, kv_store_url=server.url)
    yield writer, reader, server
    writer.shutdown()
    reader.shutdown()


def test_a_second_engine_fetches_what_the_first_computed(pair, recomputed):  # noqa: F811
    writer, reader, _ = pair
    _assert_same(_run(writer), recomputed)
    _published(writer, REUSED)
    got = _run(reader)
    assert got[2] == REUSED * 4  # every reusable block came from the store: cached, not recomputed
    _assert_same(got, recomputed)
    chain, store = _store_stats(reader)
    assert chain["fetched_blocks"] == REUSED and chain["rejected_blocks"] == 0 and store["hits"] >= REUSED
    _check_no_leak(writer)
    _check_no_leak(reader)


def test_a_hint_prefetches_its_own_blocks_and_ignores_others(pair, recomputed):  # noqa: F811
    writer, reader, _ = pair
    _run(writer)
    _published(writer, REUSED)
    chain_hashes = reader.engine.call(lambda core: core.block_manager.prompt_block_hashes(_sequence(PROMPT)))
    foreign = ["ab" * 32, "cd" * 32]
    hint = {"block_hashes": [h.hex() for h in chain_hashes] + foreign}
    out = reader.generate(PROMPT, GREEDY, use_tqdm=False, dkv_cache_hint=hint)
    c = out.outputs[0]
    assert out.num_cached_tokens == REUSED * 4
    assert c.token_ids == recomputed[0]
    chain, _ = _store_stats(reader)
    assert chain["hint_prefetched_blocks"] == REUSED and chain["hint_ignored_hashes"] == len(foreign)
    _check_no_leak(reader)


def _sequence(prompt: list[int]) -> Sequence:
    """A sequence of the prompt as LLM.generate makes it (the hash chain's root: no salt, no adapter)."""
    return Sequence(EngineRequest("chain", list(prompt), GREEDY), 0, list(prompt), len(prompt))


def test_another_cache_salt_never_reuses_store_blocks(pair):
    writer, reader, _ = pair
    _run(writer)
    _published(writer, REUSED)
    got = reader.generate(PROMPT, GREEDY, use_tqdm=False, cache_salt="tenant-b")
    assert got.num_cached_tokens == 0
    assert _store_stats(reader)[0]["fetched_blocks"] == 0


def test_another_model_never_reuses_store_blocks(model, tiny, tokenizer_dir, server, recomputed):  # noqa: F811
    other = tiny(2, False, seed=1)  # the same shapes, other weights: same hashes, another fingerprint
    writer = _llm(model, tokenizer_dir, kv_store_url=server.url)
    reader = _llm(other, tokenizer_dir, kv_store_url=server.url)
    try:
        _run(writer)
        _published(writer, REUSED)
        got = _run(reader)
        assert got[2] == 0 and _store_stats(reader)[0]["fetched_blocks"] == 0
    finally:
        writer.shutdown()
        reader.shutdown()


def test_the_store_going_away_degrades_to_recomputation(pair, recomputed):  # noqa: F811
    writer, reader, srv = pair
    _run(writer)
    _published(writer, REUSED)
    srv.kill()
    got = _run(reader)  # no store: recomputed, not failed
    assert got[2] == 0
    _assert_same(got, recomputed)
    again = _run(writer, [t + 1 for t in PROMPT])  # publishing into a dead store drops, never fails
    assert len(again[0]) == GREEDY.max_tokens
    _check_no_leak(writer)
    _check_no_leak(reader)
