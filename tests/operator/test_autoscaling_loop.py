"""loop.tick() and run(): real agent-like /metrics servers on 127.0.0.1, an in-memory API, a fake clock."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from aiohttp import web
from fake_kube import FakeKube
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from kvfleet_operator import metrics
from kvfleet_operator.autoscaling import loop
from kvfleet_operator.builders import selector_labels
from kvfleet_operator.config import OperatorConfig
from kvfleet_operator.reconcile import reconcile_object
from kvfleet_operator.state import OperatorState
from kvfleet_operator.status import InferenceDeploymentStatus

T0 = 1767225600.0  # 2026-01-01T00:00:00Z
AUTOSCALING: dict[str, Any] = {
    "mode": "builtin", "minReplicas": 1, "maxReplicas": 6, "intervalSeconds": 5, "windowSeconds": 30,
    "targets": {"queueDepthPerReplica": 4, "latency": [{"metric": "ttft", "percentile": 95, "seconds": 0.5}]},
    "behavior": {"scaleDown": {"stabilizationWindowSeconds": 20}}}


class Agent:
    """The agent's metric contract (queue gauges, TTFT histogram) on a loopback port; `down` answers 503."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.waiting = Gauge("kvfleet_requests_waiting", "", ["model"], registry=self.registry).labels(model="m")
        self.running = Gauge("kvfleet_requests_running", "", ["model"], registry=self.registry).labels(model="m")
        self.ttft = Histogram("kvfleet_time_to_first_token_seconds", "", ["model"], registry=self.registry,
                              buckets=(0.005, 0.05, 0.1, 0.5, 1.0, 5.0)).labels(model="m")
        self.down = False
        self.port = 0
        self._runner: web.AppRunner | None = None

    def load(self, waiting: int, running: int, ttft: float = 0.05, n: int = 20) -> None:
        self.waiting.set(waiting)
        self.running.set(running)
        for _ in range(n):
            self.ttft.observe(ttft)

    async def start(self) -> None:
        async def metrics(_: web.Request) -> web.Response:
            if self.down:
                return web.Response(status=503, text="loading")
            return web.Response(body=generate_latest(self.registry), content_type="text/plain")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


def at(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod(name: str, port: int, *, created: float, ready_at: float | None = None,
        unschedulable: bool = False) -> dict[str, Any]:
    ready = {"type": "Ready", "status": "True" if ready_at is not None else "False",
             "lastTransitionTime": at(ready_at if ready_at is not None else created)}
    conds = [ready]
    if unschedulable:
        conds.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                      "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu.",
                      "lastTransitionTime": at(created)})
    status: dict[str, Any] = {"phase": "Pending" if unschedulable else "Running", "conditions": conds}
    if not unschedulable:
        status["podIP"] = "127.0.0.1"
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ns", "uid": f"pod-{name}", "labels": selector_labels("m"),
                         "creationTimestamp": at(created)},
            "spec": {"containers": [{"name": "agent", "ports": [{"name": "http", "containerPort": port}]}]},
            "status": status}


class Harness:
    """A builtin-mode InferenceDeployment reconciled into the fake API, a fake clock and the events posted."""

    def __init__(self, autoscaling: dict[str, Any] | None = None) -> None:
        self.kube = FakeKube()
        self.kube.add({"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceDeployment",
                       "metadata": {"name": "m", "namespace": "ns", "uid": "u1", "generation": 1},
                       "spec": {"model": {"name": "m", "source": {"pvc": {"claimName": "c"}}},
                                "autoscaling": autoscaling or AUTOSCALING}})
        self.state = OperatorState(OperatorConfig(scrape_timeout_seconds=1.0, unschedulable_grace_seconds=60),
                                   self.kube)
        self.now = T0
        self.events: list[tuple[str, str, str]] = []

    async def setup(self) -> None:
        await reconcile_object("ns", "m", self.state)

    def add_pod(self, body: dict[str, Any]) -> None:
        self.kube.add(body)

    async def tick(self, advance: float = 15.0) -> float | None:
        self.now += advance
        return await loop.tick("ns", "m", "u1", self.state, clock=lambda: self.now, post_event=self.post)

    def post(self, body: Any, *, type: str, reason: str, message: str) -> None:
        assert body["metadata"]["uid"] == "u1"
        self.events.append((type, reason, message))

    @property
    def replicas(self) -> int:
        return int(self.kube.objects["Deployment", "ns", "m"]["spec"]["replicas"])

    @property
    def status(self) -> dict[str, Any]:
        return self.kube.objects["InferenceDeployment", "ns", "m"]["status"]

    def condition(self, type_: str) -> tuple[str, str]:
        c = next(c for c in self.status["conditions"] if c["type"] == type_)
        return c["status"], c["reason"]


