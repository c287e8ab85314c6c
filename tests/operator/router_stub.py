"""A stand-in kvfleet-router for the autoscaler's tests: the held-requests gauge (the contract's name and labels,
from prometheus_client) on /metrics of a loopback port the OS picks, and a router pod pointing at it."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from kvfleet_contract import metrics as contract


class RouterStub:
    """`hold()` sets the gauge; `status` other than 200 makes /metrics fail that way; `stall` makes it never answer."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.held = Gauge(contract.ROUTER_HELD_REQUESTS, "Requests held for a model with no ready replica.",
                          [contract.MODEL_LABEL, contract.NAMESPACE_LABEL, contract.DEPLOYMENT_LABEL],
                          registry=self.registry)
        self.status = 200
        self.stall = False
        self.port = 0
        self.scrapes = 0
        self._runner: web.AppRunner | None = None
        self._never = asyncio.Event()

    def hold(self, n: float, *, namespace: str = "ns", name: str = "m", model: str = "m") -> None:
        self.held.labels(model=model, namespace=namespace, inference_deployment=name).set(n)

    async def start(self) -> None:
        async def metrics(_: web.Request) -> web.Response:
            self.scrapes += 1
            if self.stall:
                await self._never.wait()  # until the client gives up (its timeout), or the server stops
            if self.status != 200:
                return web.Response(status=self.status, text="unavailable")
            return web.Response(body=generate_latest(self.registry), content_type="text/plain")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            self._never.set()
            await self._runner.cleanup()
            self._runner = None


def router_pod(name: str, port: int, *, namespace: str = "ns", ready: bool = True,
               terminating: bool = False) -> dict[str, Any]:
    """A router pod as the API returns it: labelled app.kubernetes.io/name=kvfleet-router, its port named http."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "uid": f"router-{namespace}-{name}",
                            "labels": {"app.kubernetes.io/name": contract.ROUTER_APP}}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [{"name": "router", "ports": [{"name": "http", "containerPort": port}]}]},
            "status": {"phase": "Running", "podIP": "127.0.0.1",
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}
