"""Image URLs in chat messages, fetched as a hostile client would aim them (petrel/serve/media_fetch.py): no
loopback, private, link-local or odd numeric address by default, also behind a redirect; no redirect off http(s);
one answer for every failure; --allowed-media-domains; a deadline per URL and per request; a pool of its own so a
slow host freezes no other chat; a bound on requests fetching at once (429); and a decoded 6000x6000 image hands
its memory back. The hosts are local http servers; a test that must reach one through a "public" name gives the
fetcher its own resolver and connector."""

from __future__ import annotations

import argparse
import base64
import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from ipaddress import ip_address
from urllib.parse import parse_qs, quote, urlsplit

import httpx
import pytest

from petrel import LLM
from petrel.serve import build_app
from petrel.serve.media import fetch_error
from petrel.serve.media_fetch import FetchOptions, MediaFetcher, is_public, numeric_address
from petrel.serve.server import BackgroundServer

pytest.importorskip("transformers")
from tiny_vlm import build_tiny_idefics3, image  # noqa: E402

PUBLIC_IP = "93.184.215.14"  # what the tests' resolver gives "public" names; their connector sends it to loopback
TRICKLE_FOR = 8.0  # seconds a trickling host goes on before it gives up (past every deadline the tests set)


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


CAT = _png(image(48, 32, 5))


class Hosts:
    """One local http server playing every host: /cat.png (an image), /secret (an internal page: any hit is a
    leak), /redirect?to=URL (302), /slow (the image after 0.6 s), /trickle (an image one byte every 0.1 s for
    TRICKLE_FOR s), /missing (404)."""

    def __init__(self):
        self.hits, self.hosts, self.trickles = [], [], 0
        self.lock = threading.Lock()
        hosts = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args):
                pass

            def do_GET(self):
                url = urlsplit(self.path)
                with hosts.lock:
                    hosts.hits.append(url.path)
                    hosts.hosts.append(self.headers.get("Host"))
                if url.path == "/cat.png":
                    self._send(200, CAT)
                elif url.path == "/secret":
                    self._send(200, b"internal only")
                elif url.path == "/redirect":
                    self.send_response(302)
                    self.send_header("Location", parse_qs(url.query)["to"][0])
                    self.end_headers()
                elif url.path == "/slow":
                    time.sleep(0.6)
                    self._send(200, CAT)
                elif url.path == "/trickle":
                    self._trickle()
                else:
                    self._send(404, b"no such thing")

            def _send(self, status, body):
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _trickle(self):
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.end_headers()
                with hosts.lock:
                    hosts.trickles += 1
                try:
                    end = time.monotonic() + TRICKLE_FOR
                    for byte in (CAT * 1000)[: int(TRICKLE_FOR * 10)]:
                        if time.monotonic() > end:
                            break
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(0.1)
                except OSError:  # the fetcher hung up
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def trickled(self, fetch, n: int, timeout: float = 10.0) -> list:
        """fetch() called n times on threads, returned (futures) once every one has reached /trickle."""
        before = self.trickles
        pool = ThreadPoolExecutor(n)
        futures = [pool.submit(fetch) for _ in range(n)]
        pool.shutdown(wait=False)
        deadline = time.monotonic() + timeout
        while self.trickles < before + n:
            assert time.monotonic() < deadline, f"{self.trickles - before} of {n} fetches reached the trickling host"
            time.sleep(0.02)
        return futures


@pytest.fixture(scope="module")
def hosts():
    h = Hosts()
    yield h
    h.server.shutdown()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return build_tiny_idefics3(str(tmp_path_factory.mktemp("tiny-idefics3-fetch")))


@pytest.fixture(scope="module")
def server(vlm):
    """The server's own policy: the default (public addresses only), short deadlines for the tests."""
    llm = LLM(vlm.path, kv_cache_memory=1 << 24, limit_mm_per_prompt={"image": 3})
    app = build_app(llm, media_fetch=FetchOptions(timeout=2.0, request_timeout=4.0))
    with BackgroundServer(app) as srv:
        srv.state = app.state.petrel
        yield srv
    llm.shutdown()


@contextmanager
def policy(server, resolve=None, connect=None, **options):
    """The server's fetcher replaced, for one test, by one with these options (and resolver / connector)."""
    state = server.state
    kept = state.media_fetcher
    fetcher = MediaFetcher(FetchOptions(**{"timeout": 2.0, "request_timeout": 4.0, **options}))
    if resolve is not None:
        fetcher.resolve = resolve
    if connect is not None:
        fetcher.connect = connect
    state.media_fetcher = fetcher
    try:
        yield fetcher
    finally:
        state.media_fetcher = kept


def names_to(mapping: dict[str, str]):
    """A resolver: these names to these addresses, any other name to nothing."""

    def resolve(host, port):
        if host not in mapping:
            raise OSError(f"unknown host {host}")
        return [mapping[host]]

    return resolve


def to_loopback(port: int, seen: list | None = None):
    """A connector that takes every (address, port) to the local hosts (recording the address asked for)."""
    import socket

    def connect(address, timeout):
        if seen is not None:
            seen.append(address[0])
        return socket.create_connection(("127.0.0.1", port), timeout)

    return connect


