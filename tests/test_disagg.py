"""Disaggregated serving: prefill (context_only) on one instance, decode (generation_only) on another, the
prompt's KV moved over TCP. The greedy tokens equal one instance doing both; pinned blocks return to the pool
after the fetch and after expiry; a bad or expired handle is a ValueError / HTTP 400 naming
disaggregated_params; a failed transfer fails only its request.

None of it is open by default or to anyone: a plain instance refuses split requests; a decode instance fetches
only from its configured peers, never connecting elsewhere; a fetch proves it knows the shared secret; a peer's
answer is read only as large as the prompt's KV; pins and fetches are capped, and fetches hanging on a slow peer
leave /health answering. First on a tiny random model in one process (behind petrel's app and router too), then
on the real default model: two `petrel serve` processes and `petrel route --prefill --decode`."""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from petrel import LLM, DisaggregatedParams, SamplingParams
from petrel.bench.processes import free_port as _free_port
from petrel.bench.serve import start_server
from petrel.disagg import KVTransferBusy
from petrel.disagg.kv_transfer import MAX_CONNECTIONS, KVTransferError, fetch_kv
from petrel.route import build_disagg_app
from petrel.serve.app import build_app
from petrel.serve.server import BackgroundServer
from tests.conftest import free_blocks
from tests.test_router import MODEL

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SECRET = "test-kv-transfer-secret"
CONTEXT_ONLY = DisaggregatedParams(request_type="context_only")


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 31 + i * 7) % 250 + 3 for i in range(n)]


def generation_only(ctx) -> DisaggregatedParams:
    return DisaggregatedParams(**{**ctx.disaggregated_params.to_dict(), "request_type": "generation_only"})


def fake_generation_only(endpoint: str) -> DisaggregatedParams:
    """A generation_only request whose KV is to come from `endpoint` (a FakePeer)."""
    return DisaggregatedParams(
        request_type="generation_only", first_gen_tokens=[5], opaque_state="ab" * 16, ctx_info_endpoint=endpoint
    )


def answer(header: dict, data: bytes = b"") -> bytes:
    """What a KV transfer server sends: the header's length, the header, the tensor's bytes."""
    raw = json.dumps(header).encode()
    return struct.pack(">I", len(raw)) + raw + data


class FakePeer:
    """A TCP listener standing in for a context instance: it counts the connections it gets and, after reading
    each one's request line, sends `reply` and keeps the connection open until release() (reply None: it sends
    nothing; b"": it closes the connection at once)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self.requests: list[bytes] = []
        self.reply: bytes | None = None
        self._held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            self.requests.append(conn.makefile("rb").readline())
            if self.reply == b"":
                conn.close()
                continue
            if self.reply is not None:
                conn.sendall(self.reply)
            self._held.append(conn)

    def wait_for(self, connections: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.connections < connections and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.connections >= connections, f"{self.connections} connections, expected {connections}"

    def release(self) -> None:
        for conn in self._held:
            conn.close()
        self._held.clear()

    def close(self) -> None:
        self.release()
        self.sock.close()


# ------------------------------------------------------------------------------------ tiny model, one process
@pytest.fixture(scope="module")
def fake():
    peer = FakePeer()
    yield peer
    peer.close()


@pytest.fixture(scope="module")
def tiny_path(tiny):
    return tiny(2, False).path


@pytest.fixture(scope="module")
def pair(tiny_path, tokenizer_dir, fake):  # noqa: F811
    """A prefill and a decode instance; the decode one's peers are the prefill one and `fake`."""
    prefill = LLM(
        tiny_path,
        tokenizer=tokenizer_dir,
        kv_cache_memory=1 << 20,
        block_size=4,
        kv_transfer_timeout=2,
        kv_transfer_role="prefill",
        kv_transfer_secret=SECRET,
    )
    decode = LLM(
        tiny_path,
        tokenizer=tokenizer_dir,
        kv_cache_memory=1 << 20,
        block_size=16,
        kv_transfer_timeout=5,
        kv_transfer_role="decode",
        kv_transfer_secret=SECRET,
        kv_transfer_peers=[prefill.kv_transfer_endpoint, fake.endpoint],
    )
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


