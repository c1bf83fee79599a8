"""The shared KV block store on a real redis-server (started here on a free port; skipped without it) and the
dkv_cache_hint: its validation on TextGenerationRequest, LLM and the HTTP server, its way to the engine request, and
plan_hinted_fetch, which fetches only hinted blocks of the request's own hash chain."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import socket
import subprocess
import time

import pytest

from petrel import SamplingParams, TextGenerationRequest
from petrel.config import EngineConfig
from petrel.engine.block_manager import BlockManager
from petrel.engine.sequence import EngineRequest, Sequence
from petrel.kv_tiers.dkv_hint import MAX_HINT_HASHES, DkvHint, parse_dkv_cache_hint, plan_hinted_fetch

STORE_LOGGER = "petrel.kv_tiers.redis_store"


# ------------------------------------------------------------------------------------------ a real redis-server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server on 127.0.0.1:port with no persistence, that a test may stop and start again."""

    def __init__(self, tmp_path):
        self.port, self.dir, self.proc = _free_port(), str(tmp_path), None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", self.dir]
        self.proc = subprocess.Popen(["redis-server", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def raw(self):
        import redis

        return redis.Redis.from_url(self.url)


@pytest.fixture
def server(tmp_path):
    pytest.importorskip("redis")
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    srv = RedisServer(tmp_path)
    srv.start()
    yield srv
    if srv.proc.poll() is None:
        srv.kill()


@pytest.fixture
def make_store(server):
    from petrel.kv_tiers.redis_store import RedisBlockStore

    stores = []

    def make(**options):
        store = RedisBlockStore(options.pop("url", server.url), **options)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def _key(i: int) -> bytes:
    return hashlib.sha256(f"block {i}".encode()).digest()


# ------------------------------------------------------------------------------------------ the store
def test_put_get_round_trip(make_store):
    store = make_store()
    blobs = {_key(0): os.urandom(1 << 20), _key(1): b"", _key(2): bytes(range(256)) * 3}
    for key, blob in blobs.items():
        store.put(key, blob)
    assert store.flush(10)
    for key, blob in blobs.items():
        assert store.get(key) == blob
        assert store.contains(key)
    assert store.get(_key(3)) is None and not store.contains(_key(3))
    assert store.get_many([_key(0), _key(3), _key(2)]) == [blobs[_key(0)], None, blobs[_key(2)]]
    stats = store.stats()
    size = sum(map(len, blobs.values()))
    assert stats["puts"] == 3 and stats["bytes_in"] == size
    assert stats["hits"] == 5 and stats["misses"] == 2
    assert stats["bytes_out"] == size + len(blobs[_key(0)]) + len(blobs[_key(2)])
    assert stats["dropped"] == 0 and stats["errors"] == 0
    assert store.name == "store"


def test_keys_are_namespaced(make_store, server):
    a, b = make_store(), make_store(namespace="petrel:kv:other-model")
    a.put(_key(0), b"from a")
    assert a.flush(10)
    assert server.raw().get(f"petrel:kv:{_key(0).hex()}") == b"from a"
    assert server.raw().keys("*") == [f"petrel:kv:{_key(0).hex()}".encode()]
    assert b.get(_key(0)) is None and not b.contains(_key(0))
    b.put(_key(0), b"from b")
    assert b.flush(10)
    assert a.get(_key(0)) == b"from a" and b.get(_key(0)) == b"from b"


def test_ttl_and_max_value_size(make_store, server):
    store = make_store(ttl_s=30, max_value_bytes=100)
    store.put(_key(0), b"x" * 100)
    store.put(_key(1), b"x" * 101)  # too large: dropped, never written
    assert store.flush(10)
    assert 0 < server.raw().pttl(f"petrel:kv:{_key(0).hex()}") <= 30_000
    assert store.get(_key(1)) is None and store.stats()["dropped"] == 1 and store.stats()["puts"] == 1
    with pytest.raises(ValueError, match="ttl_s"):
        make_store(ttl_s=0)


@pytest.mark.parametrize("bound", ["puts", "bytes"])
def test_bounded_async_puts_drop_and_count(make_store, server, bound):
    """With the server paused for writes, put() never waits: past the queue's bound puts are dropped and counted,
    and what was queued is written once the server takes writes again."""
    limits = {"max_pending_puts": 4} if bound == "puts" else {"max_pending_bytes": 4 * 1000}
    store = make_store(**limits)
    raw = server.raw()
    raw.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")
    try:
        start = time.monotonic()
        for i in range(50):
            store.put(_key(i), bytes([i]) * 1000)
        elapsed = time.monotonic() - start
        queued = store.pending_puts
    finally:
        raw.execute_command("CLIENT", "UNPAUSE")
    assert elapsed < 1.0  # no put waited on the paused server
    assert store.flush(10)
    stats = store.stats()
    written = sum(store.get(_key(i)) is not None for i in range(50))
    assert 1 <= queued <= 5 and written == stats["puts"] <= 5  # the bound, plus the one the writer held
    assert stats["dropped"] == 50 - stats["puts"] and stats["errors"] == 0


def test_server_gone_degrades_and_comes_back(make_store, server, caplog):
    store = make_store(backoff_s=0.05, max_backoff_s=0.2)
    store.put(_key(0), b"before")
    assert store.flush(10) and store.get(_key(0)) == b"before"
    server.kill()
    with caplog.at_level(logging.INFO, logger=STORE_LOGGER):
        dropped = store.stats()["dropped"]
        for i in range(20):  # nothing raises, nothing waits long
            start = time.monotonic()
            assert store.get(_key(0)) is None
            assert not store.contains(_key(0))
            store.put(_key(i), b"during")
            assert time.monotonic() - start < 1.0
            time.sleep(0.01)
        assert store.flush(10)
        assert not store.available
        stats = store.stats()
        assert stats["dropped"] - dropped == 20 and stats["errors"] >= 1 and stats["puts"] == 1
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "unreachable" in warnings[0].getMessage()
        assert f":{server.port}" in warnings[0].getMessage()

        server.start()  # the same port, empty: the store reconnects after its backoff
        deadline = time.monotonic() + 10
        while not store.contains(_key(99)) and time.monotonic() < deadline:
            if store.available:
                store.put(_key(99), b"after")
                store.flush(5)
            time.sleep(0.05)
        assert store.available and store.get(_key(99)) == b"after"
        assert any("reachable again" in r.getMessage() for r in caplog.records)
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_bad_urls_are_refused():
    pytest.importorskip("redis")
    from petrel.kv_tiers.redis_store import RedisBlockStore, _redacted

    with pytest.raises(ValueError, match="kv_store_url"):
        RedisBlockStore("http://localhost:6379")
    with pytest.raises(ValueError, match="kv_store_url"):
        EngineConfig(kv_store_url="http://localhost:6379")
    assert EngineConfig(kv_store_url="redis://h:1/0").kv_store_url == "redis://h:1/0"
    assert "secret" not in repr(EngineConfig(kv_store_url="redis://:secret@h:1/0"))
    assert _redacted("redis://user:secret@h:1/0") == "redis://user:***@h:1/0"


def test_unreachable_at_start_never_raises(make_store):
    store = make_store(url=f"redis://127.0.0.1:{_free_port()}/0", backoff_s=0.05)
    store.put(_key(0), b"x")
    assert store.flush(10)
    assert store.get(_key(0)) is None and store.stats()["dropped"] == 1 and not store.available


# ------------------------------------------------------------------------------------------ dkv_cache_hint
HEX = [_key(i).hex() for i in range(3)]
BAD_HINTS = [
    ([HEX[0]], "must be an object"),
    ("hint", "must be an object"),
    ({"blocks": HEX}, "unknown key.*'blocks'"),
    ({"block_hashes": HEX, "tokens": 3}, "unknown key.*'tokens'"),
    ({"block_hashes": HEX[0]}, "block_hashes must be a list"),
    ({"block_hashes": [1]}, r"block_hashes\[0\]"),
    ({"block_hashes": [HEX[0], HEX[1][:-1]]}, r"block_hashes\[1\].*64 hex digits"),
    ({"block_hashes": ["zz" * 32]}, r"block_hashes\[0\]"),
    ({"block_hashes": [HEX[0]] * (MAX_HINT_HASHES + 1)}, f"at most {MAX_HINT_HASHES}"),
    ({"num_cached_tokens": -1}, "num_cached_tokens"),
    ({"num_cached_tokens": True}, "num_cached_tokens"),
    ({"num_cached_tokens": "16"}, "num_cached_tokens"),
]


@pytest.mark.parametrize(("hint", "message"), BAD_HINTS)
def test_bad_hints_are_refused_naming_dkv_cache_hint(hint, message):
    for check in (parse_dkv_cache_hint, lambda h: TextGenerationRequest("r", prompt="x", dkv_cache_hint=h)):
        with pytest.raises(ValueError, match="dkv_cache_hint") as exc:
            check(hint)
        assert exc.match(message)


def test_good_hints_parse():
    assert parse_dkv_cache_hint(None) is None
    assert parse_dkv_cache_hint({}) == DkvHint()
    hint = parse_dkv_cache_hint({"block_hashes": [HEX[1], HEX[0].upper(), HEX[1]], "num_cached_tokens": 40})
    assert hint.block_keys == (_key(1), _key(0)) and hint.num_cached_tokens == 40 and hint.hinted_blocks(16) == 2
    req = TextGenerationRequest("r", prompt="x", dkv_cache_hint={"block_hashes": HEX})
    assert req.dkv_cache_hint == {"block_hashes": HEX}


def _chain(ids: list[int], block_size: int, cache_salt: str | None = None, seed: str = "") -> list[bytes]:
    """The engine's own hash chain of a prompt's full blocks (the block manager computes it)."""
    bm = BlockManager(num_blocks=4, block_size=block_size, hash_seed=seed)
    seq = Sequence(EngineRequest("r", ids, SamplingParams(), cache_salt=cache_salt), 0, ids, len(ids))
    bm._extend_hashes(seq, len(ids) // block_size)
    return list(seq.block_hashes)


def test_plan_hinted_fetch_keeps_the_requests_own_chain():
    ids = list(range(40))
    chain = _chain(ids, 8)  # 5 full blocks
    other_salt = _chain(ids, 8, cache_salt="tenant b")
    other_prompt = _chain([1, *ids[1:]], 8)
    assert len(set(chain) & set(other_salt + other_prompt)) == 0
    # hinted out of order, repeated, mixed with blocks of another salt and another prompt, and a made-up one
    hinted = [chain[3], other_salt[0], chain[1], chain[3], other_prompt[2], _key(7)]
    assert plan_hinted_fetch(chain, hinted) == ([chain[1], chain[3]], 3)
    # num_cached_tokens covers the first blocks; the hashes add to them
    assert plan_hinted_fetch(chain, [chain[4]], num_hinted_blocks=2) == ([chain[0], chain[1], chain[4]], 0)
    assert plan_hinted_fetch(chain, [], num_hinted_blocks=99) == (chain, 0)
    assert plan_hinted_fetch(chain, other_salt) == ([], len(other_salt))  # isolation: another salt's chain
    assert plan_hinted_fetch(_chain(ids, 8, seed="deployment b"), chain) == ([], len(chain))
    assert plan_hinted_fetch([], chain[:2], num_hinted_blocks=3) == ([], 2)


# ------------------------------------------------------------------------------------------ the hint's way in
@pytest.fixture(scope="module")
def tiny_llm(tiny, tokenizer_dir):
    from petrel import LLM

    engine = LLM(tiny(2, False).path, tokenizer=tokenizer_dir, kv_cache_memory=1 << 20)
    yield engine
    engine.shutdown()


@pytest.fixture
def engine_requests(tiny_llm, monkeypatch):
    """The request options each add_request call got."""
    seen = []
    add = tiny_llm.engine.add_request

    def record(*args, **options):
        seen.append(options)
        return add(*args, **options)

    monkeypatch.setattr(tiny_llm.engine, "add_request", record)
    return seen


def test_the_hint_reaches_the_engine_request(tiny_llm, engine_requests):
    greedy = SamplingParams(temperature=0, max_tokens=2)
    hint = {"block_hashes": HEX[:2], "num_cached_tokens": 16}
    tiny_llm.generate(TextGenerationRequest("a", prompt=list(range(20)), sampling_params=greedy, dkv_cache_hint=hint))
    tiny_llm.generate(list(range(20)), greedy, use_tqdm=False, dkv_cache_hint=hint)
    tiny_llm.generate([list(range(20))] * 2, greedy, use_tqdm=False, dkv_cache_hint=[None, {"num_cached_tokens": 3}])
    tiny_llm.generate(list(range(20)), greedy, use_tqdm=False)
    got = [(o.get("kv_hint_keys"), o.get("kv_hint_tokens")) for o in engine_requests]
    assert got == [((_key(0), _key(1)), 16)] * 2 + [(None, None), ((), 3), (None, None)]
    with pytest.raises(ValueError, match="dkv_cache_hint"):
        tiny_llm.generate(list(range(20)), greedy, use_tqdm=False, dkv_cache_hint={"blocks": []})
    with pytest.raises(ValueError, match="dkv_cache_hint has 1 entries for 2 prompts"):
        tiny_llm.generate([[1, 2], [3]], greedy, use_tqdm=False, dkv_cache_hint=[{}])


@pytest.fixture(scope="module")
def http(tiny_llm):
    from fastapi.testclient import TestClient

    from petrel.serve.app import build_app

    with TestClient(build_app(tiny_llm, "tiny")) as client:
        yield client


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    "hint",
    [[HEX[0]], "x", {"blocks": HEX}, {"block_hashes": ["ab"]}, {"block_hashes": [HEX[0]] * (MAX_HINT_HASHES + 1)},
     {"num_cached_tokens": -1}, {"num_cached_tokens": "3"}],
)  # fmt: skip
def test_the_server_refuses_bad_hints_naming_dkv_cache_hint(http, path, hint):
    body = {"prompt": [1, 2, 3]} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = http.post(path, json={**body, "max_tokens": 1, "dkv_cache_hint": hint})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith("dkv_cache_hint") and error["type"] == "invalid_request_error"


def test_the_server_passes_the_hint_on(http, engine_requests):
    hint = {"block_hashes": HEX[:1], "num_cached_tokens": 8}
    r = http.post("/v1/completions", json={"prompt": list(range(20)), "max_tokens": 1, "dkv_cache_hint": hint})
    assert r.status_code == 200, r.text
    r = http.post("/v1/completions", json={"prompt": list(range(20)), "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert [(o.get("kv_hint_keys"), o.get("kv_hint_tokens")) for o in engine_requests] == [
        ((_key(0),), 8),
        (None, None),
    ]


def test_serve_flag_sets_kv_store_url(monkeypatch):
    import argparse

    from petrel.serve.server import add_arguments, engine_options

    monkeypatch.delenv("PETREL_KV_STORE_URL", raising=False)
    parser = add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--kv-store-url", "redis://127.0.0.1:6390/1"])
    assert engine_options(args)["kv_store_url"] == "redis://127.0.0.1:6390/1"
    assert "kv_store_url" not in engine_options(parser.parse_args([]))