def run(body: Callable[[Harness, list[Agent]], Awaitable[None]], agents: int = 3,
        autoscaling: dict[str, Any] | None = None) -> None:
    async def main() -> None:
        h, started = Harness(autoscaling), [Agent() for _ in range(agents)]
        for a in started:
            await a.start()
        try:
            await h.setup()
            await body(h, started)
        finally:
            for a in started:
                await a.stop()

    asyncio.run(main())


def test_scale_up_cold_start_partial_metrics_and_scale_down_after_the_window() -> None:
    async def body(h: Harness, agents: list[Agent]) -> None:
        a, b, c = agents
        h.add_pod(pod("m-a", a.port, created=T0 - 100, ready_at=T0 - 60))
        a.load(waiting=16, running=4)
        assert await h.tick() == 5.0  # the CR's intervalSeconds
        # 20 in flight on one replica at a target of 4: up to 3 (queue depth grows faster than load).
        assert h.replicas == 3 and h.events[-1][:2] == ("Normal", "ScaledUp")
        assert "1 → 3 replicas: queue depth 20" in h.events[-1][2]
        last = h.status["autoscaling"]["lastDecision"]
        assert (last["currentReplicas"], last["desiredReplicas"], last["time"]) == (1, 3, at(h.now))
        assert h.condition("ScalingActive") == ("True", "ValidMetricFound")
        assert h.condition("MetricsAvailable") == ("True", "AllReplicasReporting")
        assert h.condition("Ready")[0] == "False"  # the reconcile's conditions survive the autoscaler's write

        # Two replicas loading: the same demand does not add pods again (capacity on the way).
        h.add_pod(pod("m-b", b.port, created=h.now + 1))
        h.add_pod(pod("m-c", c.port, created=h.now + 1))
        a.load(waiting=16, running=4)
        await h.tick()
        assert h.replicas == 3 and h.status["autoscaling"]["lastDecision"]["startingReplicas"] == 2

        # They turn ready after 24 s: a learned startup time; load spreads.
        created = h.now - 14
        for name, agent in (("m-b", b), ("m-c", c)):
            h.add_pod(pod(name, agent.port, created=created, ready_at=created + 24))
        for agent in agents:
            agent.load(waiting=2, running=2)
        await h.tick()
        assert h.replicas == 3 and h.status["autoscaling"]["expectedStartupSeconds"] == 24.0
        # kubectl describe prints it with its unit, and how many start-ups it is learned from (both pods).
        assert (h.status["autoscaling"]["expectedStartup"], h.status["autoscaling"]["startupSamples"]) == ("24.0s", 2)
        assert 0 < h.status["autoscaling"]["lastTtftP95Seconds"] <= 0.05

        # Two agents unreachable, and the one that answers is idle: never scale down on partial data, say so.
        a.load(waiting=0, running=0, n=0)
        b.down = True
        await c.stop()
        errors = {r: metrics.REGISTRY.get_sample_value("kvfleet_operator_scrape_errors_total", {"reason": r}) or 0
                  for r in ("http", "connection")}
        for _ in range(3):
            await h.tick()
        for r in ("http", "connection"):
            assert metrics.REGISTRY.get_sample_value("kvfleet_operator_scrape_errors_total", {"reason": r}) == (
                errors[r] + 3)
        assert h.replicas == 3 and h.status["autoscaling"]["lastDecision"]["limitedBy"] == "partialMetrics"
        status, reason = h.condition("MetricsAvailable")
        assert (status, reason) == ("False", "ScrapeFailed")
        message = next(x for x in h.status["conditions"] if x["type"] == "MetricsAvailable")["message"]
        assert "1/3 ready pods reported" in message and "m-b: HTTP 503" in message and "m-c:" in message
        assert [e[1] for e in h.events if e[0] == "Warning"] == ["ScrapeFailed"]  # once, not every round

        # Metrics back and busy, then idle: held by the 20 s scale-down window, then down.
        b.down = False
        await c.start()
        h.add_pod(pod("m-c", c.port, created=created, ready_at=created + 24))
        for agent in agents:
            agent.load(waiting=2, running=2)
        await h.tick()
        assert h.condition("MetricsAvailable") == ("True", "AllReplicasReporting")
        for agent in agents:
            agent.load(waiting=0, running=0, n=0)
        assert await h.tick(advance=5) == 5.0
        assert h.replicas == 3 and h.status["autoscaling"]["lastDecision"]["limitedBy"] == "scaleDownStabilization"
        assert h.condition("ScalingLimited") == ("True", "ScaleDownStabilization")
        await h.tick(advance=25)
        assert h.replicas < 3 and h.events[-1][1] == "ScaledDown"
        assert [d["desiredReplicas"] for d in h.status["autoscaling"]["history"]] == [h.replicas, 3]
        InferenceDeploymentStatus.model_validate(h.status)  # the shape the CRD's schema enforces

    run(body)