@pytest.fixture(scope="module")
def plain(tiny_path, tokenizer_dir):  # noqa: F811
    llm = LLM(tiny_path, tokenizer=tokenizer_dir, kv_cache_memory=1 << 20)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def capped(tiny_path, tokenizer_dir):  # noqa: F811
    """A prefill instance with 64 blocks of 4 tokens, at most 3 prompts and 16 blocks (a quarter) pinned."""
    llm = LLM(
        tiny_path,
        tokenizer=tokenizer_dir,
        kv_cache_memory=64 * 2048,
        block_size=4,
        kv_transfer_timeout=1,
        kv_transfer_role="prefill",
        kv_transfer_secret=SECRET,
        kv_transfer_max_pinned=3,
    )
    assert llm.engine.core.block_manager.num_blocks == 64
    yield llm
    llm.shutdown()


def test_split_gives_the_tokens_of_one_instance_and_frees_every_block(pair):
    prefill, decode = pair
    prompts = [prompt(i, n) for i, n in enumerate((5, 17, 33))]  # block sizes 4 and 16: partial last blocks
    base_p, base_d = free_blocks(prefill), free_blocks(decode)
    reference = decode.generate(prompts, GREEDY, use_tqdm=False)
    contexts = prefill.generate(prompts, GREEDY, use_tqdm=False, disaggregated_params=CONTEXT_ONLY)
    assert free_blocks(prefill) < base_p  # the prompts' KV is pinned
    for ctx, ref in zip(contexts, reference):
        dp = ctx.disaggregated_params
        assert ctx.outputs[0].token_ids == dp.first_gen_tokens == ref.outputs[0].token_ids[:1]
        assert (
            dp.opaque_state and dp.ctx_info_endpoint == prefill.kv_transfer_endpoint and dp.ctx_request_id is not None
        )
    outs = decode.generate(prompts, GREEDY, use_tqdm=False, disaggregated_params=[generation_only(c) for c in contexts])
    cfg = decode.engine.model_config
    for p, out, ref in zip(prompts, outs, reference):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids and out.outputs[0].text == ref.outputs[0].text
        assert out.kv_transfer.num_tokens == len(p)
        assert (
            out.kv_transfer.num_bytes == cfg.num_hidden_layers * 2 * len(p) * cfg.num_key_value_heads * cfg.head_dim * 4
        )
        assert out.kv_transfer.seconds > 0
    assert free_blocks(prefill) == base_p and free_blocks(decode) == base_d
    assert prefill.engine.core.pinned.held == (0, 0)  # no room left reserved either
    prefill.engine.call(lambda core: core.block_manager.check_integrity())
    with pytest.raises(ValueError, match="disaggregated_params.opaque_state"):  # a handle is fetched once
        decode.generate(prompts[0], GREEDY, disaggregated_params=generation_only(contexts[0]))


def test_unfetched_kv_expires(pair):
    prefill, decode = pair
    base = free_blocks(prefill)
    ctx = prefill.generate(prompt(7, 20), GREEDY, disaggregated_params=CONTEXT_ONLY)
    assert free_blocks(prefill) < base
    deadline = time.monotonic() + 10
    while free_blocks(prefill) < base and time.monotonic() < deadline:
        time.sleep(0.1)
    assert free_blocks(prefill) == base and prefill.engine.core.pinned.held == (0, 0)
    with pytest.raises(ValueError, match="disaggregated_params.opaque_state.*expired"):
        decode.generate(prompt(7, 20), GREEDY, disaggregated_params=generation_only(ctx))


