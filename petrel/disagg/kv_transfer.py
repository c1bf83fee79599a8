"""The KV transfer: a TCP server on the context instance hands out pinned prompt KV, a client fetches it.

One connection per fetch. The client sends one JSON line, {"handle": ..., "mac": ...}: mac is the HMAC-SHA256 of
the handle under the secret both instances share, so only a peer that knows it can take a pinned prompt. The
server answers a 4-byte big-endian header length, the JSON header ({"ok": true, "dtype", "shape"} or
{"ok": false, "error"}), then the tensor's raw bytes ([layers, planes, tokens, heads, width], C order). The
client knows the shape its prompt needs and reads no more: a header claiming anything else ends the fetch before
a byte of tensor is allocated. The engine loop only copies the blocks out (`engine.call`); serialising and
sending happen on the server's connection thread (at most MAX_CONNECTIONS at once).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import socket
import socketserver
import struct
import threading
import time

import torch

from petrel.disagg.params import KVTransferStats
from petrel.engine.kv_export import gather_prompt_kv

logger = logging.getLogger("petrel.disagg")

MAX_HEADER_BYTES = 1 << 16
EXPIRY_INTERVAL = 0.25  # seconds between the server's checks for pins nobody fetched in time
MAX_CONNECTIONS = 16  # connections the server serves at once; more are closed at once
REQUEST_TIMEOUT = 10.0  # seconds the server waits for a connection's request line
KV_DTYPES = ("float32", "bfloat16", "float16")  # what a cache (EngineConfig.dtype) may hold


class KVTransferError(RuntimeError):
    """The transfer itself failed (connection refused or dropped, a malformed answer): that request fails."""


def _export(core, handle: str) -> torch.Tensor | None:
    """In the engine loop: copy the pinned prompt's K/V out and unpin it (None: unknown or expired handle)."""
    pin = core.pinned.take(handle)
    if pin is None:
        return None
    try:
        return gather_prompt_kv(core.runner.kv_caches, core.runner.layer_tables(pin.blocks), pin.num_tokens)
    finally:
        core.pinned.release(pin)


def handle_mac(secret: str, handle: str) -> str:
    """The proof a fetch carries that it knows the shared secret: HMAC-SHA256 of the handle, hex."""
    return hmac.new(secret.encode(), b"petrel-kv-transfer:" + handle.encode(), hashlib.sha256).hexdigest()


class _Handler(socketserver.StreamRequestHandler):
    timeout = REQUEST_TIMEOUT

    def handle(self) -> None:
        try:
            line = self.rfile.readline(MAX_HEADER_BYTES)
        except OSError:  # no request line in REQUEST_TIMEOUT, or the client went away
            return
        started = time.perf_counter()
        try:
            request = json.loads(line)
            handle, mac = request["handle"], request["mac"]
            if not isinstance(handle, str) or not isinstance(mac, str):
                raise TypeError("handle and mac must be strings")
        except (ValueError, KeyError, TypeError):
            return self._refuse("bad request")
        if not secrets.compare_digest(mac.encode(), handle_mac(self.server.secret, handle).encode()):
            logger.warning(
                "refused a KV fetch from %s: wrong mac (its kv_transfer_secret differs)", self.client_address[0]
            )
            return self._refuse("unauthorized")
        try:
            kv = self.server.engine.call(lambda core: _export(core, handle), timeout=60)
        except Exception as exc:  # noqa: BLE001 - the engine is gone or stuck: tell the client
            logger.warning("a KV export failed: %s", exc)
            return self._refuse("export failed")
        if kv is None:
            return self._refuse("unknown")
        self.connection.settimeout(self.server.send_timeout)  # a large prompt's KV on a slow link takes a while
        data = kv.contiguous().view(-1).view(torch.uint8).numpy()
        events = self.server.engine.events
        try:
            self._send({"ok": True, "dtype": str(kv.dtype).removeprefix("torch."), "shape": list(kv.shape)}, data)
        except OSError:
            events.kv_handoff_failed()
            raise
        events.kv_handed_off(data.nbytes, time.perf_counter() - started)

    def _refuse(self, error: str) -> None:
        self.server.engine.events.kv_handoff_failed()
        self._send({"ok": False, "error": error})

    def _send(self, header: dict, data=None) -> None:
        raw = json.dumps(header).encode()
        self.wfile.write(struct.pack(">I", len(raw)) + raw)
        if data is not None:
            self.wfile.write(memoryview(data))


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 4 * MAX_CONNECTIONS

    def __init__(self, address, engine, secret: str, send_timeout: float):
        self.engine = engine
        self.secret = secret
        self.send_timeout = send_timeout
        self._connections = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._next_expiry = 0.0
        super().__init__(address, _Handler)

    def process_request(self, request, client_address) -> None:
        """A thread per connection, at most MAX_CONNECTIONS of them: one more is closed unanswered."""
        if not self._connections.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._connections.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._connections.release()

    def handle_error(self, request, client_address) -> None:
        """A connection that broke (the client went away mid-answer): logged, not printed as a traceback."""
        logger.debug("a KV transfer connection from %s failed", client_address[0], exc_info=True)

    def service_actions(self) -> None:
        """Between accepts, every EXPIRY_INTERVAL: have the engine loop release the pins nobody fetched in time."""
        if len(self.engine.core.pinned) and time.monotonic() >= self._next_expiry:
            self._next_expiry = time.monotonic() + EXPIRY_INTERVAL
            try:
                self.engine.call(lambda core: core.pinned.expire(), timeout=5)
            except Exception:  # noqa: BLE001 - a busy or stopped engine: try again next time
                pass


