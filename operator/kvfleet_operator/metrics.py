"""The operator's own Prometheus metrics and its /healthz + /metrics HTTP endpoint."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

from kvfleet_contract.exposition import ExpositionRegistry

log = logging.getLogger(__name__)



REGISTRY = ExpositionRegistry()
RECONCILES = Counter("kvfleet_operator_reconciles", "Reconciles of InferenceDeployments by trigger and result",
                     ["trigger", "result"], registry=REGISTRY)
RECONCILE_SECONDS = Histogram("kvfleet_operator_reconcile_duration_seconds", "Time one reconcile took",
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=REGISTRY)
APPLY_ERRORS = Counter("kvfleet_operator_apply_errors", "Failed writes to the Kubernetes API by kind",
                       ["kind"], registry=REGISTRY)
DESIRED_REPLICAS = Gauge("kvfleet_operator_desired_replicas",
                         "Replicas the operator last asked each Deployment for, by why (spec: spec.replicas; "
                         "else the autoscaler's limitedBy, none when its proposal was applied as is)",
                         ["namespace", "name", "reason"], registry=REGISTRY)
SCRAPE_ERRORS = Counter("kvfleet_operator_scrape_errors", "Failed scrapes of agent /metrics by the autoscaler",
                        ["reason"], registry=REGISTRY)
AUTOSCALE_TICKS = Counter("kvfleet_operator_autoscale_ticks", "Builtin autoscaler rounds by result",
                          ["result"], registry=REGISTRY)
DEMAND = Gauge("kvfleet_operator_autoscale_demand_tokens_per_second",
               "The builtin autoscaler's demand estimate: arrivals at the window's tokens per request (NaN: the "
               "capacity model had no flow this round)", ["namespace", "name"], registry=REGISTRY)
CAPACITY = Gauge("kvfleet_operator_autoscale_replica_capacity_tokens_per_second",
                 "Tokens/s one replica serves within the targets, as the capacity model estimates it (NaN: none)",
                 ["namespace", "name"], registry=REGISTRY)
_desired_reason: dict[tuple[str, str], str] = {}  # the one series per object kept, so an old reason does not linger


def set_desired(namespace: str, name: str, reason: str, replicas: int) -> None:
    """Set the desired-replicas gauge of one object under `reason`, dropping its series of any previous reason."""
    old = _desired_reason.get((namespace, name))
    if old is not None and old != reason:
        with contextlib.suppress(KeyError):
            DESIRED_REPLICAS.remove(namespace, name, old)
    _desired_reason[namespace, name] = reason
    DESIRED_REPLICAS.labels(namespace=namespace, name=name, reason=reason).set(replicas)


def set_capacity(namespace: str, name: str, proposals: Sequence[Any]) -> None:
    """Set the demand and per-replica capacity gauges from a decision's "capacity" proposal (NaN without one)."""
    p = next((p for p in proposals if p.source == "capacity"), None)
    DEMAND.labels(namespace=namespace, name=name).set(math.nan if p is None else p.observed)
    CAPACITY.labels(namespace=namespace, name=name).set(math.nan if p is None else p.target)


def forget(namespace: str, name: str) -> None:
    """Drop an object's series (it was deleted)."""
    reason = _desired_reason.pop((namespace, name), None)
    if reason is not None:
        with contextlib.suppress(KeyError):
            DESIRED_REPLICAS.remove(namespace, name, reason)
    for gauge in (DEMAND, CAPACITY):
        with contextlib.suppress(KeyError):
            gauge.remove(namespace, name)


def scrape_error_reason(error: str) -> str:
    """A short class for a scrape error line of scrape.scrape_pods: timeout, http, parse or connection."""
    if error.startswith("timeout"):
        return "timeout"
    if error.startswith("HTTP "):
        return "http"
    if error.startswith("parse"):
        return "parse"
    return "connection"


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
