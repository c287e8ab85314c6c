"""The discrete-event loop: arrivals routed by kvfleet-router's picker, pods starting and draining, scalers ticking."""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol, cast

from replica import Replica, ReplicaModel, Request
from workload import RequestMix, Trace, arrivals

from kvfleet_operator.autoscaling.scrape import Snapshot
from kvfleet_router.picker import ReplicaLoad, pick

ROUTER_EPSILON = 0.25  # kvfleet-router's default --epsilon

FaultKind = Literal["none", "metrics-dropout", "never-ready", "unschedulable"]
FAULTS: tuple[FaultKind, ...] = ("none", "metrics-dropout", "never-ready", "unschedulable")


def fault_kind(name: str) -> FaultKind:
    """A fault's name, checked."""
    for kind in FAULTS:
        if kind == name:
            return kind
    raise ValueError(f"unknown fault {name!r}; one of {', '.join(FAULTS)}")


@dataclass(frozen=True)
class Fault:
    """What goes wrong, the same for every policy.

    metrics-dropout: from `at` for `seconds`, every pod's /metrics scrape fails.
    never-ready: the first pod created by a scale-up at or after `at` never becomes ready (it stays starting).
    unschedulable: the first pod created by a scale-up at or after `at` stays Pending (Unschedulable) for
    `seconds`, as if waiting for a node autoscaler, then starts as any pod does.
    The suite sets `at` to when the trace's load first rises, so that the fault lands in the same phase of the
    trace under every policy (a policy that adds a pod in the quiet stretch before would otherwise spend the fault
    there).
    """

    kind: FaultKind = "none"
    at: float = 0.0
    seconds: float = 60.0

    @classmethod
    def of(cls, kind: FaultKind, trace: Trace) -> Fault:
        """The suite's faults, from the moment the trace's load first rises: a 60 s dropout; a pod that never
        becomes ready; a 10-minute Pending."""
        return cls(kind, trace.rise_s, 600.0 if kind == "unschedulable" else 60.0)


class Fleet:
    """The Deployment's pods. Scale-down deletes Pending pods first, then not-ready ones, then the newest ready
    (ReplicaSet order, newest first within each); a deleted ready pod drains: it leaves the endpoints, finishes
    what it holds, then goes away. `held`: requests the router holds because no pod was ready."""

    def __init__(self, model: ReplicaModel, replicas: int, seed: int, horizon: float, fault: Fault | None = None
                 ) -> None:
        self.model, self.seed, self.horizon = model, seed, horizon
        self.fault = fault or Fault()
        self.pods: list[Replica] = []
        self.draining: list[Replica] = []
        self.held: list[Request] = []
        self.spec = 0
        self._created = 0
        self._faulted = False  # the fault's pod (never-ready, unschedulable) was created
        self.startups: list[float] = []  # creation → ready, of pods that became ready since the last take
        self.pod_seconds = 0.0
        self._last = 0.0
        self.events: list[tuple[float, int]] = []  # (time, change of spec replicas)
        self.scale(replicas, 0.0, initial=True)

    def _startup(self, slot: int) -> float:
        # The pod that brings the fleet to `slot` replicas takes the same time under every policy (and the k-th
        # creation does not), so that luck in startup times does not favour whichever policy created fewer pods.
        r = random.Random(self.seed * 1_000_003 + slot).random()
        return self.model.startup_min_s + r * (self.model.startup_max_s - self.model.startup_min_s)

    def account(self, now: float) -> None:
        """Integrate pods that hold a GPU (starting, ready, draining) up to `now`, never past the horizon. A Pending
        pod holds none: it is billed from when it is scheduled."""
        now = min(now, self.horizon)
        if now > self._last:
            for p in self.pods:
                self.pod_seconds += max(0.0, now - max(self._last, p.pending_until))
            self.pod_seconds += len(self.draining) * (now - self._last)
            self._last = now

    def scale(self, n: int, now: float, initial: bool = False) -> list[Replica]:
        """Set spec replicas; returns pods created (their ready time is ready_at, inf if never)."""
        self.account(now)
        if n != self.spec and not initial:
            self.events.append((now, n - self.spec))
        self.spec = n
        created = []
        while len(self.pods) < n:
            self._created += 1
            delay = 0.0 if initial else self._startup(len(self.pods) + 1)
            pod = Replica(f"pod-{self._created}", self.model, now, now + delay)
            if (not initial and not self._faulted and self.fault.kind in ("never-ready", "unschedulable")
                    and now >= self.fault.at):
                self._faulted = True
                if self.fault.kind == "never-ready":
                    pod.ready_at = math.inf
                else:
                    pod.pending_until = now + self.fault.seconds
                    pod.ready_at = pod.pending_until + delay
            pod.last = now
            self.pods.append(pod)
            created.append(pod)
        while len(self.pods) > n:
            starting = [p for p in self.pods if not p.ready]
            pending = [p for p in starting if p.pending_until > now]
            victim = (pending or starting or self.pods)[-1]  # pods are kept in creation order
            self.pods.remove(victim)
            if victim.ready and victim.load:
                victim.ready, victim.draining = False, True
                self.draining.append(victim)
        return created

    def ready_pods(self) -> list[Replica]:
        return [p for p in self.pods if p.ready]

    def metrics_up(self, now: float) -> bool:
        """Whether the pods' /metrics answer at `now` (not during a metrics-dropout)."""
        f = self.fault
        return not (f.kind == "metrics-dropout" and f.at <= now < f.at + f.seconds)

    def scrape(self, now: float) -> list[Snapshot]:
        """/metrics of every ready pod (a loading agent does not serve it yet); nothing during a dropout."""
        return [p.snapshot(now) for p in self.pods if p.ready] if self.metrics_up(now) else []

    def loads(self, now: float) -> dict[str, float] | None:
        """Waiting + running of each ready pod as its /metrics reads (the baselines' metric); None during a
        dropout (the scrape failed)."""
        return {p.name: float(p.load) for p in self.pods if p.ready} if self.metrics_up(now) else None

    def pending(self, now: float) -> list[Replica]:
        """Pods not scheduled yet (Pending, Unschedulable)."""
        return [p for p in self.pods if p.pending_until > now]

    def unschedulable(self, now: float, grace: float) -> int:
        """Pods Pending as Unschedulable for at least `grace` seconds (as the operator's fleet.classify counts)."""
        return sum(1 for p in self.pods if p.pending_until > now and now - p.created >= grace)

    def starting_ages(self, now: float) -> tuple[float, ...]:
        return tuple(now - p.created for p in self.pods if not p.ready)

    def take_startups(self) -> tuple[float, ...]:
        out, self.startups = tuple(self.startups), []
        return out


