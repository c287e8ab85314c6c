"""The OpenAI-compatible HTTP front end (aiohttp): completions, chat, SSE, models, health, metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from kvfleet_agent.engine.async_llm import AsyncLLM, EngineDeadError
from kvfleet_agent.engine.request_stream import RequestStream
from kvfleet_agent.outputs import RequestOutput
from kvfleet_agent.sampling_params import SamplingParams
from kvfleet_agent.server import protocol, sse
from kvfleet_agent.server.admission import Admission, Refusal
from kvfleet_agent.server.api.common import DEFAULT_MAX_LOGPROBS
from kvfleet_agent.server.api.render import Decode, echoed, prompt_logprobs, prompt_only
from kvfleet_agent.server.auth import APIKey
from kvfleet_agent.server.connections import ConnectionGate
from kvfleet_agent.server.fanout import OutputStream, best, start_samples
from kvfleet_agent.server.json_body import read_json
from kvfleet_agent.server.metrics import AgentMetrics
from kvfleet_agent.server.openapi import openapi_document
from kvfleet_agent.server.prompts import PromptEncoder
from kvfleet_agent.server.protocol import APIError
from kvfleet_agent.server.request_defaults import RequestDefaults
from kvfleet_agent.server.small_routes import SmallRoutes
from kvfleet_agent.server.tool_calls import family_of, whole_choice

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20


def _error_response(e: APIError, retry_after_s: int) -> web.Response:
    headers = {}
    if e.status in (429, 503):
        headers["Retry-After"] = str(retry_after_s)
    if e.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    resp = web.json_response(e.body(), status=e.status, headers=headers)
    if e.status in (408, 413):  # the body was not read to its end: the connection cannot carry another request
        resp.force_close()
    return resp


def _route_error(request: web.Request, e: web.HTTPException) -> web.Response:
    headers = {}
    if isinstance(e, web.HTTPMethodNotAllowed):
        headers["Allow"] = ", ".join(sorted(e.allowed_methods))
        message = f"{request.method} is not allowed on {request.path}: use {headers['Allow']}"
    elif e.status == 404:
        message = f"there is no route {request.path}: see /openapi.json for the API"
    else:
        message = e.text or e.reason
    err = APIError(message, status=e.status, type_="not_found_error" if e.status == 404 else "invalid_request_error")
    return web.json_response(err.body(), status=e.status, headers=headers)


class HTTPFrontend:
    """Routes and handlers; counts requests in flight so a drain knows when it is done."""

    def __init__(self, llm: AsyncLLM, admission: Admission, metrics: AgentMetrics, model: str,
                 stall_timeout_s: float = 120.0, *, prompts: PromptEncoder | None = None,
                 api_key: APIKey | None = None, gate: ConnectionGate | None = None,
                 body_timeout_s: float = 60.0, max_body_bytes: int = MAX_BODY_BYTES,
                 max_logprobs: int = DEFAULT_MAX_LOGPROBS, defaults: RequestDefaults | None = None) -> None:
        self.llm, self.admission, self.metrics, self.model = llm, admission, metrics, model
        self.stall_timeout_s = stall_timeout_s
        self.prompts = prompts or PromptEncoder(llm)
        self.api_key, self.gate = api_key, gate
        self.body_timeout_s, self.max_body_bytes = body_timeout_s, max_body_bytes
        self.max_logprobs, self.defaults = max_logprobs, defaults
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.created = int(time.time())

    def app(self) -> web.Application:
        """The aiohttp application with every route."""
        # Outermost first: the gate sees every handler start; errors render the API key's 401 too.
        middlewares: list[Middleware] = [self.gate.middleware()] if self.gate is not None else []
        middlewares.append(self._errors)
        if self.api_key is not None:
            middlewares.append(self.api_key.middleware())
        app = web.Application(middlewares=middlewares, client_max_size=self.max_body_bytes)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        SmallRoutes(self.model, self._model_card, self.prompts, self.llm.vocab_size, self.body_timeout_s).add_to(app)
        app.router.add_route("*", "/ping", self.ping)
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
            return _error_response(e, self.admission.retry_after_s)
        except web.HTTPException as e:  # unknown route, wrong method: keep aiohttp's status, our body
            return _route_error(request, e)
        except EngineDeadError:
            return web.json_response(APIError("the engine has failed; this replica is restarting", status=503,
                                              type_="service_unavailable").body(), status=503)
        except ValueError as e:  # the engine's own input checks, raised through a request's stream
            return web.json_response(APIError(str(e)).body(), status=400)
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
        body = await read_json(request, self.body_timeout_s)
        # A request with more prompts than the queue holds could never be admitted: 400, not 429.
        queue = max(1, self.admission.max_queue_length)
        req, messages = protocol.parse(body, self.model, chat, self.llm.max_model_len, max_prompts=queue,
                                       max_logprobs=self.max_logprobs, vocab_size=self.llm.vocab_size,
                                       defaults=self.defaults)
        samples = (len(req.prompts) or 1) * req.best_of  # chat: one prompt, rendered below
        if samples > queue:
            raise APIError(f"this request makes {samples} samples (prompts x best_of/n); this server takes at most "
                           f"{queue} at once (its queue length): ask for fewer",
                           "best_of" if req.best_of > req.n else "n")
        # Admission is asked before tokenizing, so that an overloaded or draining replica spends no
        # work on requests it will refuse, and again after, with no wait before generate(): exact.
        self._admit(samples)
        if chat:
            req.prompts = [await self.prompts.render_chat(messages or [], tools=req.tools)]
        if req.tool_plan is not None:
            req.tool_plan.family = family_of(self.llm.tokenizer.chat_template if self.llm.tokenizer else None)
        await self.prompts.compile(req.params.structured_outputs, req.structured_field or "structured_outputs")
        prompt_ids = await self.prompts.encode(req.prompts, req.prompt_field)
        if req.max_tokens_field is not None:
            for ids in prompt_ids:
                self.prompts.check_fits(len(ids), req.params.max_tokens, req.prompt_field, req.max_tokens_field)
        self._admit(len(prompt_ids) * req.best_of)
        rid = protocol.new_id(chat)
        started: list[OutputStream] = []
        self.in_flight += 1
        self.idle.clear()
        try:
            # A bad prompt raises here; those already queued are closed below.
            streams = await start_samples(prompt_ids, req, rid, lambda ids, params, sid: self._start(
                ids, params, req.prompt_field, sid), started)
            if req.stream:
                echo = (lambda i, out: self.prompt_text(req, i // req.n, out)) if req.echo else None
                return await sse.stream(request, rid, streams, req, self.model, self._decoder(), echo)
            return await self._whole(rid, streams, req)
        finally:
            for s in started:  # on a disconnect or error, closing a stream aborts its request
                await s.aclose()
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()

    def _admit(self, n: int) -> None:
        refusal = self.admission.check(n)
        if refusal is Refusal.QUEUE_FULL:
            raise APIError("the server's queue is full; retry after the Retry-After delay", status=429,
                           type_="rate_limit_error", code="queue_full")
        if refusal is not None:
            raise APIError("this replica is not taking requests (draining or failed); retry elsewhere",
                           status=503, type_="service_unavailable", code=refusal.value)

    def _start(self, ids: list[int], params: SamplingParams, prompt_field: str, request_id: str) -> RequestStream:
        try:
            return self.llm.generate(ids, params, request_id)
        except ValueError as e:  # the engine's own checks (token ids outside the vocabulary)
            raise APIError(str(e), prompt_field) from None

    async def _whole(self, rid: str, streams: list[OutputStream], req: protocol.GenerateRequest) -> web.Response:
        # Wait for every prompt even if one fails, so no task is left behind; then report the first error.
        results = await asyncio.gather(*(_last(s) for s in streams), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        finals = [r for r in results if isinstance(r, RequestOutput)]
        decode = self._decoder()
        if req.prompt_only:
            finals = [prompt_only(out) for out in finals]
        # Usage counts every sample drawn (best_of ones too: they were generated), each prompt once.
        used = protocol.usage(finals, req.best_of)
        chosen = best(finals, req)
        choices = [self._choice(i, out, req, decode) for i, out in enumerate(chosen)]
        body = protocol.envelope(rid, self.model, req.chat, choices, False, used)
        if req.chat and req.prompt_logprobs is not None:  # one prompt: at the top level, as vLLM
            body["prompt_logprobs"] = prompt_logprobs(chosen[0], req.prompt_logprobs, decode)
        return web.json_response(body)

    def _choice(self, i: int, out: RequestOutput, req: protocol.GenerateRequest, decode: Decode) -> dict[str, Any]:
        piece = protocol.choice(i, out, req.chat, decode, with_logprobs=req.logprobs_asked)
        if req.tool_plan is not None:
            piece = whole_choice(piece, req.tool_plan)
        if req.echo:
            piece = echoed(out, self.prompt_text(req, i // req.n, out), piece, decode, req.params.logprobs)
        if not req.chat and req.prompt_logprobs is not None:
            piece["prompt_logprobs"] = prompt_logprobs(out, req.prompt_logprobs, decode)
        return piece

    def prompt_text(self, req: protocol.GenerateRequest, p: int, out: RequestOutput) -> str:
        """What echo puts in front: the prompt as sent, or its token ids decoded (special tokens kept)."""
        prompt, tok = req.prompts[p], self.llm.tokenizer
        if isinstance(prompt, str):
            return prompt
        return tok.decode(out.prompt_token_ids, skip_special_tokens=False) if tok is not None else ""

    def _decoder(self) -> Any:
        tok = self.llm.tokenizer
        return (lambda t: tok.decode([t], skip_special_tokens=False)) if tok is not None else str

    # -- the rest ---------------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models: the one served model."""
        return web.json_response({"object": "list", "data": [self._model_card()]})

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model, "object": "model", "created": self.created, "owned_by": "kvfleet",
                "root": self.llm.model_path, "parent": None, "max_model_len": self.llm.max_model_len}

    async def health(self, request: web.Request) -> web.Response:
        """GET /health (liveness): the engine thread is alive and, when it has work, stepping."""
        stats = self.llm.stats()
        stalled = stats.has_unfinished and time.time() - stats.last_step_time > self.stall_timeout_s
        if not self.llm.is_alive or stalled:
            why = "the engine thread has failed" if not self.llm.is_alive else \
                f"no engine step for over {self.stall_timeout_s:.0f} s with requests pending"
            return web.json_response({"status": "unhealthy", "reason": why}, status=503)
        return web.json_response({"status": "ok"})

    async def ping(self, request: web.Request) -> web.Response:
        """GET or POST /ping: vLLM's (SageMaker's) liveness probe, answered as /health."""
        if request.method not in ("GET", "POST"):
            raise web.HTTPMethodNotAllowed(request.method, ["GET", "POST"])
        return await self.health(request)

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
        return web.json_response(openapi_document(self.model, secured=self.api_key is not None,
                                                  max_logprobs=self.max_logprobs))


async def _last(stream: OutputStream) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    assert last is not None and last.finished  # AsyncLLM always ends a stream with a finished output
    return last