def chat(server, *urls, text="What is this?", timeout=30.0):
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    body = {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}], "max_tokens": 2}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=timeout)


def generic(param: str = "messages.0.content.0") -> str:
    return fetch_error(param, "image").message


def test_numeric_forms_and_embedded_addresses():
    """What a host written as a number means, as the C library reads it, and which addresses are public."""
    for form in ("2130706433", "0x7f.1", "0177.0.0.1", "127.1", "0x7f000001", "::ffff:127.0.0.1"):
        assert not is_public(numeric_address(form)), form
    assert str(numeric_address("2130706433")) == "127.0.0.1" and numeric_address("images.example") is None
    refused = [
        "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1", "0.0.0.0", "224.0.0.1",
        "233.252.0.1", "240.0.0.1", "255.255.255.255", "::1", "::", "fe80::1", "fd00::1", "ff0e::1",
        "2002:7f00:1::", "2002:a00:1::", "64:ff9b::7f00:1", "2001:0:4136:e378:8000:63bf:80ff:fffe",
    ]  # fmt: skip
    for address in refused:
        assert not is_public(ip_address(address)), address
    for address in (PUBLIC_IP, "8.8.8.8", "2606:4700:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808"):
        assert is_public(ip_address(address)), address


@pytest.mark.parametrize(
    "target",
    [
        "http://127.0.0.1:{port}/secret",
        "http://2130706433:{port}/secret",
        "http://0x7f.1:{port}/secret",
        "http://[::ffff:127.0.0.1]:{port}/secret",
        "http://localhost:{port}/secret",
        "{server}/metrics",
        "http://10.0.0.1:{port}/secret",
        "http://192.168.0.1:{port}/secret",
        "http://169.254.169.254/latest/meta-data/",
        "http://[fd00::1]:{port}/secret",
    ],
    ids=[
        "loopback",
        "decimal",
        "hex",
        "mapped-v6",
        "localhost",
        "own-metrics",
        "10/8",
        "192.168/16",
        "metadata",
        "ula",
    ],
)
def test_internal_addresses_are_refused_with_one_text(server, hosts, target):
    before = len(hosts.hits)
    t0 = time.monotonic()
    r = chat(server, target.format(port=hosts.port, server=server.url), timeout=10)
    assert r.status_code == 400 and r.json()["error"]["message"] == generic()
    assert r.json()["error"]["param"] == "messages.0.content.0"
    assert time.monotonic() - t0 < 2.0  # refused before connecting: nothing to wait for
    assert len(hosts.hits) == before  # no request reached the host


def test_redirects_are_checked_like_the_url(server, hosts):
    """A public name that redirects to loopback or off http(s) is refused (the redirect reached, its target
    not); to a public target it is followed. The connection goes to the address the check saw, with the
    URL's name as Host."""
    seen = []
    public = lambda path: hosts.url(path, "images.example")  # noqa: E731
    with policy(server, resolve=names_to({"images.example": PUBLIC_IP}), connect=to_loopback(hosts.port, seen)):
        ok = chat(server, public("/cat.png"))
        assert ok.status_code == 200, ok.text
        assert seen == [PUBLIC_IP] and hosts.hosts[-1] == f"images.example:{hosts.port}"
        followed = chat(server, public("/redirect?to=" + quote(public("/cat.png"))))
        assert followed.status_code == 200, followed.text
        for target in (hosts.url("/secret"), "ftp://images.example/cat.png", "file:///etc/passwd"):
            before = list(hosts.hits)
            r = chat(server, public("/redirect?to=" + quote(target)))
            assert r.status_code == 400 and r.json()["error"]["message"] == generic(), target
            assert hosts.hits[len(before) :] == ["/redirect"], target  # the secret was never asked for


