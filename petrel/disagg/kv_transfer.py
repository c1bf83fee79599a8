"""The KV transfer: a TCP server on the context instance hands out pinned prompt KV, a client fetches it.

One connection per fetch. The client sends one JSON line, {"handle": ...}; the server answers a 4-byte
big-endian header length, the JSON header ({"ok": true, "dtype", "shape"} or {"ok": false, "error"}), then
the tensor's raw bytes ([layers, 2, tokens, kv_heads, head_dim], C order). The engine loop only copies the
blocks out (`engine.call`); serialising and sending happen on the server's connection thread.
"""
from __future__ import annotations

import json
import logging
import socket
import socketserver
import struct
import threading
import time

import torch

from petrel.disagg.kv_blocks import gather_prompt_kv
from petrel.disagg.params import KVTransferStats

logger = logging.getLogger("petrel.disagg")

MAX_HEADER_BYTES = 1 << 16
EXPIRY_INTERVAL = 0.25      # seconds between the server's checks for pins nobody fetched in time


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


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        line = self.rfile.readline(MAX_HEADER_BYTES)
        try:
            handle = json.loads(line)["handle"]
            if not isinstance(handle, str):
                raise TypeError("handle is not a string")
        except (ValueError, KeyError, TypeError) as exc:
            return self._send({"ok": False, "error": f"bad request: {exc}"})
        try:
            kv = self.server.engine.call(lambda core: _export(core, handle), timeout=60)
        except Exception as exc:  # noqa: BLE001 - the engine is gone or stuck: tell the client
            return self._send({"ok": False, "error": f"the engine could not export the KV: {exc}"})
        if kv is None:
            return self._send({"ok": False, "error": "unknown"})
        data = kv.contiguous().view(-1).view(torch.uint8).numpy()
        self._send({"ok": True, "dtype": str(kv.dtype).removeprefix("torch."), "shape": list(kv.shape)}, data)

    def _send(self, header: dict, data=None) -> None:
        raw = json.dumps(header).encode()
        self.wfile.write(struct.pack(">I", len(raw)) + raw)
        if data is not None:
            self.wfile.write(memoryview(data))


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, engine):
        self.engine = engine
        super().__init__(address, _Handler)

    def service_actions(self) -> None:
        """Between accepts: have the engine loop release the pins nobody fetched in time."""
        if len(self.engine.core.pinned):
            try:
                self.engine.call(lambda core: core.pinned.expire(), timeout=5)
            except Exception:  # noqa: BLE001 - a busy or stopped engine: try again next time
                pass


class KVTransferServer:
    """Serves this engine's pinned prompt KV on host:port (port 0: one the OS picks) in a daemon thread."""

    def __init__(self, engine, host: str = "127.0.0.1", port: int = 0):
        self._server = _Server((host, port), engine)
        bound_host, self.port = self._server.server_address[:2]
        self.host = socket.gethostbyname(socket.gethostname()) if bound_host in ("0.0.0.0", "") else bound_host
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": EXPIRY_INTERVAL},
                                        name="petrel-kv-transfer", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _recv_exactly(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"the connection closed after {got} of {n} bytes")
        got += k
    return buf


def fetch_kv(endpoint: str, handle: str, timeout: float = 60.0) -> tuple[torch.Tensor, KVTransferStats]:
    """The pinned prompt KV from the context instance at endpoint ("host:port"), and what the fetch cost.
    ValueError: the handle is unknown there (never issued, expired, or fetched already). KVTransferError:
    the transfer failed."""
    host, _, port = endpoint.rpartition(":")
    t0 = time.perf_counter()
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            sock.sendall(json.dumps({"handle": handle}).encode() + b"\n")
            (size,) = struct.unpack(">I", _recv_exactly(sock, 4))
            if size > MAX_HEADER_BYTES:
                raise KVTransferError(f"a {size}-byte header: {endpoint} is not a petrel KV transfer server")
            header = json.loads(_recv_exactly(sock, size))
            if not header.get("ok"):
                error = header.get("error")
                if error == "unknown":
                    raise ValueError(f"disaggregated_params.opaque_state: the context instance at {endpoint} holds no "
                                     "KV for this handle (unknown, expired, or already fetched)")
                raise KVTransferError(f"the context instance at {endpoint} refused the KV transfer: {error}")
            dtype, shape = getattr(torch, header["dtype"]), header["shape"]
            num_bytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            data = _recv_exactly(sock, num_bytes)
    except (OSError, json.JSONDecodeError, struct.error) as exc:
        raise KVTransferError(f"fetching the prompt KV from {endpoint} failed: {type(exc).__name__}: {exc}") from None
    kv = torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape) if num_bytes else \
        torch.empty(shape, dtype=dtype)
    stats = KVTransferStats(num_bytes, time.perf_counter() - t0, shape[2], endpoint)
    logger.info("fetched the KV of %d prompt tokens (%d bytes) from %s in %.1f ms", stats.num_tokens,
                stats.num_bytes, endpoint, stats.seconds * 1e3)
    return kv, stats
