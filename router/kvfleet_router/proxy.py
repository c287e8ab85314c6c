"""The router's HTTP front: OpenAI routes relayed to the picked replica byte for byte, retried before the first byte."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import generate_latest

from kvfleet_router.fleet import Fleet, Replica
from kvfleet_router.hold_queue import HoldQueue, HoldRefused
from kvfleet_router.metrics import HeldSample, RouterMetrics
from kvfleet_router.picker import pick
from kvfleet_router.prefix import prefix_key
from kvfleet_router.quality import QualityMonitor
from kvfleet_router.tier_config import TieredModel
from kvfleet_router.tiering import TIER_HEADER, Route, Tiers

log = logging.getLogger(__name__)
# Every POST the agents serve that names a model: generation, and vLLM's tokenizer routes (any replica answers them
# alike; they go through the same picking so a held model holds them too).
ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
GENERATION = ROUTES[:2]  # what tiers classify and the quality monitor verifies (a tiered model's tokenizer routes go
# to its top tier)
CAPTURE_MAX = 1 << 20  # a verified answer is kept up to this many bytes (past it, the sample is skipped)
RETRY_STATUSES = (429, 503)  # the agent refused before starting: another replica may take it
FORWARDED_HEADERS = ("Content-Type", "Authorization", "Accept")
ROUTE_HEADER = "x-kvfleet-route"
MAX_BODY = 16 << 20  # the agent's own limit


def error(status: int, message: str, kind: str, **headers: str) -> web.Response:
    """An error in the agents' (OpenAI's) shape."""
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status,
                             headers=headers)


class Router:
    """Picks a replica per request and relays it; holds requests for models with no ready replica."""

    def __init__(self, fleet: Fleet, holds: HoldQueue, epsilon: float = 0.25, max_attempts: int = 3,
                 tiered: Mapping[str, TieredModel] | None = None) -> None:
        self.fleet, self.holds, self.epsilon, self.max_attempts = fleet, holds, epsilon, max_attempts
        self.metrics = RouterMetrics(held=self._held)
        self.session: aiohttp.ClientSession | None = None
        self.tiers = Tiers(tiered, self.metrics.tiers) if tiered else None
        self.monitor = QualityMonitor(self.tiers, self.call, self.metrics.tiers) if self.tiers is not None else None

    def app(self) -> web.Application:
        """The aiohttp application: OpenAI routes, models, health, readiness, metrics."""
        app = web.Application(client_max_size=MAX_BODY)
        app.add_routes([*(web.post(path, self.relay) for path in ROUTES), web.get("/v1/models", self.models),
                        web.get("/v1/models/{model}", self.model), web.get("/health", self.health),
                        web.get("/ping", self.health), web.get("/ready", self.ready),
                        web.get("/metrics", self.exposition)])
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _: web.Application) -> None:
        # No total timeout: a long generation streams for minutes. Connecting must be quick, though.
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
                                             auto_decompress=False)

    async def _close(self, _: web.Application) -> None:
        if self.monitor is not None:
            await self.monitor.close()
        if self.session is not None:
            await self.session.close()

    async def health(self, request: web.Request) -> web.Response:
        """GET /health: the router itself is up (replicas come and go behind it)."""
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        """GET /ready: 503 until discovery has read every watched namespace once (before that, a model not yet
        seen would be answered 404 for nothing)."""
        if not self.fleet.synced:
            return web.json_response({"status": "syncing", "message": "discovery has not listed everything yet"},
                                     status=503)
        return web.json_response({"status": "ok"})

    def _held(self) -> Iterator[HeldSample]:
        """The held-requests gauge's samples: each known model's held count under every InferenceDeployment
        serving it (the full count under each: any of them may be the one that scales up from zero)."""
        for model in sorted(set(self.fleet.models) | set(self.holds.models())):
            held = float(self.holds.held(model))
            for namespace, deployment in self.fleet.deployments.get(model) or (("", ""),):
                yield model, namespace, deployment, held

    async def exposition(self, request: web.Request) -> web.Response:
        """GET /metrics."""
        return web.Response(body=generate_latest(self.metrics.registry), content_type="text/plain")

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models: every model the router knows, with its ready replica count."""
        data = [self._model_card(m) for m in sorted(self._names())]
        return web.json_response({"object": "list", "data": data})

    def _names(self) -> set[str]:
        """Every model name a client may send: served models and tiered names."""
        return set(self.fleet.models) | set(self.tiers.tiered if self.tiers is not None else ())

    def _model_card(self, name: str) -> dict[str, Any]:
        if self.tiers is not None and name in self.tiers:
            tiers = [t.model for t in self.tiers.tiered[name].tiers]
            return {"id": name, "object": "model", "owned_by": "kvfleet", "tiers": tiers,
                    "ready_replicas": sum(len(self.fleet.ready(t)) for t in tiers)}
        return {"id": name, "object": "model", "owned_by": "kvfleet", "ready_replicas": len(self.fleet.ready(name))}

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{id}: one model the router knows, or a 404 in OpenAI's shape naming the known ones."""
        name = request.match_info["model"]
        if name not in self._names():
            known = ", ".join(sorted(self._names())) or "none"
            return error(404, f"model {name!r} is not served here; models: {known}", "invalid_request_error")
        return web.json_response(self._model_card(name))

    async def relay(self, request: web.Request) -> web.StreamResponse:
        """POST an OpenAI route: pick, forward, retry on refusal before any byte, relay the answer."""
        start = time.perf_counter()
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            return error(400, "the body is not valid JSON", "invalid_request_error")
        model = body.get("model") if isinstance(body, dict) else None
        route: Route | None = None
        if self.tiers is not None and model in self.tiers:
            if request.path in GENERATION:
                route = await self.tiers.route(body, self._classify)
                if self.monitor is not None and self.monitor.sample(route):
                    route = dataclasses.replace(route, verify=True)
                tier = route.model
            else:
                tier = self.tiers.tiered[str(model)].tiers[-1].model
            if tier not in self.fleet.models:
                return error(404, f"model {model!r} is served by tier {tier!r}, which no InferenceDeployment serves "
                                  "here now", "invalid_request_error")
            body, model = {**body, "model": tier}, tier
            raw = json.dumps(body).encode()
        if not isinstance(model, str) or model not in self.fleet.models:
            known = ", ".join(sorted(self._names())) or "none"
            return error(404, f"model {model!r} is not served here; models: {known}", "invalid_request_error")
        if not self.fleet.ready(model):
            held = time.perf_counter()
            try:
                await self.holds.wait(model)
            except HoldRefused as e:
                self.metrics.requests.labels(model, "", "held_refused").inc()
                return error(503, str(e), "service_unavailable", **{"Retry-After": f"{e.retry_after_s:.0f}"})
            finally:
                self.metrics.hold_time.labels(model).observe(time.perf_counter() - held)
            if model not in self.fleet.models:  # its InferenceDeployment was deleted while the request waited
                return error(404, f"model {model!r} is no longer served here", "invalid_request_error")
            start = time.perf_counter()  # the wait is the fleet's, not the router's own latency
        key = prefix_key(body)
        tried: set[str] = set()
        retry_after = 1.0
        while len(tried) < self.max_attempts:
            candidates = [r for r in self.fleet.ready(model) if r.name not in tried]
            if not candidates:
                break
            choice = pick([r.load() for r in candidates], key, self.epsilon,
                          self.fleet.ring(model) if not tried else None)
            replica = next(r for r in candidates if r.name == choice.replica)
            self.metrics.decisions.labels(model, choice.reason).inc()
            if tried:
                self.metrics.retries.labels(model).inc()
            tried.add(replica.name)
            result = await self._attempt(request, raw, model, replica, choice.reason, start, route)
            if isinstance(result, web.StreamResponse):
                if route is not None and route.verify and self.monitor is not None and isinstance(result, Relayed) \
                        and result.kept:
                    self.monitor.offer(route, request.path, body, bytes(result.kept), result.content_type_seen)
                return result
            retry_after = max(retry_after, result)
        self.metrics.requests.labels(model, "", "refused").inc()
        return error(429, f"every ready replica of {model!r} refused or failed the request; retry later",
                     "rate_limit_error", **{"Retry-After": f"{retry_after:.0f}"})

    async def _attempt(self, request: web.Request, raw: bytes, model: str, replica: Replica, reason: str,
                       start: float, route: Route | None = None) -> web.StreamResponse | float:
        """Send the request to one replica. Returns the relayed response, or the Retry-After (seconds) to honour
        when the replica refused or could not be reached before anything was sent to the client."""
        assert self.session is not None
        headers = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
        replica.in_flight += 1
        try:
            sent = time.perf_counter()
            async with self.session.post(f"{replica.url}{request.path}", data=raw, headers=headers) as upstream:
                answered = time.perf_counter()
                if upstream.status in RETRY_STATUSES:
                    self.metrics.upstream_errors.labels(model, f"http_{upstream.status}").inc()
                    await upstream.read()
                    return _retry_after(upstream.headers.get("Retry-After"))
                return await self._relay(request, upstream, model, replica, reason, (sent - start, answered),
                                         route)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as e:
            self.metrics.upstream_errors.labels(model, "connect").inc()
            log.warning("replica %s of %s failed before answering: %s", replica.name, model, e)
            if isinstance(e, aiohttp.ClientConnectorError | TimeoutError):
                self.fleet.mark(model, replica, False)  # unreachable: out until the next scrape finds it answering
            # Otherwise a connection it had open went away (a kept-alive one it was closing as we reused it, or one
            # it reset): that says nothing of the next one, so only this request moves. Taking the replica out sent
            # everything to the other for a scrape's time (a unit test read 40 requests against 0).
            return 1.0
        finally:
            replica.finished()

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse, model: str, replica: Replica,
                     reason: str, timing: tuple[float, float], route: Route | None) -> web.StreamResponse:
        """Relay the replica's answer as it comes; a stream cut by the replica ends with an error event. An
        answer the quality monitor sampled is also kept (up to CAPTURE_MAX)."""
        before_send, answered = timing
        headers = {h: v for h, v in upstream.headers.items() if h in ("Content-Type", "Cache-Control", "Retry-After")}
        headers[ROUTE_HEADER] = f"replica={replica.name}; reason={reason}"
        if route is not None:
            headers[TIER_HEADER] = route.header()
        resp = Relayed(status=upstream.status, headers=headers)
        resp.content_type_seen = upstream.headers.get("Content-Type", "")
        keep = route is not None and route.verify and upstream.status == 200
        await resp.prepare(request)
        first = True
        outcome = "ok" if upstream.status < 400 else f"http_{upstream.status}"
        try:
            async for chunk in upstream.content.iter_any():
                await resp.write(chunk)
                if keep:
                    resp.kept += chunk
                    keep = len(resp.kept) <= CAPTURE_MAX
                if first:
                    first = False
                    self.metrics.added_latency.observe(before_send + time.perf_counter() - answered)
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
            # Bytes already reached the client: never retried (the client would see a repeated answer).
            outcome = "cut"
            self.metrics.upstream_errors.labels(model, "cut").inc()
            log.warning("replica %s of %s cut a response: %s", replica.name, model, e)
            if upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
                event = {"error": {"message": f"the replica serving this request failed: {e}",
                                   "type": "upstream_error", "code": 502}}
                await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        self.metrics.requests.labels(model, replica.name, outcome).inc()
        if not keep or outcome != "ok":
            resp.kept.clear()  # only a whole answer is verified
        await resp.write_eof()
        return resp

    async def call(self, model: str, path: str, body: dict[str, Any]) -> tuple[bytes, str] | None:
        """The router's own request to a served model (a verification replay): the least-loaded ready replica, one
        attempt, never held. The answer and its content type, or None when nothing answered 200."""
        assert self.session is not None
        ready = self.fleet.ready(model)
        if not ready:
            return None
        choice = pick([r.load() for r in ready], None, self.epsilon)
        replica = next(r for r in ready if r.name == choice.replica)
        replica.in_flight += 1
        try:
            async with self.session.post(f"{replica.url}{path}", json=body) as upstream:
                data = await upstream.read()
                return (data, upstream.headers.get("Content-Type", "")) if upstream.status == 200 else None
        except (aiohttp.ClientError, TimeoutError) as e:
            log.info("replica %s of %s failed a router call: %s", replica.name, model, e)
            return None
        finally:
            replica.finished()

    async def _classify(self, model: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """A classifier model's completions answer, as JSON (None if it did not answer)."""
        got = await self.call(model, "/v1/completions", body)
        try:
            answer = json.loads(got[0]) if got is not None else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        return answer if isinstance(answer, dict) else None


class Relayed(web.StreamResponse):
    """A relayed response, with the whole answer when it was kept for verification."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.kept = bytearray()
        self.content_type_seen = ""  # the upstream's Content-Type, as relayed


def _retry_after(value: str | None) -> float:
    try:
        return max(1.0, float(value)) if value else 1.0
    except ValueError:
        return 1.0


def static_endpoints(specs: Iterable[str]) -> dict[str, dict[str, str]]:
    """MODEL=URL[,URL...] flags → model → {replica name: URL}; names are the URLs' host:port."""
    out: dict[str, dict[str, str]] = {}
    for spec in specs:
        model, sep, urls = spec.partition("=")
        if not sep or not model or not urls:
            raise ValueError(f"--endpoint {spec!r}: expected MODEL=URL[,URL...]")
        for url in urls.split(","):
            url = url.rstrip("/")
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--endpoint {spec!r}: {url!r} must start with http:// or https://")
            out.setdefault(model, {})[url.split("://", 1)[1]] = url
    return out


def wire(fleet: Fleet, holds: HoldQueue, **options: Any) -> Router:
    """A router over a fleet whose first ready replica of a model releases that model's held requests (as does the
    model's removal: they are answered 404 then)."""
    router = Router(fleet, holds, **options)
    fleet.on_ready = fleet.on_gone = holds.release
    return router


async def serve(router: Router, host: str, port: int,
                scrape_interval_s: float) -> tuple[web.AppRunner, int, asyncio.Task[None]]:
    """Start the router's HTTP server and its scrape loop; returns the runner, the bound port and the loop's task."""
    # handler_cancellation: a client that disconnects cancels its handler, which closes the upstream
    # request, which the agent takes as an abort that frees the KV blocks.
    runner = web.AppRunner(router.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    bound = runner.addresses[0][1]
    scraper = asyncio.create_task(router.fleet.scrape_forever(scrape_interval_s), name="kvfleet-router scrape")
    return runner, int(bound), scraper