class Autoscaler(Protocol):
    """A policy under test: every `interval` seconds it looks at the fleet and returns the desired replicas."""

    name: str
    interval: float

    def tick(self, now: float, fleet: Fleet) -> int: ...


@dataclass
class RunResult:
    """Everything the report needs from one trace × policy run."""

    policy: str
    trace: str
    requests: list[Request]
    pod_seconds: float
    events: list[tuple[float, int]]
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (time, spec replicas, ready)
    p95_series: tuple[list[float], list[float]] = ([], [])  # rolling TTFT p95, filled in for plots


ARRIVAL, POD, READY, TICK, SAMPLE = range(5)


def simulate(trace: Trace, policy: Autoscaler, model: ReplicaModel, initial: int, mix: RequestMix | None = None,
             seed: int = 1, sample_s: float = 15.0, fault: Fault | None = None) -> RunResult:
    """Run `trace` under `policy` (`mix` None: the trace's own); ticking stops at the trace's end, then the requests
    left are served to the end."""
    fleet = Fleet(model, initial, seed, trace.duration_s, fault)
    for p in fleet.pods:
        p.ready = True
    queue: list[tuple[float, int, int, object]] = []
    seq = 0

    def push(t: float, kind: int, payload: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(queue, (t, seq, kind, payload))

    def schedule(pod: Replica, t: float | None) -> None:
        if t is not None:
            push(t, POD, (pod, pod.version))

    stream: Iterator[Request] = arrivals(trace, mix, seed)
    first = next(stream, None)
    if first is not None:
        push(first.arrival, ARRIVAL, first)
    push(policy.interval, TICK, None)
    push(0.0, SAMPLE, None)
    requests: list[Request] = []
    held = fleet.held  # arrivals while no pod is ready wait at the router
    done: list[Request] = []
    result = RunResult(policy.name, trace.name, requests, 0.0, fleet.events)
    end = trace.duration_s
    ready: list[Replica] | None = None  # the ready pods (creation order), rebuilt once a pod turns ready or leaves
    by_name: dict[str, Replica] = {}
    while queue:
        now, _, kind, payload = heapq.heappop(queue)
        if kind == ARRIVAL:
            assert isinstance(payload, Request)
            requests.append(payload)
            nxt = next(stream, None)
            if nxt is not None:
                push(nxt.arrival, ARRIVAL, nxt)
            if ready is None:
                ready = fleet.ready_pods()
                by_name = {p.name: p for p in ready}
            if not ready:
                held.append(payload)
                continue
            # kvfleet-router's own picking function: these traces carry no prompts, so it is its least-load path.
            choice = pick([ReplicaLoad(p.name, p.load) for p in ready], None, ROUTER_EPSILON)
            pod = by_name[choice.replica]
            schedule(pod, pod.add(payload, now))
        elif kind == POD:
            pod, version = cast(tuple[Replica, int], payload)
            if version != pod.version:
                continue
            schedule(pod, pod.step_events(now, done))
            if pod.draining and not pod.load:
                fleet.account(now)
                fleet.draining.remove(pod)
        elif kind == READY:
            assert isinstance(payload, Replica)
            if payload in fleet.pods:
                payload.ready, ready = True, None
                fleet.startups.append(now - payload.created)
                for req in held:
                    schedule(payload, payload.add(req, now))
                held.clear()
        elif kind == TICK:
            if now >= end:
                continue
            desired = policy.tick(now, fleet)
            if desired != fleet.spec:
                ready = None
                for pod in fleet.scale(desired, now):
                    if math.isfinite(pod.ready_at):
                        push(pod.ready_at, READY, pod)
            push(now + policy.interval, TICK, None)
        elif kind == SAMPLE and now < end:
            result.timeline.append((now, fleet.spec, len(fleet.ready_pods())))
            push(now + sample_s, SAMPLE, None)
    fleet.account(end)  # nothing after the trace's end is billed: the drain only finishes measuring latency
    result.pod_seconds = fleet.pod_seconds
    return result
