"""Fetching image and video URLs of chat messages, as a hostile client would aim them.

Every http(s) URL a request names is fetched on a small pool of its own (not the pool that renders and tokenizes
every prompt, so a slow host holds nothing but its own request), at most `max_concurrent` requests at once (more:
429), each URL within `timeout` seconds from its first connection to its last byte, redirects included, and all of
a request's URLs within `request_timeout` (a watchdog shuts the socket at the deadline: a host that trickles bytes
is cut off at it, not only one that stalls).

Where a fetch may go: by default only public addresses. The host is resolved first (numeric forms as the C
library reads them: `2130706433`, `0x7f.1`, `127.1`, `[::ffff:127.0.0.1]`, and addresses embedded in 6to4,
Teredo or NAT64 IPv6 ones count as the IPv4 address they carry), every address it resolves to must be public
(not loopback, private, link-local, shared, multicast, unspecified or reserved), and the connection goes to one
of those checked addresses (the Host header and TLS server name stay the URL's name), so a name cannot resolve to
another address between the check and the connection. Each redirect's target goes through the same checks;
redirects stay on http(s), and never from https to http. `allowed_domains` limits fetches to those host names
(each hop's); `allow_private` lifts the address check.

Every failure is one FetchFailed whose text the client never sees: the server answers each the same way
(media.fetch_error), so the answer tells no closed port from a 404, a refused address or a non-image; the
detail goes to the server log."""

from __future__ import annotations

import asyncio
import http.client
import ipaddress
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from petrel.serve.errors import APIError

DEFAULT_FETCH_TIMEOUT = 10.0
DEFAULT_REQUEST_FETCH_TIMEOUT = 30.0
DEFAULT_MAX_FETCHES = 4
MAX_REDIRECTS = 5
_REDIRECTS = {301, 302, 303, 307, 308}
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # the well-known prefix: the last 32 bits are an IPv4 address


