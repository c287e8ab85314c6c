"""The OpenAI-compatible HTTP front end (aiohttp): completions, chat, SSE, models, health, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from kvfleet_agent.engine.async_llm import AsyncLLM, EngineDeadError
from kvfleet_agent.engine.request_stream import RequestStream
from kvfleet_agent.outputs import RequestOutput
from kvfleet_agent.server import protocol
from kvfleet_agent.server.admission import Admission, Refusal
from kvfleet_agent.server.metrics import AgentMetrics
from kvfleet_agent.server.openapi import openapi_document
from kvfleet_agent.server.protocol import APIError

log = logging.getLogger(__name__)

Stream = RequestStream


class HTTPFrontend:
    """Routes and handlers; counts requests in flight so a drain knows when it is done."""

    def __init__(self, llm: AsyncLLM, admission: Admission, metrics: AgentMetrics, model: str,
                 stall_timeout_s: float = 120.0) -> None:
        self.llm, self.admission, self.metrics, self.model = llm, admission, metrics, model
        self.stall_timeout_s = stall_timeout_s
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.created = int(time.time())

    def app(self) -> web.Application:
        """The aiohttp application with every route."""
        app = web.Application(middlewares=[self._errors], client_max_size=16 << 20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics_handler)
        app.router.add_get("/openapi.json", self.openapi)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Every failure becomes an OpenAI-style JSON error: never a traceback, never a bare 500."""
        try:
            return await handler(request)  # type: ignore[no-any-return]
        except APIError as e:
            headers = {"Retry-After": str(self.admission.retry_after_s)} if e.status == 429 else None
            return web.json_response(e.body(), status=e.status, headers=headers)
        except web.HTTPException as e:  # unknown route, wrong method: keep aiohttp's status, our body
            err = APIError(e.reason, status=e.status, type_="not_found_error" if e.status == 404 else
                           "invalid_request_error")
            return web.json_response(err.body(), status=e.status)
        except EngineDeadError:
            return web.json_response(APIError("the engine has failed; this replica is restarting", status=503,
                                              type_="service_unavailable").body(), status=503)
        except ValueError as e:  # the engine's own input checks (empty prompt, too long, bad token ids)
            return web.json_response(APIError(str(e), "prompt" if "prompt" in str(e) else None).body(), status=400)
        except Exception:
            log.exception("unexpected error serving %s %s", request.method, request.path)
            return web.json_response(APIError("internal error; the server logged the details", status=500,
                                              type_="server_error").body(), status=500)

    # -- generation -------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions."""
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions."""
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"the request body is not valid JSON: {e}") from None
        req, messages = protocol.parse(body, self.model, chat, self.llm.max_model_len)
        if chat:
            tokenizer = self.llm.tokenizer
            if tokenizer is None:
                raise APIError("this model has no tokenizer.json, so chat is unavailable; use /v1/completions "
                               "with prompt token ids", "messages")
            try:
                req.prompts = [tokenizer.apply_chat_template(messages or [])]
            except ValueError as e:
                raise APIError(str(e), "messages") from None
        refusal = self.admission.check(len(req.prompts))
        if refusal is Refusal.QUEUE_FULL:
            raise APIError("the server's queue is full; retry after the Retry-After delay", status=429,
                           type_="rate_limit_error", code="queue_full")
        if refusal is not None:
            raise APIError("this replica is not taking requests (draining or failed); retry elsewhere",
                           status=503, type_="service_unavailable", code=refusal.value)
        rid = protocol.new_id(chat)
        streams: list[RequestStream] = []
        self.in_flight += 1
        self.idle.clear()
        try:
            for i, p in enumerate(req.prompts):  # a bad prompt raises here; those already queued are closed below
                streams.append(self.llm.generate(p, req.params, f"{rid}-{i}"))
            if req.stream:
                return await self._stream(request, rid, streams, req)
            return await self._whole(rid, streams, req)
        finally:
            for s in streams:  # on a disconnect or error, closing a stream aborts its request
                await s.aclose()
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()

    async def _whole(self, rid: str, streams: list[Stream], req: protocol.GenerateRequest) -> web.Response:
        # Wait for every prompt even if one fails, so no task is left behind; then report the first error.
        results = await asyncio.gather(*(_last(s) for s in streams), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        finals = [r for r in results if isinstance(r, RequestOutput)]
        decode = self._decoder()
        choices = [protocol.choice(i, out, req.chat, decode) for i, out in enumerate(finals)]
        return web.json_response(protocol.envelope(rid, self.model, req.chat, choices, False,
                                                   protocol.usage(list(finals))))

    async def _stream(self, request: web.Request, rid: str, streams: list[Stream],
                      req: protocol.GenerateRequest) -> web.StreamResponse:
        merged = _merge(streams)
        first = await anext(merged, None)  # invalid input raises here, before any header is sent
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        finals: dict[int, RequestOutput] = {}
        item = first
        try:
            await self._pump(resp, rid, req, merged, item, finals)
        except Exception as e:  # headers are out: report it inside the stream, then end the stream properly
            if not isinstance(e, EngineDeadError):
                log.exception("error while streaming %s", rid)
            await _send(resp, APIError("the engine failed mid-stream" if isinstance(e, EngineDeadError) else
                                       "internal error mid-stream; the server logged it", status=503,
                                       type_="server_error").body())
        if req.include_usage and finals:
            await _send(resp, protocol.envelope(rid, self.model, req.chat, [], True,
                                                protocol.usage([finals[i] for i in sorted(finals)]), req.created))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _pump(self, resp: web.StreamResponse, rid: str, req: protocol.GenerateRequest,
                    merged: AsyncIterator[tuple[int, RequestOutput]], item: tuple[int, RequestOutput] | None,
                    finals: dict[int, RequestOutput]) -> None:
        decode = self._decoder()
        sent_text = [0] * len(req.prompts)
        sent_lp = [0] * len(req.prompts)
        sent_role = [not req.chat] * len(req.prompts)  # chat streams name the role once, in the first delta
        while item is not None:
            i, out = item
            c = out.outputs[0]
            delta = c.text[sent_text[i]:]
            piece = protocol.choice(i, out, req.chat, decode, text=delta, logprob_start=sent_lp[i], delta=True,
                                    first=not sent_role[i])
            new_lp = len(c.logprobs or []) > sent_lp[i]
            sent_text[i], sent_lp[i] = len(c.text), len(c.logprobs or [])
            if delta or out.finished or new_lp:
                sent_role[i] = True
                await _send(resp, protocol.envelope(rid, self.model, req.chat, [piece], True, created=req.created))
            if out.finished:
                finals[i] = out
            item = await anext(merged, None)

    def _decoder(self) -> Any:
        tok = self.llm.tokenizer
        return (lambda t: tok.decode([t], skip_special_tokens=False)) if tok is not None else str

    # -- the rest ---------------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models: the one served model."""
        return web.json_response({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": self.created, "owned_by": "kvfleet",
            "max_model_len": self.llm.max_model_len}]})

    async def health(self, request: web.Request) -> web.Response:
        """GET /health (liveness): the engine thread is alive and, when it has work, stepping."""
        stats = self.llm.stats()
        stalled = stats.has_unfinished and time.time() - stats.last_step_time > self.stall_timeout_s
        if not self.llm.is_alive or stalled:
            why = "the engine thread has failed" if not self.llm.is_alive else \
                f"no engine step for over {self.stall_timeout_s:.0f} s with requests pending"
            return web.json_response({"status": "unhealthy", "reason": why}, status=503)
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        """GET /ready (readiness): loaded, warmed up, alive and not draining."""
        if self.admission.draining or not self.llm.is_alive:
            return web.json_response({"status": "draining" if self.admission.draining else "failed"}, status=503)
        return web.json_response({"status": "ready"})

    async def metrics_handler(self, request: web.Request) -> web.Response:
        """GET /metrics in the Prometheus text format."""
        return web.Response(body=self.metrics.exposition(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def openapi(self, request: web.Request) -> web.Response:
        """GET /openapi.json."""
        return web.json_response(openapi_document(self.model))


async def _last(stream: Stream) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    assert last is not None and last.finished  # AsyncLLM always ends a stream with a finished output
    return last


async def _merge(streams: list[Stream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (index, output), in arrival order."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(i: int, s: Stream) -> None:
        try:
            async for out in s:
                await queue.put((i, out))
        except BaseException as e:  # hand errors (bad input, dead engine) to the consumer
            await queue.put(e)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        done = 0
        while done < len(streams):
            item = await queue.get()
            if item is None:
                done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)


async def _send(resp: web.StreamResponse, obj: dict[str, Any]) -> None:
    await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")