def test_bad_params_name_the_field_and_a_failed_transfer_fails_only_its_request(pair, fake):
    prefill, decode = pair
    ids = prompt(3, 9)
    ctx = prefill.generate(ids, GREEDY, disaggregated_params=CONTEXT_ONLY)
    good = generation_only(ctx)
    for change, field in (
        ({"request_type": "decode_only"}, "request_type"),
        ({"opaque_state": None}, "opaque_state"),
        ({"first_gen_tokens": []}, "first_gen_tokens"),
        ({"ctx_info_endpoint": "x"}, "ctx_info_endpoint"),
        ({"draft_tokens": [5]}, "draft_tokens"),
    ):
        with pytest.raises(ValueError, match=f"disaggregated_params.{field}"):
            decode.generate(ids, GREEDY, disaggregated_params=DisaggregatedParams(**{**good.to_dict(), **change}))
    with pytest.raises(ValueError, match="disaggregated_params: a context_only request cannot have n > 1"):
        prefill.generate(ids, SamplingParams(n=2), disaggregated_params={"request_type": "context_only"})
    fake.reply = b""  # a peer that takes the request and closes: the transfer fails
    with pytest.raises(KVTransferError, match=fake.endpoint):
        decode.generate(
            ids,
            GREEDY,
            disaggregated_params=DisaggregatedParams(**{**good.to_dict(), "ctx_info_endpoint": fake.endpoint}),
        )
    fake.release()
    out = decode.generate(ids, GREEDY, disaggregated_params=good)  # the pin was untouched: it still works
    assert out.outputs[0].token_ids == decode.generate(ids, GREEDY).outputs[0].token_ids


