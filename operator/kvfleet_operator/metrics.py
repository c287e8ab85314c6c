"""The operator's own Prometheus metrics and its /healthz + /metrics HTTP endpoint."""

from __future__ import annotations

import logging
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

log = logging.getLogger(__name__)

REGISTRY = CollectorRegistry()
RECONCILES = Counter("kvfleet_operator_reconciles", "Reconciles of InferenceDeployments by trigger and result",
                     ["trigger", "result"], registry=REGISTRY)
RECONCILE_SECONDS = Histogram("kvfleet_operator_reconcile_duration_seconds", "Time one reconcile took",
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=REGISTRY)
APPLY_ERRORS = Counter("kvfleet_operator_apply_errors", "Failed writes to the Kubernetes API by kind",
                       ["kind"], registry=REGISTRY)
DESIRED_REPLICAS = Gauge("kvfleet_operator_desired_replicas", "Replicas the operator asks each Deployment for",
                         ["namespace", "name"], registry=REGISTRY)


async def serve(port: int, healthy: Callable[[], bool]) -> tuple[web.AppRunner, int]:
    """Start /healthz (200 while `healthy()`, else 503) and /metrics; returns the runner and the bound port."""

    async def healthz(_: web.Request) -> web.Response:
        ok = healthy()
        return web.Response(status=200 if ok else 503, text="ok\n" if ok else "not ready\n")

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "0.0.0.0", port)
    await site.start()
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    bound = int(sockets[0].getsockname()[1]) if sockets else port
    log.info("health and metrics endpoint listening", extra={"port": bound})
    return runner, bound
