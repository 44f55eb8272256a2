"""A fault-injecting HTTP reverse proxy on 127.0.0.1, for S3 tests against a moto server.

Stdlib only. Requests are forwarded as they came (method, path with query string, every header
including ``Host``, ``Range`` and ``Content-Length``, the body) over a keep-alive connection per
client connection; responses come back with their status, headers and body. On top of that:

- ``set_faults(rate, kinds)``: each request, with probability ``rate`` (seeded RNG), gets one of
  ``kinds`` instead of being forwarded: ``"500"`` (InternalError), ``"503"`` (SlowDown; both with
  an S3 XML error body), ``"reset"`` (the connection is reset without a response), or
  ``"truncate"`` (GETs only: forwarded, then the body is cut in half and the connection reset).
  Every fault but ``truncate`` happens before the request reaches the server, so the server never
  sees a request whose response the client did not get (no orphaned uploads by accident).
- ``stall(rate, seconds)``: hold a fraction of requests before forwarding them.
- ``fail_all(after=0, kind="503", match=None)``: after ``after`` more requests (that ``match``)
  are forwarded, every request (that ``match``) fails with ``kind`` until :meth:`heal`.

Use as a context manager: it serves while the ``with`` block runs, then closes every client
connection and joins its threads.
"""

from __future__ import annotations

import http.client
import http.server
import random
import socket
import struct
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
     "upgrade"}
)
_ERRORS = {
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "503": (503, "SlowDown", "Please reduce your request rate."),
}


_KINDS = frozenset({"500", "503", "reset", "truncate"})


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # with the query string, e.g. "/bucket/key?partNumber=3&uploadId=..."
    headers: dict[str, str]


Match = Callable[[Request], bool]


class FaultProxy:
    """``with FaultProxy(upstream_port) as proxy: ... proxy.endpoint_url ...``"""

    def __init__(self, upstream_port: int, *, seed: int = 0) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._rate = 0.0
        self._kinds: tuple[str, ...] = ("500", "503", "reset")
        self._stall_rate = 0.0
        self._stall_s = 0.0
        self._fail_after: int | None = None
        self._fail_kind = "503"
        self._fail_match: Match | None = None
        # "forwarded", "stalled", and one key per injected fault kind
        self.counts: Counter[str] = Counter()
        self._server = _Server(self)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stopping.set()
        self._server.shutdown()
        self._server.close_connections()
        self._server.server_close()  # joins the handler threads
        self._thread.join()

    # -- configuration (any thread) -------------------------------------------------------

    def set_faults(self, rate: float, kinds: tuple[str, ...] = ("500", "503", "reset")) -> None:
        unknown = set(kinds) - _KINDS
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}")
        with self._lock:
            self._rate, self._kinds = rate, kinds

    def stall(self, rate: float, seconds: float) -> None:
        with self._lock:
            self._stall_rate, self._stall_s = rate, seconds

    def fail_all(self, after: int = 0, kind: str = "503", match: Match | None = None) -> None:
        with self._lock:
            self._fail_after, self._fail_kind, self._fail_match = after, kind, match

    def heal(self) -> None:
        with self._lock:
            self._rate, self._stall_rate, self._fail_after = 0.0, 0.0, None

    @property
    def injected(self) -> int:
        with self._lock:
            return sum(n for kind, n in self.counts.items() if kind in _KINDS)

    # -- decisions (handler threads) ------------------------------------------------------

    def _decide(self, req: Request) -> tuple[str | None, float]:
        """The fault for this request (None: forward it) and how long to stall it first."""
        with self._lock:
            stall = self._stall_s if self._rng.random() < self._stall_rate else 0.0
            if stall:
                self.counts["stalled"] += 1
            if self._fail_after is not None and (self._fail_match is None or self._fail_match(req)):
                if self._fail_after == 0:
                    self.counts[self._fail_kind] += 1
                    return self._fail_kind, stall
                self._fail_after -= 1
            kinds = [k for k in self._kinds if k != "truncate" or req.method == "GET"]
            if self._rng.random() < self._rate and kinds:
                kind = self._rng.choice(kinds)
                self.counts[kind] += 1
                return kind, stall
            self.counts["forwarded"] += 1
            return None, stall


class _Server(http.server.ThreadingHTTPServer):
    def __init__(self, proxy: FaultProxy) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.proxy = proxy
        self._open: set[socket.socket] = set()
        self._to_reset: set[socket.socket] = set()
        self._open_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def reset_later(self, request: socket.socket) -> None:
        """Close ``request`` with an RST (no FIN first) once its handler returns."""
        request.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        with self._open_lock:
            self._to_reset.add(request)

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.discard(request)
            reset = request in self._to_reset
            self._to_reset.discard(request)
        if reset:
            self.close_request(request)
        else:
            super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a client that hung up is not news
            super().handle_error(request, client_address)

    def close_connections(self) -> None:
        """Wake every handler blocked on an idle keep-alive connection, so that it exits."""
        with self._open_lock:
            for sock in self._open:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    _upstream: http.client.HTTPConnection | None = None

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_request(self) -> None:
        proxy = self.server.proxy
        body = self._read_body()
        req = Request(self.command, self.path, {k.lower(): v for k, v in self.headers.items()})
        fault, stall = proxy._decide(req)
        if stall and proxy._stopping.wait(stall):
            return self._reset()
        if fault in _ERRORS:
            return self._send_error(*_ERRORS[fault])
        if fault == "reset":
            return self._reset()
        try:
            status, reason, headers, payload = self._forward(body)
        except (OSError, http.client.HTTPException):
            return self._reset()
        self.send_response_only(status, reason)
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        if fault == "truncate" and len(payload) > 1:
            self.wfile.write(payload[: len(payload) // 2])
            return self._reset()
        self.wfile.write(payload)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_request

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return b"".join(self._read_chunks())
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _read_chunks(self) -> Iterator[bytes]:
        while True:
            size = int(self.rfile.readline().split(b";")[0], 16)
            if size == 0:
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return
            yield self.rfile.read(size)
            self.rfile.readline()

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
        for attempt in (1, 2):  # a kept-alive upstream connection may have been closed meanwhile
            if self._upstream is None:
                self._upstream = http.client.HTTPConnection(*self.server.proxy.upstream)
            conn = self._upstream
            try:
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for k, v in self.headers.items():
                    if k.lower() not in _HOP_BY_HOP:
                        conn.putheader(k, v)
                if chunked:
                    conn.putheader("Transfer-Encoding", "chunked")
                conn.endheaders(iter([body]) if chunked else body, encode_chunked=chunked)
                resp = conn.getresponse()
                payload = resp.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                self._upstream = None
                if attempt == 2:
                    raise
                continue
            headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP_BY_HOP]
            has_length = any(k.lower() == "content-length" for k, _ in headers)
            if self.command != "HEAD" and not has_length:
                headers.append(("Content-Length", str(len(payload))))
            return resp.status, resp.reason, headers, payload
        raise AssertionError("unreachable")

    def _send_error(self, status: int, code: str, message: str) -> None:
        xml = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>"
            "<RequestId>fault-proxy</RequestId></Error>"
        ).encode()
        self.send_response_only(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(xml)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(xml)

    def _reset(self) -> None:
        """Drop the connection abortively (RST), as a crashed server or middlebox would."""
        self.close_connection = True
        try:
            self.server.reset_later(self.connection)
        except OSError:
            pass

    def finish(self) -> None:
        super().finish()
        if self._upstream is not None:
            self._upstream.close()
