"""The HTTP listener's connections: a cap with a clear 503 beyond it, and a deadline on reading each request head."""

# aiohttp's own keepalive_timeout closes a connection that has no complete request head within
# that time of opening or of its last response: idle clients, and slowloris ones that dribble a
# head forever (its timer is not reset by incoming bytes). This module adds what aiohttp lacks:
# a shorter deadline for a head once its first byte has arrived, and a cap on open connections,
# so that a flood of idle sockets cannot use up the file descriptors every client needs.

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

log = logging.getLogger(__name__)

_REFUSAL_LINGER_S = 1.0  # how long a refused client gets to read the 503 before its socket is closed
MAX_LINGERING = 64  # refused sockets still open for that moment; beyond, refusals close at once (no 503)


@dataclass(frozen=True)
class ConnectionLimits:
    """How long a connection may idle or dawdle, and how many may be open (per front end)."""

    max_connections: int = 1024
    keep_alive_timeout_s: float = 75.0  # idle between requests (longer than common load balancers' 60 s)
    header_timeout_s: float = 20.0  # from a request's first byte to its complete head
    body_timeout_s: float = 60.0  # from a handler's start to its whole body (16 MiB at ~2 Mbit/s)

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"--max-connections={self.max_connections} must be >= 1")
        for name in ("keep_alive_timeout_s", "header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                flag = "--" + name.removesuffix("_s").replace("_", "-")
                raise ValueError(f"{flag}={getattr(self, name)} must be a positive number of seconds")

    def grpc_options(self) -> list[tuple[str, int]]:
        """The same limits in gRPC core's terms (its own connections, handshakes and idle clients)."""
        return [("grpc.max_allowed_incoming_connections", self.max_connections),
                ("grpc.max_connection_idle_ms", int(self.keep_alive_timeout_s * 1000)),
                ("grpc.server_handshake_timeout_ms", int(self.header_timeout_s * 1000))]


def _refusal_bytes(limit: int) -> bytes:
    body = json.dumps({"error": {"message": f"this server is at its limit of {limit} open connections; retry "
                                 "shortly or on another replica", "type": "service_unavailable", "param": None,
                                 "code": "too_many_connections"}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Retry-After: 1\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class ConnectionGate:
    """A protocol factory around aiohttp's: counts connections, refuses those beyond the cap, times out heads.

    Its middleware tells each connection when a request head has been parsed (its handler starts)
    and when the handler is done, which is all the head deadline needs to know.
    """

    def __init__(self, max_connections: int, header_timeout_s: float) -> None:
        self.factory: Callable[[], asyncio.Protocol] | None = None  # aiohttp's, once its runner is set up
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.open: dict[asyncio.BaseTransport, _Guarded] = {}  # by transport, for the middleware
        # Counted from the factory call, not from connection_made: asyncio accepts a whole backlog
        # before any of those connections is made. Weak, so a protocol asyncio drops is not counted.
        self._guarded: weakref.WeakSet[_Guarded] = weakref.WeakSet()
        self._lingering: weakref.WeakSet[_Refusal] = weakref.WeakSet()
        self._refusal = _refusal_bytes(max_connections)

    def __call__(self) -> asyncio.Protocol:
        """A protocol for one accepted connection."""
        assert self.factory is not None, "set ConnectionGate.factory (the runner's server) before listening"
        if len(self._guarded) >= self.max_connections:
            log.warning("refused a connection: %d open, the limit set by --max-connections", len(self._guarded))
            refusal = _Refusal(self._refusal if len(self._lingering) < MAX_LINGERING else None, self._lingering)
            self._lingering.add(refusal)
            return refusal
        guarded = _Guarded(self, self.factory())
        self._guarded.add(guarded)
        return guarded

    def middleware(self) -> Middleware:
        """aiohttp middleware (put it first): marks the request's connection busy while its handler runs."""

        @web.middleware
        async def track(request: web.Request, handler: Handler) -> web.StreamResponse:
            conn = self.open.get(request.transport) if request.transport is not None else None
            if conn is not None:
                conn.busy(True)
            try:
                return await handler(request)
            finally:
                if conn is not None:
                    conn.busy(False)

        return track

    def forget(self, conn: _Guarded) -> None:
        """Stop counting a connection that has closed."""
        if conn.transport is not None:
            self.open.pop(conn.transport, None)
        self._guarded.discard(conn)


class _Guarded(asyncio.Protocol):
    """Passes everything to aiohttp's protocol; closes the connection if a started request head stalls."""

    def __init__(self, gate: ConnectionGate, inner: asyncio.Protocol) -> None:
        self.gate, self.inner = gate, inner
        self.transport: asyncio.BaseTransport | None = None
        self.active = 0  # handlers running for this connection
        self.heads = 0  # request heads parsed so far
        self.timer: asyncio.TimerHandle | None = None

    def busy(self, starting: bool) -> None:
        if starting:
            self.active += 1
            self.heads += 1
            self._cancel_timer()
        else:
            self.active -= 1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.gate.open[transport] = self
        self.inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self.gate.forget(self)
        self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # The first bytes while no handler runs start a head: it must be complete within the deadline.
        # Body bytes that arrive before their handler starts are harmless: the check below sees the head.
        if not self.active and self.timer is None:
            loop = asyncio.get_running_loop()
            self.timer = loop.call_later(self.gate.header_timeout_s, self._head_deadline, self.heads)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def _head_deadline(self, heads_then: int) -> None:
        self.timer = None
        if self.active or self.heads != heads_then or self.transport is None:
            return  # a head arrived in time
        log.warning("closed a connection whose request head took over %g s (--header-timeout)",
                    self.gate.header_timeout_s)
        self.transport.close()

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class _Refusal(asyncio.Protocol):
    """Answers 503 at once, discards whatever the client sends, and closes when it has read the answer."""

    def __init__(self, response: bytes | None, lingering: weakref.WeakSet[_Refusal]) -> None:
        self.response, self.lingering = response, lingering
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        if self.response is None:  # too many refusals lingering already: a flood; spend nothing on it
            transport.abort()
            return
        self.transport = transport
        transport.write(self.response)
        if transport.can_write_eof():  # a client reading to the end sees it at once, then closes
            transport.write_eof()
        # Closing at once, with the client's request unread, would send a reset that can destroy the
        # 503 before the client reads it: read and drop its bytes until it closes, or for a moment.
        self.timer = asyncio.get_running_loop().call_later(_REFUSAL_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        if self.transport is not None:
            self.transport.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.transport = None
        self.lingering.discard(self)
