"""loop.tick() and run(): real agent-like /metrics servers on 127.0.0.1, an in-memory API, a fake clock."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, cast

import pytest
from aiohttp import web
from fake_kube import FakeKube
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvfleet_contract import metrics as contract
from kvfleet_operator import metrics
from kvfleet_operator.autoscaling import loop
from kvfleet_operator.autoscaling.decide import AutoscalerState, AutoscalingPolicy, Decision, Observation, decide
from kvfleet_operator.autoscaling.decision import Flow
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
    """The agent's metric contract (queue gauges, TTFT histogram) on a loopback port; `down` answers 503. With
    `tokens`, also what the capacity model reads: the request and token counters, KV usage, the queue-time
    histogram (an agent without them is an older one: the queue rule decides)."""

    def __init__(self, tokens: bool = False) -> None:
        self.registry = CollectorRegistry()
        self.waiting = Gauge("kvfleet_requests_waiting", "", ["model"], registry=self.registry).labels(model="m")
        self.running = Gauge("kvfleet_requests_running", "", ["model"], registry=self.registry).labels(model="m")
        self.ttft = Histogram("kvfleet_time_to_first_token_seconds", "", ["model"], registry=self.registry,
                              buckets=(0.005, 0.05, 0.1, 0.5, 1.0, 5.0)).labels(model="m")
        if tokens:
            r = self.registry
            self.requests = Counter(contract.REQUESTS, "", ["model", "outcome"], registry=r).labels("m", "stop")
            self.prompt = Counter(contract.PROMPT_TOKENS, "", ["model"], registry=r).labels("m")
            self.output = Counter(contract.GENERATION_TOKENS, "", ["model"], registry=r).labels("m")
            self.kv = Gauge(contract.KV_CACHE_USAGE, "", ["model"], registry=r).labels("m")
            self.queue = Histogram(contract.QUEUE_TIME, "", ["model"], registry=r,
                                   buckets=contract.QUEUE_BUCKETS).labels("m")
        self.down = False
        self.port = 0
        self._runner: web.AppRunner | None = None

    def load(self, waiting: int, running: int, ttft: float = 0.05, n: int = 20) -> None:
        self.waiting.set(waiting)
        self.running.set(running)
        for _ in range(n):
            self.ttft.observe(ttft)

    def serve(self, done: int, prompt: int, output: int, wait: float = 0.02, kv: float = 0.5) -> None:
        """`done` more requests finished, with `prompt` + `output` tokens, each having waited `wait` seconds."""
        self.requests.inc(done)
        self.prompt.inc(prompt)
        self.output.inc(output)
        self.kv.set(kv)
        for _ in range(done):
            self.queue.observe(wait)

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
        return cast(dict[str, Any], self.kube.objects["InferenceDeployment", "ns", "m"]["status"])

    def condition(self, type_: str) -> tuple[str, str]:
        c = next(c for c in self.status["conditions"] if c["type"] == type_)
        return c["status"], c["reason"]


def run(body: Callable[[Harness, list[Agent]], Awaitable[None]], agents: int = 3,
        autoscaling: dict[str, Any] | None = None, tokens: bool = False) -> None:
    async def main() -> None:
        h, started = Harness(autoscaling), [Agent(tokens) for _ in range(agents)]
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


def test_unschedulable_pods_limit_scale_up_to_the_pending_budget() -> None:
    async def body(h: Harness, agents: list[Agent]) -> None:
        h.kube.objects["Deployment", "ns", "m"]["spec"]["replicas"] = 2
        h.add_pod(pod("m-a", agents[0].port, created=T0 - 300, ready_at=T0 - 200))
        h.add_pod(pod("m-b", 0, created=T0 - 100, unschedulable=True))  # Pending for 115 s by the first round
        agents[0].load(waiting=40, running=8)
        await h.tick()
        # 48 on the one ready replica at a target of 4, the Pending one counted on its way: the queue asks
        # ceil(1 × 12^(2/3)) = 6. A node autoscaler provisions for Pending pods: with 1 unschedulable, the
        # default budget of 4 leaves room for 3 more, so 5 (the old rule froze at 2).
        budget = AutoscalingPolicy().unschedulable_budget
        assert h.replicas == 2 + budget - 1 == 5
        assert h.status["autoscaling"]["lastDecision"]["limitedBy"] == "capacityBlocked"
        assert h.condition("CapacityBlocked") == ("True", "Unschedulable")
        message = next(c["message"] for c in h.status["conditions"] if c["type"] == "CapacityBlocked")
        assert [e[:2] for e in h.events] == [("Normal", "ScaledUp"), ("Warning", "Unschedulable")]
        assert h.events[1] == ("Warning", "Unschedulable", message)
        assert "Insufficient nvidia.com/gpu" in h.events[1][2]
        assert "1 unschedulable pod, at most 4 pending at once" in h.events[0][2]
        labels = {"namespace": "ns", "name": "m"}
        assert metrics.REGISTRY.get_sample_value("kvfleet_operator_desired_replicas",
                                                 {**labels, "reason": "capacityBlocked"}) == 5
        agents[0].load(waiting=0, running=0)
        await h.tick()
        assert metrics.REGISTRY.get_sample_value("kvfleet_operator_desired_replicas",
                                                 {**labels, "reason": "capacityBlocked"}) is None  # one series
        assert h.condition("CapacityBlocked") == ("True", "Unschedulable") and len(h.events) == 2

    run(body, agents=1)


def close(f: Flow | None, expected: Flow) -> bool:
    """The same flow, but for float rounding."""
    return f is not None and f.pods == expected.pods and (f.completed, f.arrived, f.prompt_tokens, f.output_tokens) == (
        pytest.approx((expected.completed, expected.arrived, expected.prompt_tokens, expected.output_tokens)))


def test_the_capacity_model_reads_the_agents_token_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Observation] = []
    decisions: list[Decision] = []

    def spy(policy: AutoscalingPolicy, obs: Observation, state: AutoscalerState) -> Decision:
        seen.append(obs)
        decisions.append(decide(policy, obs, state))
        return decisions[-1]

    def gauges() -> tuple[float | None, float | None]:
        labels = {"namespace": "ns", "name": "m"}
        return (metrics.REGISTRY.get_sample_value("kvfleet_operator_autoscale_demand_tokens_per_second", labels),
                metrics.REGISTRY.get_sample_value("kvfleet_operator_autoscale_replica_capacity_tokens_per_second",
                                                  labels))

    async def body(h: Harness, agents: list[Agent]) -> None:
        (a,) = agents
        h.add_pod(pod("m-a", a.port, created=T0 - 300, ready_at=T0 - 200))
        a.load(waiting=2, running=2)
        a.kv.set(0.5)
        await h.tick()
        # The first scrape: counters read once, no flow yet, the queue rule decides (4 at target 4: keep).
        first = seen[-1]
        assert (first.flow, first.flow_last, first.queue_time_p95, first.kv_usage) == (None, None, None, 0.5)
        assert [p["source"] for p in h.status["autoscaling"]["lastDecision"]["proposals"]] == ["queue"]
        demand, per = gauges()
        assert demand is not None and per is not None and math.isnan(demand) and math.isnan(per)

        # 15 s later: 30 finished (2/s), 3000 prompt and 1500 output tokens (200 + 100 per second), still holding
        # 4: 30 arrived. Each waited 0.02 s: all in the (0.01, 0.025] bucket, so p95 = 0.01 + 0.015 × 0.95.
        a.serve(30, 3000, 1500, wait=0.02, kv=0.75)
        a.load(waiting=2, running=2)
        await h.tick()
        o = seen[-1]
        assert o.flow == Flow(2.0, 2.0, 200.0, 100.0, 1) and o.flow_last == o.flow
        assert o.queue_time_p95 == pytest.approx(0.01 + 0.015 * 0.95)
        assert o.kv_usage == 0.75
        # Demand: 2 requests/s of 150 tokens, 300 tokens/s, against what one replica serves holding its queue
        # target, which is where it runs (4 held): 300. One replica's worth: keep 1.
        assert decisions[-1].proposals[0].source == "capacity"
        assert gauges() == pytest.approx((300.0, 300.0))
        assert h.replicas == 1 and h.status["autoscaling"]["lastDecision"]["reason"].startswith(
            "demand 300 tokens/s against 300 tokens/s per replica at queue target 4 with 1 ready")

        # The next 15 s: 60 finished (4/s) with 9000 tokens, holding 8: 64 arrived (4.27/s). The window (30 s):
        # 90 finished (3/s), 94 arrived, 13500 tokens: 150 a request; demand takes the last interval's higher
        # arrivals: 4.27 × 150 = 640 tokens/s, past what one replica serves: scale up on the model.
        a.serve(60, 6000, 3000, wait=0.02)
        a.load(waiting=4, running=4)
        await h.tick()
        o = seen[-1]
        assert close(o.flow, Flow(3.0, 94 / 30, 300.0, 150.0, 1))
        assert close(o.flow_last, Flow(4.0, 64 / 15, 400.0, 200.0, 1))
        model = decisions[-1].proposals[0]
        assert model.source == "capacity" and model.observed == pytest.approx(640.0)
        assert gauges() == pytest.approx((640.0, model.target))
        assert h.replicas == model.replicas > 1 and h.events[-1][1] == "ScaledUp"
        assert "demand 640 tokens/s against" in h.events[-1][2]

        # The agent stops answering: no flow, queue wait or KV usage from a silent pod (its window still holds
        # the old TTFT percentile), the gauges go NaN, and nothing scales.
        a.down = True
        scaled = h.replicas
        await h.tick()
        o = seen[-1]
        assert (o.reporting_replicas, o.flow, o.flow_last, o.queue_time_p95, o.kv_usage) == (0, None, None, None, None)
        assert o.latency["ttft_p95"] is not None
        assert h.replicas == scaled and h.status["autoscaling"]["lastDecision"]["limitedBy"] == "noMetrics"
        demand, per = gauges()
        assert demand is not None and per is not None and math.isnan(demand) and math.isnan(per)

    monkeypatch.setattr(loop, "decide", spy)
    run(body, agents=1, tokens=True)


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

        h.state.leadership.leading = is_leading  # type: ignore[method-assign]
        writes = len(h.kube.writes)
        await loop.run("ns", "m", "u1", h.state, sleep=sleep)
        # Round 1 skipped (not leading): the default interval; round 2 decided: the CR's 5 s; round 3: gone.
        assert waits == [loop.DEFAULT_INTERVAL, 5.0]
        assert [w for w in h.kube.writes[writes:] if w[2] == "status"] == [
            ("apply", "InferenceDeployment", "status", "kvfleet-autoscaler")]

    run(body, agents=0)