@dataclass(frozen=True)
class FetchOptions:
    """Where and how long a server fetches media URLs (`petrel serve --allowed-media-domains`,
    `--allow-private-media`, `--media-fetch-timeout`, `--media-request-timeout`, `--max-media-fetches`)."""

    allow_private: bool = False  # fetch from loopback / private / link-local ... addresses too
    allowed_domains: frozenset[str] | None = None  # only these host names (None: any public host)
    timeout: float = DEFAULT_FETCH_TIMEOUT  # seconds for one URL, from connecting to the last byte, redirects included
    request_timeout: float = DEFAULT_REQUEST_FETCH_TIMEOUT  # seconds for all the URLs of one request
    max_concurrent: int = DEFAULT_MAX_FETCHES  # requests fetching at once; more get 429

    def __post_init__(self):
        for name in ("timeout", "request_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"media fetch {name} must be positive, got {getattr(self, name)!r}")
        if self.max_concurrent < 1:
            raise ValueError(f"max concurrent media fetches must be at least 1, got {self.max_concurrent}")
        if self.allowed_domains is not None:
            object.__setattr__(self, "allowed_domains", frozenset(_host_key(d) for d in self.allowed_domains))


class FetchFailed(Exception):
    """A media URL could not be fetched; the message is for the server log only. `item`: the request's item that
    failed (set once the failure leaves the fetch)."""

    def __init__(self, detail: str, item: FetchItem | None = None):
        super().__init__(detail)
        self.item = item


@dataclass(frozen=True)
class FetchItem:
    param: str  # the content part, e.g. messages.0.content.1
    url: str
    max_bytes: int
    what: str  # image or video


def system_resolve(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to (getaddrinfo: /etc/hosts, DNS)."""
    return [info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]


def numeric_address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address a host written as a number means (None for a name): IPv6, dotted IPv4, and the forms the C
    library's inet_aton also takes (decimal `2130706433`, hex `0x7f.1`, octal `0177.0.0.1`, short `127.1`)."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except (OSError, ValueError, UnicodeError):
        return None


def is_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether a fetch may connect to `address` by default: a globally routed unicast address, judged for an IPv6
    address that carries an IPv4 one (mapped, 6to4, Teredo, NAT64) by that IPv4 address too."""
    if address.version == 6:
        embedded = [address.ipv4_mapped, address.sixtofour, *(address.teredo or ())]
        if address in _NAT64:
            embedded.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
        if any(v4 is not None and not is_public(v4) for v4 in embedded):
            return False
        if address.ipv4_mapped is not None or address in _NAT64:
            return True  # judged by its IPv4 address alone
    return address.is_global and not (
        address.is_multicast
        or address.is_private
        or address.is_loopback
        or address.is_link_local
        or address.is_reserved
        or address.is_unspecified
    )


def _host_key(host: str) -> str:
    return host.strip().rstrip(".").lower()


class MediaFetcher:
    """The server's media fetches: `await fetch_all(items)` from a handler; the work runs on this fetcher's pool.
    resolve(host, port) -> addresses and connect((address, port), timeout) -> socket are the network's (tests
    give their own)."""

    def __init__(
        self,
        options: FetchOptions | None = None,
        resolve: Callable[[str, int], list[str]] = system_resolve,
        connect: Callable = socket.create_connection,
    ):
        self.options = options or FetchOptions()
        self.resolve, self.connect = resolve, connect
        self._slots = threading.BoundedSemaphore(self.options.max_concurrent)
        self._pool = ThreadPoolExecutor(self.options.max_concurrent, thread_name_prefix="petrel-media-fetch")
        self._tls = None

    async def fetch_all(self, items: list[FetchItem]) -> dict[str, bytes]:
        """{param: bytes} of every item, fetched one after another on the pool within the request's deadline. A
        429 when max_concurrent requests are fetching already; FetchFailed (the item in `.item`) for any
        failure."""
        if not items:
            return {}
        if not self._slots.acquire(blocking=False):
            raise APIError(
                f"the server is fetching media for as many requests as it allows at once "
                f"({self.options.max_concurrent}, --max-media-fetches); retry later, or send the media as data URLs",
                429,
                code="server_overloaded",
            )
        progress = [items[0]]  # the item being fetched: the one a missed deadline names
        deadline = time.monotonic() + self.options.request_timeout
        try:
            future = self._pool.submit(self._fetch_items, items, deadline, progress)
        except RuntimeError:  # the pool is shut down
            self._slots.release()
            raise
        try:  # the watchdogs end each fetch at its deadline; this is for a thread stuck where none reaches (DNS)
            return await asyncio.wait_for(asyncio.wrap_future(future), self.options.request_timeout + 1.0)
        except TimeoutError:
            item = progress[0]
            raise FetchFailed(f"{item.param}: no answer within the request's deadline", item) from None

    def _fetch_items(self, items: list[FetchItem], deadline: float, progress: list) -> dict[str, bytes]:
        try:
            fetched = {}
            for item in items:
                progress[0] = item
                try:
                    fetched[item.param] = self.fetch(item.url, item.max_bytes, deadline)
                except Exception as exc:  # noqa: BLE001 - every failure answers alike; the log keeps which
                    detail = exc if isinstance(exc, FetchFailed) else f"{type(exc).__name__}: {exc}"
                    raise FetchFailed(f"{item.param} ({_short(item.url)}): {detail}", item) from None
            return fetched
        finally:
            self._slots.release()

    def fetch(self, url: str, max_bytes: int, request_deadline: float | None = None) -> bytes:
        """The body of `url` (at most max_bytes), following redirects, each hop checked; blocking."""
        deadline = time.monotonic() + self.options.timeout
        if request_deadline is not None:
            deadline = min(deadline, request_deadline)
        for _ in range(MAX_REDIRECTS + 1):
            target = self._check(url)
            status, location, body = self._get(target, max_bytes, deadline)
            if status not in _REDIRECTS:
                if status != 200:
                    raise FetchFailed(f"HTTP {status}")
                return body
            if location is None:
                raise FetchFailed(f"HTTP {status} without a Location")
            following = urljoin(url, location)
            if urlsplit(url).scheme.lower() == "https" and urlsplit(following).scheme.lower() != "https":
                raise FetchFailed(f"a redirect from https to another scheme: {_short(following)}")
            url = following
        raise FetchFailed(f"more than {MAX_REDIRECTS} redirects")

    def _check(self, url: str) -> _Target:
        """Where `url` may be fetched from: its scheme, host and the checked addresses to connect to."""
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            raise FetchFailed(f"not an http(s) URL: {_short(url)}")
        try:
            host, port = parts.hostname, parts.port or (443 if scheme == "https" else 80)
        except ValueError as exc:  # a port that is no number, or out of range
            raise FetchFailed(f"a malformed URL ({exc})") from None
        if not host:
            raise FetchFailed("a URL without a host")
        allowed = self.options.allowed_domains
        if allowed is not None and _host_key(host) not in allowed:
            raise FetchFailed(f"host {host!r} is not among the allowed media domains")
        number = numeric_address(host.split("%")[0])
        if number is not None:
            addresses = [number]
        else:
            try:
                addresses = [ipaddress.ip_address(a.split("%")[0]) for a in self.resolve(host, port)]
            except (OSError, UnicodeError) as exc:
                raise FetchFailed(f"cannot resolve {host!r}: {exc}") from None
            if not addresses:
                raise FetchFailed(f"{host!r} resolves to no address")
        if not self.options.allow_private:
            refused = [str(a) for a in addresses if not is_public(a)]
            if refused:
                raise FetchFailed(f"{host!r} resolves to a non-public address ({', '.join(refused)})")
        path = parts.path or "/"
        return _Target(
            scheme, host, port, [str(a) for a in addresses], path + (f"?{parts.query}" if parts.query else "")
        )

    def _get(self, target: _Target, max_bytes: int, deadline: float) -> tuple[int, str | None, bytes]:
        """(status, Location of a redirect, body of a 200) of one GET, cut off at the deadline."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise FetchFailed("the fetch's deadline passed")
        tls = self._tls_context() if target.scheme == "https" else None
        conn = _PinnedConnection(target, tls, self.connect, remaining)
        watchdog = threading.Timer(remaining, conn.abort)
        watchdog.daemon = True
        watchdog.start()
        try:
            conn.request("GET", target.path, headers={"User-Agent": "petrel", "Accept": "*/*"})
            response = conn.getresponse()
            if response.status in _REDIRECTS:
                return response.status, response.getheader("Location"), b""
            if response.status != 200:
                return response.status, None, b""
            length = response.getheader("Content-Length")
            if length is not None and length.strip().isdigit() and int(length) > max_bytes:
                raise FetchFailed(f"Content-Length {length.strip()} is over the limit of {max_bytes} bytes")
            body = response.read(max_bytes + 1)
        except (OSError, http.client.HTTPException) as exc:
            if conn.aborted:
                raise FetchFailed("the fetch's deadline passed") from None
            raise FetchFailed(f"{type(exc).__name__}: {exc}") from None
        finally:
            watchdog.cancel()
            conn.close()
        if conn.aborted:  # the socket was shut at the deadline: what was read may be cut short
            raise FetchFailed("the fetch's deadline passed")
        if len(body) > max_bytes:
            raise FetchFailed(f"the body is over the limit of {max_bytes} bytes")
        return 200, None, body

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls


@dataclass(frozen=True)
class _Target:
    scheme: str
    host: str  # as the URL names it: the Host header and the TLS server name
    port: int
    addresses: list[str]  # checked: the connection goes to one of these
    path: str


class _PinnedConnection(http.client.HTTPConnection):
    """An HTTP(S) connection to the target's checked addresses, whatever its name resolves to now; the Host
    header and TLS server name (certificate checked against it) are the URL's host."""

    def __init__(self, target: _Target, tls: ssl.SSLContext | None, connect, timeout: float):
        super().__init__(target.host, target.port, timeout=timeout)
        self.target, self.tls, self.open_socket = target, tls, connect
        self.aborted = False
        self._lock = threading.Lock()
        self._shut_at_deadline = None

    def connect(self):
        error = None
        for address in self.target.addresses:
            try:
                sock = self.open_socket((address, self.target.port), self.timeout)
                break
            except OSError as exc:
                error = exc
        else:
            raise error or OSError("no address to connect to")
        if self.tls is not None:  # the handshake below, once abort() can reach the socket
            sock = self.tls.wrap_socket(sock, server_hostname=self.target.host, do_handshake_on_connect=False)
        with self._lock:
            self.sock = self._shut_at_deadline = sock  # the response reads it after close() drops self.sock
            if self.aborted:
                raise OSError("the fetch's deadline passed")
        if self.tls is not None:
            sock.do_handshake()

    def abort(self) -> None:
        """The deadline: shut the socket (from the watchdog's thread), so a read blocked in it returns at once."""
        with self._lock:
            self.aborted = True
            sock = self._shut_at_deadline
        if sock is not None:
            try:
                socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the TCP socket's, under any TLS layer
            except OSError:
                pass


def _short(url: str) -> str:
    return url if len(url) <= 200 else url[:200] + "..."
