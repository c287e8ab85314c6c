"""loop.tick() at zero's door: a real agent and kvfleet-router stand-ins over HTTP, the in-memory API, a fake clock."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import Counter
from router_stub import RouterStub, router_pod
from test_autoscaling_loop import AUTOSCALING, T0, Agent, Harness, pod

from kvfleet_contract import metrics as contract
from kvfleet_operator.autoscaling.loop import router_scope
from kvfleet_operator.config import OperatorConfig
from kvfleet_operator.plan import SCALED_TO_ZERO
from kvfleet_operator.status import InferenceDeploymentStatus

# No scale-down window: the queue's wish for zero shows at once, and only the idle window stands in its way.
ZERO: dict[str, Any] = {**AUTOSCALING, "minReplicas": 0, "scaleToZeroAfterSeconds": 10,
                        "behavior": {"scaleDown": {"stabilizationWindowSeconds": 0}}}


class CountingAgent(Agent):
    """The loop tests' agent, with the requests-by-outcome counter the idle test reads."""

    def __init__(self) -> None:
        super().__init__()
        self.requests = Counter(contract.REQUESTS, "", [contract.MODEL_LABEL, contract.OUTCOME_LABEL],
                                registry=self.registry)

    def serve(self, n: int = 1) -> None:
        """Requests that came and finished between two scrapes: the gauges never saw them."""
        self.requests.labels("m", "stop").inc(n)


def run(body: Callable[[Harness, CountingAgent, RouterStub], Awaitable[None]]) -> None:
    async def main() -> None:
        h, agent, router = Harness(ZERO), CountingAgent(), RouterStub()
        await agent.start()
        await router.start()
        try:
            await h.setup()
            h.add_pod(router_pod("router-0", router.port, namespace="gateway"))  # routers may live elsewhere
            await body(h, agent, router)
        finally:
            await agent.stop()
            await router.stop()

    asyncio.run(main())


def reason(h: Harness) -> str:
    return str(h.status["autoscaling"]["lastDecision"]["reason"])


def test_idle_for_the_window_goes_to_zero_and_a_held_request_brings_a_replica_back() -> None:
    async def body(h: Harness, agent: CountingAgent, router: RouterStub) -> None:
        assert h.replicas == 1  # minReplicas 0 still creates one replica
        h.add_pod(pod("m-a", agent.port, created=T0 - 100, ready_at=T0 - 60))
        agent.load(waiting=0, running=0, n=0)
        await h.tick(advance=5)
        assert h.replicas == 1 and reason(h).endswith("(not idle: request counters not read twice yet)")
        await h.tick(advance=5)  # the first idle round starts the window
        agent.serve()  # one request in and out between rounds: the window starts again
        await h.tick(advance=5)
        assert h.replicas == 1 and reason(h).endswith(
            "(not idle: 1 request finished or refused since the last round)")
        await h.tick(advance=5)
        await h.tick(advance=5)
        assert h.replicas == 1 and reason(h).endswith("(idle for 5s)")
        await h.tick(advance=5)
        assert h.replicas == 0 and h.events[-1][:2] == ("Normal", "ScaledDown")
        assert h.events[-1][2] == ("1 → 0 replicas: idle for 10s (scale-to-zero window 10s): no request waiting, "
                                   "running or arriving at 1 ready, none held at 1 router; scaling to 0")
        assert h.condition("Ready") == ("False", "ScaledToZero")
        assert next(c for c in h.status["conditions"] if c["type"] == "Ready")["message"] == SCALED_TO_ZERO
        assert h.condition("ScalingActive") == ("True", "ScaledToZero")

        del h.kube.objects["Pod", "ns", "m-a"]  # the ReplicaSet removed it
        await h.tick(advance=5)
        assert h.replicas == 0 and reason(h) == "scaled to zero: nothing held at 1 router; keeping 0"
        assert h.condition("MetricsAvailable") == ("True", "RoutersReporting")

        router.hold(3)
        await h.tick(advance=5)
        assert h.replicas == 1 and h.events[-1] == (
            "Normal", "ScaledUp", "0 → 1 replicas: 3 requests held at the router for this deployment: scaling 0 → 1")
        assert [d["desiredReplicas"] for d in h.status["autoscaling"]["history"]] == [1, 0]
        InferenceDeploymentStatus.model_validate(h.status)

    run(body)


def test_a_router_that_cannot_be_read_keeps_the_fleet_from_zero_and_is_named_at_zero() -> None:
    async def body(h: Harness, agent: CountingAgent, router: RouterStub) -> None:
        h.add_pod(pod("m-a", agent.port, created=T0 - 100, ready_at=T0 - 60))
        agent.load(waiting=0, running=0, n=0)
        router.status = 503
        for _ in range(6):
            await h.tick(advance=5)
        assert h.replicas == 1 and reason(h).endswith(
            "keeping 1: no kvfleet-router answered (1 router could not be read), and only requests held at a router "
            "bring a replica back from zero")

        router.status = 200
        for _ in range(3):
            await h.tick(advance=5)
        assert h.replicas == 0
        del h.kube.objects["Pod", "ns", "m-a"]
        router.status = 503
        await h.tick(advance=5)
        assert h.replicas == 0 and h.condition("MetricsAvailable") == ("False", "RouterScrapeFailed")
        message = next(c for c in h.status["conditions"] if c["type"] == "MetricsAvailable")["message"]
        assert "0/1 kvfleet-routers reported" in message and "gateway/router-0: HTTP 503" in message
        assert [e[1] for e in h.events if e[0] == "Warning"] == ["RouterScrapeFailed"]

        del h.kube.objects["Pod", "gateway", "router-0"]  # no router left at all
        await h.tick(advance=5)
        assert h.condition("MetricsAvailable") == ("False", "NoRouter")
        assert h.status["autoscaling"]["lastDecision"]["limitedBy"] == "noRouter"

    run(body)


def test_routers_are_looked_for_where_the_operator_watches() -> None:
    assert router_scope(OperatorConfig()) is None  # cluster-wide: every namespace, in one list
    assert router_scope(OperatorConfig(namespaces=("team-a", "gateway"))) == ("team-a", "gateway")
