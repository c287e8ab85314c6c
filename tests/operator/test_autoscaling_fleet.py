"""fleet.py: agent pods → ready (scraped at podIP and the port named http), starting, unschedulable; startups."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from kvfleet_operator.autoscaling.fleet import StartupTracker, classify, metrics_url, timestamp

T0 = timestamp("2026-01-01T00:00:00Z") or 0.0


def at(seconds: float) -> str:
    return datetime.fromtimestamp(T0 + seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod(name: str, *, ready: bool = False, ip: str | None = "10.0.0.1", created: float = 0, ready_at: float = 0,
        unschedulable_at: float | None = None, phase: str = "Running", deleting: bool = False,
        port: int = 8000) -> dict[str, Any]:
    conds = [{"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": at(ready_at)}]
    if unschedulable_at is not None:
        conds.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                      "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
                      "lastTransitionTime": at(unschedulable_at)})
        phase, ip = "Pending", None
    meta: dict[str, Any] = {"name": name, "uid": f"uid-{name}", "creationTimestamp": at(created)}
    if deleting:
        meta["deletionTimestamp"] = at(created + 1)
    status: dict[str, Any] = {"phase": phase, "conditions": conds}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "status": status,
            "spec": {"containers": [{"name": "agent", "ports": [{"name": "grpc", "containerPort": 50051},
                                                                {"name": "http", "containerPort": port}]}]}}


def test_classification() -> None:
    pods = [pod("a", ready=True, ready_at=40), pod("b", created=50), pod("c", unschedulable_at=10, created=10),
            pod("d", unschedulable_at=80, created=80), pod("e", ready=True, deleting=True),
            pod("f", phase="Failed"), pod("g", ready=True, ip=None)]
    fleet = classify(pods, T0 + 100, unschedulable_grace=60)
    assert [p.name for p in fleet.ready] == ["a"]
    assert [p.name for p in fleet.starting] == ["b", "c", "d", "g"]  # pending ones are capacity on the way
    assert [p.name for p in fleet.unschedulable] == ["c"]  # d is within the grace
    assert "Insufficient nvidia.com/gpu" in fleet.unschedulable[0].unschedulable_message
    assert fleet.targets() == [("a", "http://10.0.0.1:8000/metrics")]
    assert fleet.starting_ages(T0 + 100) == (50.0, 90.0, 20.0, 100.0)


def test_metrics_url_uses_the_pod_ip_and_the_port_named_http() -> None:
    assert metrics_url(pod("a", ip="10.1.2.3", port=9000)) == "http://10.1.2.3:9000/metrics"
    assert metrics_url(pod("a", ip="fd00::7")) == "http://[fd00::7]:8000/metrics"
    assert metrics_url(pod("a", ip=None)) is None


def test_startups_are_learned_once_per_pod_seen_starting() -> None:
    tracker = StartupTracker.empty()
    # After a restart: a pod already ready teaches nothing (its Ready time may come from a later flap).
    assert tracker.observe(classify([pod("old", ready=True, ready_at=500), pod("new", created=100)],
                                    T0 + 600, 60)) == ()
    assert tracker.observe(classify([pod("old", ready=True), pod("new", ready=True, created=100, ready_at=190)],
                                    T0 + 620, 60)) == (90.0,)
    # Unready and ready again is a readiness flap, not a startup.
    assert tracker.observe(classify([pod("new", created=100)], T0 + 700, 60)) == ()
    assert tracker.observe(classify([pod("new", ready=True, created=100, ready_at=710)], T0 + 720, 60)) == ()
    assert tracker.ever_ready == {"uid-new"}  # pods that are gone are forgotten