def test_a_plain_instance_refuses_split_requests_and_serves_no_kv(plain, pair):
    prefill, decode = pair
    assert plain.kv_transfer_endpoint is None and decode.kv_transfer_endpoint is None
    ids = prompt(4, 9)
    ctx = prefill.generate(ids, GREEDY, disaggregated_params=CONTEXT_ONLY)
    base = free_blocks(plain)
    for llm, dp, refusal in (
        (plain, CONTEXT_ONLY, "off on this instance.*kv_transfer_role"),
        (plain, generation_only(ctx), "off on this instance.*kv_transfer_role"),
        (decode, CONTEXT_ONLY, "request_type: this instance's kv_transfer_role is 'decode'"),
        (prefill, generation_only(ctx), "request_type: this instance's kv_transfer_role is 'prefill'"),
    ):
        with pytest.raises(ValueError, match=f"disaggregated_params.*{refusal}"):
            llm.generate(ids, GREEDY, disaggregated_params=dp)
    assert free_blocks(plain) == base and plain.engine.core.pinned.held == (0, 0)
    with BackgroundServer(build_app(plain)) as srv:  # the server: a 400 naming the field
        for dp in ({"request_type": "context_only"}, generation_only(ctx).to_dict()):
            r = httpx.post(
                f"{srv.url}/v1/completions",
                trust_env=False,
                timeout=30,
                json={"prompt": ids, "max_tokens": 4, "disaggregated_params": dp},
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "disaggregated_params"
            assert "--kv-transfer-role" in r.json()["error"]["message"]
    assert decode.generate(ids, GREEDY, disaggregated_params=generation_only(ctx)).outputs[0].token_ids


def test_an_endpoint_outside_the_peers_is_refused_without_connecting(pair):
    _, decode = pair
    outsider = FakePeer()  # listening, but not among the decode instance's peers
    try:
        outsider.reply = answer({"ok": False, "error": "unknown"})
        with pytest.raises(ValueError, match="ctx_info_endpoint.*not one of this instance's prefill peers"):
            decode.generate(prompt(5, 9), GREEDY, disaggregated_params=fake_generation_only(outsider.endpoint))
        time.sleep(0.3)  # a connection, had one been made, is accepted by now
        assert outsider.connections == 0
    finally:
        outsider.close()
    with BackgroundServer(build_app(decode)) as srv:
        r = httpx.post(
            f"{srv.url}/v1/completions",
            trust_env=False,
            timeout=30,
            json={
                "prompt": prompt(5, 9),
                "max_tokens": 4,
                "disaggregated_params": fake_generation_only("10.255.255.1:6379").to_dict(),
            },
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "disaggregated_params"


def test_a_fetch_without_the_secret_is_refused_and_leaves_the_pin(pair):
    prefill, decode = pair
    ids = prompt(6, 13)
    ctx = generation_only(prefill.generate(ids, GREEDY, disaggregated_params=CONTEXT_ONLY))
    cfg = decode.engine.model_config
    shape = (cfg.num_hidden_layers, 2, len(ids), cfg.num_key_value_heads, cfg.head_dim)
    with pytest.raises(KVTransferError, match="kv_transfer_secret differ"):
        fetch_kv(ctx.ctx_info_endpoint, ctx.opaque_state, "not-the-secret", shape, timeout=5)
    host, _, port = ctx.ctx_info_endpoint.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:  # the handle alone, no proof of the secret
        sock.sendall(json.dumps({"handle": ctx.opaque_state}).encode() + b"\n")
        reply = sock.makefile("rb").read()
    assert b'"ok": false' in reply and b"dtype" not in reply
    out = decode.generate(ids, GREEDY, disaggregated_params=ctx)  # the right secret still gets it
    assert out.outputs[0].token_ids == decode.generate(ids, GREEDY).outputs[0].token_ids


def test_the_transfer_server_holds_a_bounded_number_of_connections(pair):
    prefill, decode = pair
    ids = prompt(12, 9)
    ctx = generation_only(prefill.generate(ids, GREEDY, disaggregated_params=CONTEXT_ONLY))
    host, _, port = ctx.ctx_info_endpoint.rpartition(":")
    idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.3)  # each one has its thread, waiting for a request line
        assert not _answered(ctx.ctx_info_endpoint)  # one more is closed unanswered: no thread for it
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 10  # closed, they give their threads back
    while not _answered(ctx.ctx_info_endpoint) and time.monotonic() < deadline:
        time.sleep(0.05)
    out = decode.generate(ids, GREEDY, disaggregated_params=ctx)
    assert out.outputs[0].token_ids == decode.generate(ids, GREEDY).outputs[0].token_ids


def _answered(endpoint: str) -> bool:
    """Whether the transfer server answers a malformed request (it had a thread for the connection)."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(b"not json\n")
            return sock.recv(1) != b""
    except OSError:
        return False


def test_a_peer_claiming_a_huge_tensor_is_refused_before_anything_is_allocated(pair, fake):
    _, decode = pair
    ids = prompt(8, 9)
    huge = [30, 2, 4096, 32, 64]  # 2 GiB of float32 claimed for a 9-token prompt
    fake.reply = answer({"ok": True, "dtype": "float32", "shape": huge})  # ...and then nothing: the bytes never come
    try:
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="KV of another shape than this model and prompt need"):
            decode.generate(ids, GREEDY, disaggregated_params=fake_generation_only(fake.endpoint))
        assert time.monotonic() - t0 < 2  # refused on the header: it neither waited for 2 GiB nor allocated them
        fake.reply = answer({"ok": True, "dtype": "object", "shape": [2, 2, 9, 2, 16]})
        with pytest.raises(KVTransferError, match="did not answer as a petrel KV transfer server"):
            decode.generate(ids, GREEDY, disaggregated_params=fake_generation_only(fake.endpoint))
        fake.reply = answer({"ok": False, "error": "<html>internal admin page: password=hunter2</html>"})
        with pytest.raises(KVTransferError) as refused:
            decode.generate(ids, GREEDY, disaggregated_params=fake_generation_only(fake.endpoint))
        assert "hunter2" not in str(refused.value) and "refused the KV transfer" in str(refused.value)
        assert all(json.loads(line)["mac"] for line in fake.requests[-3:])  # every fetch carried its proof
    finally:
        fake.release()


def test_pins_are_capped_in_prompts_and_in_blocks(capped):
    pinned = capped.engine.core.pinned
    base = free_blocks(capped)
    short = [prompt(20 + i, 10) for i in range(4)]  # 3 blocks each: the prompt cap (3) decides
    contexts = capped.generate(short[:3], GREEDY, use_tqdm=False, disaggregated_params=CONTEXT_ONLY)
    assert all(c.disaggregated_params.opaque_state for c in contexts) and pinned.held == (3, 9)
    with pytest.raises(KVTransferBusy, match="kv_transfer_max_pinned"):
        capped.generate(short[3], GREEDY, disaggregated_params=CONTEXT_ONLY)
    assert free_blocks(capped) == base - 9  # the refused request queued nothing
    _wait_until_unpinned(capped, base)

    long = [prompt(30 + i, 30) for i in range(3)]  # 8 blocks each: the block cap (16) decides
    capped.generate(long[:2], GREEDY, use_tqdm=False, disaggregated_params=CONTEXT_ONLY)
    with pytest.raises(KVTransferBusy, match="16 of its 64 blocks"):
        capped.generate(long[2], GREEDY, disaggregated_params=CONTEXT_ONLY)
    with pytest.raises(ValueError, match="more than may be pinned"):  # never fits: a 400, not a retry
        capped.generate(prompt(40, 70), GREEDY, disaggregated_params=CONTEXT_ONLY)
    _wait_until_unpinned(capped, base)
    one = capped.generate(short[0], SamplingParams(max_tokens=1), disaggregated_params=CONTEXT_ONLY)
    assert one.disaggregated_params is None and pinned.held == (0, 0)  # ended by its first token: no pin, no room held
    capped.engine.call(lambda core: core.block_manager.check_integrity())


def _wait_until_unpinned(llm, base: int) -> None:
    deadline = time.monotonic() + 10
    while llm.engine.core.pinned.held != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert llm.engine.core.pinned.held == (0, 0) and free_blocks(llm) == base


def test_health_answers_while_fetches_hang_on_a_slow_peer(pair, fake):
    _, decode = pair
    max_fetches = decode.config.kv_transfer_max_fetches
    # more requests than the threads asyncio's default executor has: fetches there would leave none for /health
    num_requests = min(32, (os.cpu_count() or 1) + 4) + 2
    fake.reply = None  # it takes each request and never answers
    body = {
        "prompt": prompt(9, 9),
        "max_tokens": 4,
        "disaggregated_params": fake_generation_only(fake.endpoint).to_dict(),
    }
    connections = fake.connections
    with BackgroundServer(build_app(decode)) as srv, ThreadPoolExecutor(num_requests) as clients:
        post = lambda: httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60, trust_env=False)  # noqa: E731
        try:
            pending = [clients.submit(post) for _ in range(num_requests)]
            fake.wait_for(connections + max_fetches)
            t0 = time.monotonic()
            health = httpx.get(f"{srv.url}/health", timeout=10, trust_env=False)
            health_seconds = time.monotonic() - t0
            assert health.status_code == 200 and health_seconds < 2, health_seconds
            deadline = time.monotonic() + 10
            while sum(f.done() for f in pending) < num_requests - max_fetches and time.monotonic() < deadline:
                time.sleep(0.02)
            refused = [f.result() for f in pending if f.done()]
            assert len(refused) == num_requests - max_fetches
            assert all(r.status_code == 429 and r.json()["error"]["param"] == "disaggregated_params" for r in refused)
            assert fake.connections == connections + max_fetches  # the refused ones never connected
        finally:
            fake.release()
        codes = sorted(f.result(timeout=30).status_code for f in pending)
    assert codes == [429] * (num_requests - max_fetches) + [502] * max_fetches


def test_router_splits_over_the_roles_and_sends_an_unpinnable_request_whole(pair, capped):
    prefill, decode = pair
    ids = prompt(11, 17)
    body = {"prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with (
        BackgroundServer(build_app(prefill)) as p_srv,
        BackgroundServer(build_app(capped)) as c_srv,
        BackgroundServer(build_app(decode)) as d_srv,
    ):
        one = httpx.post(f"{d_srv.url}/v1/completions", json=body, timeout=60, trust_env=False).json()
        with BackgroundServer(build_disagg_app(p_srv.url, d_srv.url, health_interval=0.5)) as router:
            split = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60, trust_env=False)
        assert split.status_code == 200 and split.headers["x-petrel-prefill"] == p_srv.url
        assert split.json()["choices"][0]["text"] == one["choices"][0]["text"]
        assert split.json()["usage"]["kv_transfer"]["tokens"] == len(ids)

        held = [capped.engine.core.pinned.reserve(10, 3, 16) for _ in range(3)]  # its pin cap is reached
        try:
            full = httpx.post(
                f"{c_srv.url}/v1/completions",
                trust_env=False,
                timeout=60,
                json={**body, "disaggregated_params": CONTEXT_ONLY.to_dict()},
            )
            assert full.status_code == 429 and full.json()["error"]["param"] == "disaggregated_params"
            with BackgroundServer(build_disagg_app(c_srv.url, d_srv.url, health_interval=0.5)) as router:
                whole = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60, trust_env=False)
        finally:
            for reservation in held:
                reservation.release()
        assert whole.status_code == 200 and "x-petrel-prefill" not in whole.headers
        assert whole.json()["choices"][0]["text"] == one["choices"][0]["text"]


def test_a_role_needs_its_secret_and_peers():
    from petrel.config import EngineConfig

    with pytest.raises(ValueError, match="kv_transfer_secret"):
        EngineConfig(kv_transfer_role="prefill")
    with pytest.raises(ValueError, match="kv_transfer_peers"):
        EngineConfig(kv_transfer_role="decode", kv_transfer_secret=SECRET)
    with pytest.raises(ValueError, match="kv_transfer_peers must be host:port"):
        EngineConfig(kv_transfer_role="decode", kv_transfer_secret=SECRET, kv_transfer_peers=["nohost"])
    with pytest.raises(ValueError, match="kv_transfer_role must be one of"):
        EngineConfig(kv_transfer_role="context")
    assert SECRET not in repr(EngineConfig(kv_transfer_role="prefill", kv_transfer_secret=SECRET))


def test_serve_flags_give_the_role_peers_and_secret(monkeypatch):
    from petrel.config import EngineConfig
    from petrel.serve.server import add_arguments, engine_options

    for name in ("PETREL_KV_TRANSFER_SECRET", "PETREL_API_KEY"):
        monkeypatch.delenv(name, raising=False)

    def options(*argv: str) -> dict:
        return engine_options(add_arguments(argparse.ArgumentParser()).parse_args(argv))

    plain = options()
    assert "kv_transfer_role" not in plain and "kv_transfer_secret" not in plain
    assert EngineConfig(**plain).kv_transfer_role is None
    decode = options(
        "--kv-transfer-role",
        "decode",
        "--kv-transfer-peers",
        "10.0.0.1:9001",
        "Prefill.Local:9001",
        "--kv-transfer-secret",
        "s",
    )
    assert EngineConfig(**decode).kv_transfer_peers == ["10.0.0.1:9001", "prefill.local:9001"]
    assert decode["kv_transfer_secret"] == "s"
    assert options("--kv-transfer-role", "prefill", "--api-key", "k")["kv_transfer_secret"] == "k"
    monkeypatch.setenv("PETREL_KV_TRANSFER_SECRET", "e")  # the environment's secret comes before the API key
    assert options("--kv-transfer-role", "prefill", "--api-key", "k")["kv_transfer_secret"] == "e"
    monkeypatch.delenv("PETREL_KV_TRANSFER_SECRET")
    with pytest.raises(ValueError, match="needs kv_transfer_secret"):
        EngineConfig(**options("--kv-transfer-role", "prefill"))


# ------------------------------------------------------------------------------------ two real servers + the router
@pytest.fixture(scope="module")
def backends():
    """A prefill and a decode `petrel serve` process on loopback, sharing a KV transfer secret."""
    ports, kv_port = [_free_port() for _ in range(2)], _free_port()
    common = ["--max-num-seqs", "8", "--kv-transfer-secret", SECRET]
    roles = [
        ["--kv-transfer-role", "prefill", "--kv-transfer-port", str(kv_port)],
        ["--kv-transfer-role", "decode", "--kv-transfer-peers", f"127.0.0.1:{kv_port}"],
    ]
    procs = []
    try:
        with ThreadPoolExecutor(2) as pool:  # both start at once; one that started is stopped even if the other failed
            starting = [pool.submit(start_server, port, common + role) for port, role in zip(ports, roles)]
            errors = []
            for port, future in zip(ports, starting):
                try:
                    procs.append((future.result(), f"http://127.0.0.1:{port}"))
                except RuntimeError as exc:
                    errors.append(exc)
        if errors:
            raise errors[0]
        yield procs
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)


@pytest.fixture(scope="module")
def split_url(backends):
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
    return float(
        next(line.split()[-1] for line in metrics.splitlines() if line.startswith("petrel_kv_cache_usage_perc"))
    )


@pytest.mark.e2e
def test_router_split_answers_as_one_server(split_url, backends):
    (_, prefill_url), (_, decode_url) = backends
    prompt_text = "Seabirds such as the petrel spend most of their lives"
    messages = [{"role": "user", "content": "Name three seabirds."}]
    for path, body, text_of in (
        ("/v1/completions", {"prompt": prompt_text, "max_tokens": 16}, lambda c: c["text"]),
        ("/v1/chat/completions", {"messages": messages, "max_tokens": 16}, lambda c: c["message"]["content"]),
    ):
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
    assert _kv_usage(prefill_url) == 0.0 and _kv_usage(decode_url) == 0.0  # nothing left pinned or running


@pytest.mark.e2e
def test_servers_refuse_a_spent_handle_and_a_foreign_endpoint(backends):
    (_, prefill_url), (_, decode_url) = backends
    body = {"prompt": "The albatross", "max_tokens": 8}
    ctx = _post(prefill_url, "/v1/completions", disaggregated_params={"request_type": "context_only"}, **body).json()
    params = dict(ctx["choices"][0]["disaggregated_params"], request_type="generation_only")
    assert _post(decode_url, "/v1/completions", disaggregated_params=params, **body).status_code == 200
    spent = _post(decode_url, "/v1/completions", disaggregated_params=params, **body)
    assert spent.status_code == 400 and spent.json()["error"]["param"] == "disaggregated_params"
    assert "expired" in spent.json()["error"]["message"]
    foreign = _post(
        decode_url, "/v1/completions", **body, disaggregated_params=dict(params, ctx_info_endpoint="127.0.0.1:1")
    )
    assert foreign.status_code == 400 and "kv_transfer_peers" in foreign.json()["error"]["message"]
    for url, request_type in ((prefill_url, "generation_only"), (decode_url, "context_only")):  # each keeps its side
        wrong = _post(url, "/v1/completions", disaggregated_params=dict(params, request_type=request_type), **body)
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "disaggregated_params"
    streaming = _post(
        prefill_url, "/v1/completions", stream=True, disaggregated_params={"request_type": "context_only"}, **body
    )
    assert streaming.status_code == 400 and streaming.json()["error"]["param"] == "disaggregated_params"
    assert _post(decode_url, "/v1/completions", **body).status_code == 200