def test_unschedulable_pods_block_scale_up() -> None:
    async def body(h: Harness, agents: list[Agent]) -> None:
        h.kube.objects["Deployment", "ns", "m"]["spec"]["replicas"] = 2
        h.add_pod(pod("m-a", agents[0].port, created=T0 - 300, ready_at=T0 - 200))
        h.add_pod(pod("m-b", 0, created=T0 - 100, unschedulable=True))  # Pending for 115 s by the first round
        agents[0].load(waiting=40, running=8)
        await h.tick()
        assert h.replicas == 2 and h.status["autoscaling"]["lastDecision"]["limitedBy"] == "capacityBlocked"
        assert h.condition("CapacityBlocked") == ("True", "Unschedulable")
        assert h.events == [("Warning", "Unschedulable", next(
            c["message"] for c in h.status["conditions"] if c["type"] == "CapacityBlocked"))]
        assert "Insufficient nvidia.com/gpu" in h.events[0][2]
        labels = {"namespace": "ns", "name": "m"}
        assert metrics.REGISTRY.get_sample_value("kvfleet_operator_desired_replicas",
                                                 {**labels, "reason": "capacityBlocked"}) == 2
        agents[0].load(waiting=0, running=0)
        await h.tick()
        assert metrics.REGISTRY.get_sample_value("kvfleet_operator_desired_replicas",
                                                 {**labels, "reason": "capacityBlocked"}) is None  # one series
        assert h.condition("CapacityBlocked") == ("True", "Unschedulable") and len(h.events) == 1

    run(body, agents=1)


def test_a_round_changes_nothing_unless_builtin_and_ends_with_the_object() -> None:
    async def body(h: Harness, agents: list[Agent]) -> None:
        cr = h.kube.objects["InferenceDeployment", "ns", "m"]
        cr["spec"]["autoscaling"] = {**AUTOSCALING, "mode": "external"}
        writes = len(h.kube.writes)
        assert await h.tick() == 5.0 and len(h.kube.writes) == writes
        cr["metadata"]["uid"] = "u2"  # deleted and recreated under the same name
        assert await h.tick() is None
        # The loop returns by itself, without waiting, and forgets the object's memory.
        waits: list[float] = []

        async def sleep(seconds: float) -> None:
            waits.append(seconds)

        loop.memory(h.state, "u1")
        await loop.run("ns", "m", "u1", h.state, sleep=sleep)
        assert "u1" not in h.state.memories and waits == []

    run(body, agents=0)


def test_the_loop_waits_its_interval_and_skips_rounds_while_another_instance_leads() -> None:
    async def body(h: Harness, agents: list[Agent]) -> None:
        leading = [False, True]
        waits: list[float] = []

        async def is_leading() -> bool:
            return leading.pop(0) if leading else True

        async def sleep(seconds: float) -> None:
            waits.append(seconds)
            if len(waits) == 2:
                h.kube.objects["InferenceDeployment", "ns", "m"]["metadata"]["uid"] = "u2"  # then it is replaced

        h.state.leadership.leading = is_leading
        writes = len(h.kube.writes)
        await loop.run("ns", "m", "u1", h.state, sleep=sleep)
        # Round 1 skipped (not leading): the default interval; round 2 decided: the CR's 5 s; round 3: gone.
        assert waits == [loop.DEFAULT_INTERVAL, 5.0]
        assert [w for w in h.kube.writes[writes:] if w[2] == "status"] == [
            ("apply", "InferenceDeployment", "status", "kvfleet-autoscaler")]

    run(body, agents=0)