def test_every_failure_answers_the_same(server, hosts):
    """Where loopback is allowed: a closed port, a 404, a page that is no image and an image over the byte
    limit answer the same text (no port scanner), with no object repr; a reachable image works."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with policy(server, allow_private=True):
        assert chat(server, hosts.url("/cat.png")).status_code == 200
        server.state.media.max_bytes, kept = 64, server.state.media.max_bytes
        try:
            too_big = chat(server, hosts.url("/cat.png"))
        finally:
            server.state.media.max_bytes = kept
        answers = [
            chat(server, f"http://127.0.0.1:{closed}/x.png"),
            chat(server, hosts.url("/missing")),
            chat(server, hosts.url("/secret")),
            too_big,
        ]
    for r in answers:
        assert r.status_code == 400 and r.json()["error"]["message"] == generic(), r.text
        assert "object at 0x" not in r.text


def test_a_data_url_that_is_no_image_names_no_object():
    from petrel.multimodal.media import load_image

    with pytest.raises(ValueError) as err:
        load_image(b"plain text", "messages.0.content.0")
    assert "object at 0x" not in str(err.value) and "not a decodable image" in str(err.value)


def test_allowed_media_domains(server, hosts):
    resolve = names_to({"images.test": "127.0.0.1", "other.test": "127.0.0.1"})
    with policy(server, resolve=resolve, allow_private=True, allowed_domains={"Images.Test."}):
        assert chat(server, hosts.url("/cat.png", "images.test")).status_code == 200
        before = len(hosts.hits)
        for url in (
            hosts.url("/cat.png", "other.test"),
            hosts.url("/cat.png"),  # the address of an allowed name is not the name
            hosts.url("/redirect?to=" + quote(hosts.url("/cat.png", "other.test")), "images.test"),
        ):
            r = chat(server, url)
            assert r.status_code == 400 and r.json()["error"]["message"] == generic(), url
        assert hosts.hits[before:] == ["/redirect"]


def test_a_trickling_host_meets_the_deadlines(server, hosts):
    """One URL is cut off at its deadline, however steadily its host trickles; three slow URLs, each within its
    own deadline, at the request's."""
    with policy(server, allow_private=True, timeout=1.0, request_timeout=1.6):
        t0 = time.monotonic()
        r = chat(server, hosts.url("/trickle"))
        one = time.monotonic() - t0
        assert r.status_code == 400 and r.json()["error"]["message"] == generic()
        t0 = time.monotonic()
        r = chat(server, *[hosts.url("/slow")] * 3)  # 0.6 s each: the third is under way at 1.6 s
        three = time.monotonic() - t0
        assert r.status_code == 400 and r.json()["error"]["message"] == generic("messages.0.content.2")
    assert one < 2.0 and three < 2.6, (one, three)


def test_slow_hosts_freeze_no_other_chat(server, hosts):
    """Two requests whose images trickle in hold the fetch pool, not the pool that renders every prompt: a
    text-only chat meanwhile answers at once."""
    with policy(server, allow_private=True, timeout=3.0):
        slow = hosts.trickled(lambda: chat(server, hosts.url("/trickle")), 2)
        t0 = time.monotonic()
        r = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2},
            timeout=30,
        )
        latency = time.monotonic() - t0
        assert r.status_code == 200 and all(f.result().status_code == 400 for f in slow)
    assert latency < 2.0, f"the text chat took {latency:.2f} s behind two slow image hosts"


def test_fetches_at_once_are_bounded(server, hosts):
    """Past max_concurrent requests fetching, a 429 (data URLs need no slot), counted as a rejected request on
    /metrics; the slot comes back after."""
    data_url = "data:image/png;base64," + base64.b64encode(CAT).decode()
    with policy(server, allow_private=True, timeout=1.5, max_concurrent=1):
        (slow,) = hosts.trickled(lambda: chat(server, hosts.url("/trickle")), 1)
        rejected = _rejected(server)
        busy = chat(server, hosts.url("/cat.png"))
        assert busy.status_code == 429 and busy.json()["error"]["code"] == "server_overloaded"
        assert _rejected(server) == rejected + 1
        assert chat(server, data_url).status_code == 200
        assert slow.result().status_code == 400
        assert chat(server, hosts.url("/cat.png")).status_code == 200


def _rejected(server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("petrel_request_rejected_total")
    )


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_a_huge_image_leaves_no_memory_held(server):
    """A 6000x6000 PNG under the pixel budget: decoding and processing it allocate hundreds of MiB that glibc
    kept (+330 MiB RSS for good over a trimmed heap); the server trims the heap after such a request, on the media
    thread once it has let the pixels go. What a trim cannot reach stays: the top of the media thread's malloc
    arena, under glibc's 64 MiB trim threshold (+62 MiB here)."""
    from petrel.heap import can_release, release_free_memory

    if not can_release():
        pytest.skip("needs glibc's malloc_trim")
    from PIL import Image

    img = Image.new("RGB", (6000, 6000), (200, 30, 40))  # one colour: a small PNG, 36 M pixels decoded
    url = "data:image/png;base64," + base64.b64encode(_png(img)).decode()
    del img
    release_free_memory()
    before = _rss_mib()
    assert chat(server, url, timeout=120).status_code == 200
    deadline = time.monotonic() + 5.0
    while _rss_mib() - before > 150 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _rss_mib() - before < 150, f"+{_rss_mib() - before:.0f} MiB RSS kept after the request"


def test_serve_flags():
    from petrel.serve.server import add_arguments, media_fetch_options

    parse = add_arguments(argparse.ArgumentParser()).parse_args
    default = media_fetch_options(parse([]))
    assert default == FetchOptions() and not default.allow_private and default.allowed_domains is None
    options = media_fetch_options(
        parse(
            [
                "--allowed-media-domains",
                "images.example",
                "CDN.example.",
                "--allow-private-media",
                "--media-fetch-timeout",
                "3",
                "--media-request-timeout",
                "5",
                "--max-media-fetches",
                "2",
            ]
        )  # fmt: skip
    )
    assert options == FetchOptions(True, frozenset({"images.example", "cdn.example"}), 3.0, 5.0, 2)
    for bad in (["--media-fetch-timeout", "0"], ["--max-media-fetches", "0"], ["--media-request-timeout", "-1"]):
        with pytest.raises(ValueError, match=bad[0]):
            media_fetch_options(parse(bad))
