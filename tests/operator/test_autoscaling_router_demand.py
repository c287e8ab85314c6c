"""router_demand: the held gauge parsed from real expositions, scraped over real HTTP, router pods found by label."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fake_kube import FakeKube
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from router_stub import RouterStub, router_pod

from kvfleet_contract import metrics as contract
from kvfleet_operator.autoscaling.router_demand import (
    ROUTER_SELECTOR,
    RouterDemand,
    held_requests,
    router_demand,
    router_targets,
    scrape_routers,
)
from kvfleet_operator.autoscaling.scrape import ParseError
from kvfleet_operator.kube import ApiError

LABELS = [contract.MODEL_LABEL, contract.NAMESPACE_LABEL, contract.DEPLOYMENT_LABEL]


def exposition(*samples: tuple[str, str, str, float], labels: list[str] = LABELS) -> str:
    registry = CollectorRegistry()
    g = Gauge(contract.ROUTER_HELD_REQUESTS, "held", labels, registry=registry)
    for *values, n in samples:
        g.labels(*values).set(n)
    return generate_latest(registry).decode()


def test_held_requests_by_namespace_and_deployment_summed_over_models() -> None:
    text = exposition(("llama", "a", "chat", 3), ("llama-lora", "a", "chat", 2), ("llama", "b", "chat", 1),
                      ("static", "", "", 7), ("orphan", "a", "", 4))  # static endpoints carry no deployment
    assert held_requests(text) == {("a", "chat"): 5.0, ("b", "chat"): 1.0}


def test_a_router_holding_nothing_answers_with_an_empty_map() -> None:
    assert held_requests(exposition()) == {}  # TYPE line, no sample: the labelled gauge was never set
    assert held_requests(exposition(("llama", "a", "chat", 0))) == {("a", "chat"): 0.0}


def test_a_body_without_the_gauge_or_not_an_exposition_is_refused() -> None:
    other = CollectorRegistry()
    Gauge("kvfleet_requests_waiting", "", ["model"], registry=other).labels("m").set(1)
    with pytest.raises(ParseError, match="missing kvfleet_router_held_requests"):
        held_requests(generate_latest(other).decode())
    with pytest.raises(ParseError, match="not a Prometheus exposition"):
        held_requests('kvfleet_router_held_requests{model="m" 1\n')


def test_router_targets_are_the_ready_pods_with_an_ip_at_their_http_port() -> None:
    pods = [router_pod("r1", 9001), router_pod("r0", 9000, namespace="other"),
            router_pod("starting", 9002, ready=False), router_pod("leaving", 9003, terminating=True)]
    no_port = router_pod("bare", 0)
    no_port["spec"]["containers"][0]["ports"] = []
    no_ip = router_pod("pending", 9004)
    del no_ip["status"]["podIP"]
    assert router_targets([*pods, no_port, no_ip]) == [
        ("ns/bare", f"http://127.0.0.1:{contract.ROUTER_PORT}/metrics"), ("ns/r1", "http://127.0.0.1:9001/metrics"),
        ("other/r0", "http://127.0.0.1:9000/metrics")]


def serve(n: int, body: Any) -> None:
    """Run body(routers) against n started RouterStubs, stopping them afterwards."""
    async def main() -> None:
        routers = [RouterStub() for _ in range(n)]
        for r in routers:
            await r.start()
        try:
            await body(routers)
        finally:
            for r in routers:
                await r.stop()

    asyncio.run(main())


def test_scrape_sums_answering_routers_and_skips_the_others_by_name() -> None:
    async def body(routers: list[RouterStub]) -> None:
        a, b, failing, stalled, gone = routers
        a.hold(3)
        a.hold(2, namespace="ns", name="other")
        b.hold(1)
        failing.status = 503
        stalled.stall = True
        await gone.stop()  # its port now refuses connections
        url = "http://127.0.0.1:{}/metrics".format
        demand = await scrape_routers([("ns/a", url(a.port)), ("ns/b", url(b.port)), ("ns/failing", url(failing.port)),
                                       ("ns/stalled", url(stalled.port)), ("ns/gone", url(gone.port))], timeout=5.0)
        assert demand.held == {("ns", "m"): 4.0, ("ns", "other"): 2.0} and demand.of("ns", "m") == 4.0
        assert demand.of("ns", "absent") == 0.0
        assert demand.reporting == ("ns/a", "ns/b")
        assert list(demand.texts) == ["ns/a", "ns/b"]  # each answering router's body, for its tier metrics
        assert held_requests(demand.texts["ns/a"]) == {("ns", "m"): 3.0, ("ns", "other"): 2.0}
        assert demand.errors["ns/failing"] == "HTTP 503"
        assert demand.errors["ns/stalled"] == "timeout after 5s"
        assert demand.errors["ns/gone"].startswith("ClientConnectorError")
        assert await scrape_routers([]) == RouterDemand()

    serve(5, body)


class ForbiddenIn(FakeKube):
    """The in-memory API, refusing to list pods in one namespace (as a Role limited to others would)."""

    def __init__(self, forbidden: str) -> None:
        super().__init__()
        self.forbidden = forbidden
        self.listed: list[tuple[str, str]] = []

    async def list(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        self.listed.append((namespace, label_selector))
        if namespace == self.forbidden:
            raise ApiError(403, "Forbidden", f'pods is forbidden in the namespace "{namespace}"')
        return await super().list(kind, namespace, label_selector)


def test_router_demand_lists_each_namespace_once_by_label_and_reports_a_forbidden_one() -> None:
    async def body(routers: list[RouterStub]) -> None:
        here, there = routers
        here.hold(2)
        there.hold(5)
        kube = ForbiddenIn("secret")
        kube.add(router_pod("r-here", here.port))
        kube.add(router_pod("r-there", there.port, namespace="shared"))
        agent = router_pod("agent", here.port)
        agent["metadata"]["labels"] = {"app.kubernetes.io/name": "kvfleet-agent"}
        kube.add(agent)  # another app's pod is not a router, whatever it serves
        demand = await router_demand(kube, ["ns", "shared", "ns", "secret"], timeout=5.0)
        assert kube.listed == [("ns", ROUTER_SELECTOR), ("shared", ROUTER_SELECTOR), ("secret", ROUTER_SELECTOR)]
        assert demand.of("ns", "m") == 7.0 and demand.reporting == ("ns/r-here", "shared/r-there")
        assert list(demand.errors) == ["secret/*"] and "403 Forbidden" in demand.errors["secret/*"]
        assert (here.scrapes, there.scrapes) == (1, 1)

    serve(2, body)
