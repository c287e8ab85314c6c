"""API keys as vLLM checks them: `Authorization: Bearer <key>` on /v1 routes and on gRPC Generation calls."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from kvfleet_agent.server.protocol import APIError

# Probes and Prometheus carry no key: /health, /ready, /metrics (and /openapi.json, as in vLLM)
# stay open, as does the gRPC Health service.
PROTECTED_PREFIX = "/v1"
OPEN_GRPC_SERVICE = "/kvfleet.v1.Health/"


class APIKey:
    """One shared key; compared in constant time so that response timing reveals nothing of it."""

    def __init__(self, key: str) -> None:
        if not key or key != key.strip():  # no client could send it: header values are trimmed
            raise ValueError("--api-key (KVFLEET_API_KEY) must be non-empty and have no leading or trailing "
                             "whitespace; a Secret written with a trailing newline has one")
        self._expected = key.encode()

    def problem(self, authorization: str | None) -> str | None:
        """Why an Authorization header value is refused, or None when it carries the key."""
        if not authorization:
            return "this server requires an API key: send the header 'Authorization: Bearer <key>'"
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "the Authorization header must read 'Bearer <key>'"
        # compare_digest wants equal types; encoding both sides keeps any client string comparable.
        if not hmac.compare_digest(token.strip().encode("utf-8", "surrogateescape"), self._expected):
            return "incorrect API key"
        return None

    def middleware(self) -> Middleware:
        """aiohttp middleware: 401 with an OpenAI-style error on /v1 routes without the key."""

        @web.middleware
        async def check_key(request: web.Request, handler: Handler) -> web.StreamResponse:
            if request.path.startswith(PROTECTED_PREFIX):
                why = self.problem(request.headers.get("Authorization"))
                if why is not None:
                    raise APIError(why, status=401, code="invalid_api_key")
            return await handler(request)

        return check_key

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        """gRPC interceptor: UNAUTHENTICATED for Generation calls without `authorization: Bearer <key>`."""
        return _Interceptor(self)


class _Interceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc ships no type hints
    def __init__(self, key: APIKey) -> None:
        self.key = key

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_GRPC_SERVICE):
            return handler
        metadata = dict(details.invocation_metadata or ())
        why = self.key.problem(metadata.get("authorization"))
        if why is None:
            return handler

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

        # The same kind of handler as the method's, taking raw bytes: a refused call costs no decoding.
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(deny)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)