class KVTransferServer:
    """Serves this engine's pinned prompt KV on host:port (port 0: one the OS picks) in a daemon thread, to
    fetches that prove they know `secret`; sending one prompt's KV may take up to `timeout` seconds."""

    def __init__(self, engine, secret: str, host: str = "127.0.0.1", port: int = 0, timeout: float = 60.0):
        self._server = _Server((host, port), engine, secret, timeout)
        bound_host, self.port = self._server.server_address[:2]
        self.host = socket.gethostbyname(socket.gethostname()) if bound_host in ("0.0.0.0", "") else bound_host
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": EXPIRY_INTERVAL},
            name="petrel-kv-transfer",
            daemon=True,
        )
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _recv_exactly(sock: socket.socket, n: int, deadline: float, into=None):
    """n bytes (into the writable buffer `into` when given), all by `deadline` (time.monotonic()): a peer that
    trickles times out."""
    buf = bytearray(n) if into is None else into
    view, got = memoryview(buf), 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the transfer did not finish in time ({got} of {n} bytes)")
        sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"the connection closed after {got} of {n} bytes")
        got += k
    return buf


def _refusal(endpoint: str, error) -> Exception:
    """The error for a refusing answer, in fixed words: nothing the peer wrote reaches the client."""
    if error == "unknown":
        return ValueError(
            f"disaggregated_params.opaque_state: the context instance at {endpoint} holds no KV for "
            "this handle (unknown, expired, or already fetched)"
        )
    if error == "unauthorized":
        return KVTransferError(
            f"the context instance at {endpoint} refused this server's credentials (the two "
            "instances' kv_transfer_secret differ)"
        )
    logger.warning("the KV transfer server at %s refused a fetch: %.200r", endpoint, error)
    return KVTransferError(f"the context instance at {endpoint} refused the KV transfer")


def _check_header(endpoint: str, header, shape: tuple[int, ...]) -> torch.dtype:
    """The dtype of an accepted answer whose tensor is exactly `shape`; otherwise the fetch ends here."""
    if not isinstance(header, dict):
        raise KVTransferError(f"{endpoint} did not answer as a petrel KV transfer server")
    if not header.get("ok"):
        raise _refusal(endpoint, header.get("error"))
    if header.get("dtype") not in KV_DTYPES or not isinstance(header.get("shape"), list):
        raise KVTransferError(f"{endpoint} did not answer as a petrel KV transfer server")
    if tuple(header["shape"]) != shape:
        raise ValueError(
            f"disaggregated_params: the context instance at {endpoint} holds KV of another shape than "
            f"this model and prompt need ({list(shape)}): a different model, or not this prompt"
        )
    return getattr(torch, header["dtype"])


def fetch_kv(
    endpoint: str, handle: str, secret: str, shape: tuple[int, ...], timeout: float = 60.0
) -> tuple[torch.Tensor, KVTransferStats]:
    """The pinned prompt KV from the context instance at endpoint ("host:port"), and what the fetch cost.
    shape: what this prompt's KV must be ([layers, planes, tokens, heads, width]); an answer claiming any other
    is refused before its tensor is read, so a peer cannot make this server allocate more. The whole fetch ends
    within `timeout` seconds. ValueError: the handle is unknown there (never issued, expired, or fetched already),
    or its KV is not this prompt's. KVTransferError: the transfer failed."""
    host, _, port = endpoint.rpartition(":")
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            request = {"handle": handle, "mac": handle_mac(secret, handle)}
            sock.sendall(json.dumps(request).encode() + b"\n")
            (size,) = struct.unpack(">I", _recv_exactly(sock, 4, deadline))
            if size > MAX_HEADER_BYTES:
                raise KVTransferError(f"{endpoint} did not answer as a petrel KV transfer server")
            dtype = _check_header(endpoint, json.loads(_recv_exactly(sock, size, deadline)), shape)
            kv = torch.empty(shape, dtype=dtype)
            num_bytes = kv.numel() * kv.element_size()
            if num_bytes:
                _recv_exactly(sock, num_bytes, deadline, into=kv.view(-1).view(torch.uint8).numpy())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, struct.error) as exc:
        raise KVTransferError(f"fetching the prompt KV from {endpoint} failed ({type(exc).__name__})") from None
    stats = KVTransferStats(num_bytes, time.perf_counter() - t0, shape[2], endpoint)
    logger.info(
        "fetched the KV of %d prompt tokens (%d bytes) from %s in %.1f ms",
        stats.num_tokens,
        stats.num_bytes,
        endpoint,
        stats.seconds * 1e3,
    )
    return kv, stats
