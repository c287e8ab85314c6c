"""Pure: an InferenceDeployment's agent pods → ready (with the URL to scrape), starting, unschedulable."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kvfleet_operator.builders import HTTP_PORT


def timestamp(value: str | None) -> float | None:
    """A Kubernetes RFC3339 timestamp as Unix seconds (None when absent or unreadable)."""
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@dataclass(frozen=True)
class Pod:
    """The parts of one agent pod the autoscaler reads."""

    name: str
    uid: str
    created: float
    ready_since: float | None  # when Ready last turned True; None while not ready
    url: str | None  # http://<podIP>:<port named http>/metrics, once it has an IP
    unschedulable_since: float | None = None  # PodScheduled=False reason Unschedulable since
    unschedulable_message: str = ""


@dataclass(frozen=True)
class Fleet:
    """ready: Ready=True with a pod IP (scraped). starting: exists, not ready, not terminating (pending ones
    included: capacity on the way). unschedulable: the starting pods the scheduler has refused past the grace."""

    ready: tuple[Pod, ...]
    starting: tuple[Pod, ...]
    unschedulable: tuple[Pod, ...]

    def targets(self) -> list[tuple[str, str]]:
        """(pod name, metrics URL) of each ready pod."""
        return [(p.name, p.url) for p in self.ready if p.url is not None]

    def starting_ages(self, now: float) -> tuple[float, ...]:
        """Seconds since creation of each starting pod."""
        return tuple(max(0.0, now - p.created) for p in self.starting)


def _conditions(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c.get("type", ""): c for c in (pod.get("status") or {}).get("conditions") or []}


def metrics_url(pod: dict[str, Any]) -> str | None:
    """The agent's /metrics on the pod IP, at the container port named `http` (the port the builders give it)."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    ports = [p for c in (pod.get("spec") or {}).get("containers") or [] for p in c.get("ports") or []]
    port = next((p.get("containerPort") for p in ports if p.get("name") == "http"), HTTP_PORT)
    host = f"[{ip}]" if ":" in ip else ip  # IPv6
    return f"http://{host}:{port}/metrics"


def pod_view(pod: dict[str, Any], now: float) -> Pod:
    meta = pod.get("metadata") or {}
    conds = _conditions(pod)
    ready = conds.get("Ready", {})
    sched = conds.get("PodScheduled", {})
    created = timestamp(meta.get("creationTimestamp")) or now
    is_ready = ready.get("status") == "True"
    unschedulable = sched.get("status") == "False" and sched.get("reason") == "Unschedulable"
    return Pod(name=meta.get("name", ""), uid=meta.get("uid", ""), created=created,
               ready_since=(timestamp(ready.get("lastTransitionTime")) or now) if is_ready else None,
               url=metrics_url(pod),
               unschedulable_since=(timestamp(sched.get("lastTransitionTime")) or created) if unschedulable else None,
               unschedulable_message=str(sched.get("message") or "") if unschedulable else "")


def classify(pods: Iterable[dict[str, Any]], now: float, unschedulable_grace: float) -> Fleet:
    """Sort the pods. Terminating and finished pods count for nothing: they are leaving. A Ready pod without
    an IP cannot be scraped and does not count as ready (it cannot serve traffic through the Service either)."""
    ready: list[Pod] = []
    starting: list[Pod] = []
    blocked: list[Pod] = []
    for pod in pods:
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        view = pod_view(pod, now)
        if view.ready_since is not None and view.url is not None:
            ready.append(view)
            continue
        starting.append(view)
        if view.unschedulable_since is not None and now - view.unschedulable_since >= unschedulable_grace:
            blocked.append(view)
    key = lambda p: p.name  # noqa: E731  # deterministic order for status messages and tests
    return Fleet(tuple(sorted(ready, key=key)), tuple(sorted(starting, key=key)), tuple(sorted(blocked, key=key)))


@dataclass
class StartupTracker:
    """Learns startup durations (creation → Ready) from pods seen starting and then ready, once per pod.

    A pod already ready when first seen (operator restart) teaches nothing: its Ready time may come from a later
    readiness flap. A pod that was ready and turns unready and ready again is not a new startup either."""

    starting: set[str]
    ever_ready: set[str]

    @classmethod
    def empty(cls) -> StartupTracker:
        return cls(set(), set())

    def observe(self, fleet: Fleet) -> tuple[float, ...]:
        """Startup durations of pods that became ready since the last call."""
        samples: list[float] = []
        for p in fleet.ready:
            if p.uid in self.starting and p.uid not in self.ever_ready and p.ready_since is not None:
                samples.append(max(0.0, p.ready_since - p.created))
            self.ever_ready.add(p.uid)
        alive = {p.uid for p in (*fleet.ready, *fleet.starting)}
        self.starting = (self.starting | {p.uid for p in fleet.starting if p.uid not in self.ever_ready}) & alive
        self.ever_ready &= alive
        return tuple(samples)
