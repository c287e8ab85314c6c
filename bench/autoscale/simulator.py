"""The discrete-event loop: arrivals routed by kvfleet-router's picker, pods starting and draining, scalers ticking."""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol, cast

from replica import Replica, ReplicaModel, Request
from workload import RequestMix, Trace, arrivals

from kvfleet_operator.autoscaling.scrape import Snapshot
from kvfleet_router.picker import ReplicaLoad, pick

ROUTER_EPSILON = 0.25  # kvfleet-router's default --epsilon


class Fleet:
    """The Deployment's pods. Scale-down deletes not-ready pods first, then the newest ready (ReplicaSet order);
    a deleted ready pod drains: it leaves the endpoints, finishes what it holds, then goes away."""

    def __init__(self, model: ReplicaModel, replicas: int, seed: int, horizon: float) -> None:
        self.model, self.seed, self.horizon = model, seed, horizon
        self.pods: list[Replica] = []
        self.draining: list[Replica] = []
        self.spec = 0
        self._created = 0
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
        """Integrate pods that hold a GPU (starting, ready, draining) up to `now`, never past the horizon."""
        now = min(now, self.horizon)
        if now > self._last:
            self.pod_seconds += (len(self.pods) + len(self.draining)) * (now - self._last)
            self._last = now

    def scale(self, n: int, now: float, initial: bool = False) -> list[Replica]:
        """Set spec replicas; returns pods created (their ready time is ready_at)."""
        self.account(now)
        if n != self.spec and not initial:
            self.events.append((now, n - self.spec))
        self.spec = n
        created = []
        while len(self.pods) < n:
            self._created += 1
            delay = 0.0 if initial else self._startup(len(self.pods) + 1)
            pod = Replica(f"pod-{self._created}", self.model, now, now + delay)
            pod.last = now
            self.pods.append(pod)
            created.append(pod)
        while len(self.pods) > n:
            starting = [p for p in self.pods if not p.ready]
            victim = starting[-1] if starting else self.pods[-1]  # pods are kept in creation order
            self.pods.remove(victim)
            if victim.ready and victim.load:
                victim.ready, victim.draining = False, True
                self.draining.append(victim)
        return created

    def ready_pods(self) -> list[Replica]:
        return [p for p in self.pods if p.ready]

    def scrape(self, now: float) -> list[Snapshot]:
        """/metrics of every ready pod (a loading agent does not serve it yet)."""
        return [p.snapshot(now) for p in self.pods if p.ready]

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


def simulate(trace: Trace, policy: Autoscaler, model: ReplicaModel, initial: int, mix: RequestMix,
             seed: int = 1, sample_s: float = 15.0) -> RunResult:
    """Run `trace` under `policy`; ticking stops at the trace's end, then the requests left are served to the end."""
    fleet = Fleet(model, initial, seed, trace.duration_s)
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
    held: list[Request] = []  # arrivals while no pod is ready wait at the gateway
    done: list[Request] = []
    result = RunResult(policy.name, trace.name, requests, 0.0, fleet.events)
    end = trace.duration_s
    while queue:
        now, _, kind, payload = heapq.heappop(queue)
        if kind == ARRIVAL:
            assert isinstance(payload, Request)
            requests.append(payload)
            nxt = next(stream, None)
            if nxt is not None:
                push(nxt.arrival, ARRIVAL, nxt)
            ready = fleet.ready_pods()
            if not ready:
                held.append(payload)
                continue
            # kvfleet-router's own picking function: these traces carry no prompts, so it is its least-load path.
            choice = pick([ReplicaLoad(p.name, p.load) for p in ready], None, ROUTER_EPSILON)
            pod = next(p for p in ready if p.name == choice.replica)
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
                payload.ready = True
                fleet.startups.append(now - payload.created)
                for req in held:
                    schedule(payload, payload.add(req, now))
                held.clear()
        elif kind == TICK:
            if now >= end:
                continue
            desired = policy.tick(now, fleet)
            if desired != fleet.spec:
                for pod in fleet.scale(desired, now):
                    push(pod.ready_at, READY, pod)
            push(now + policy.interval, TICK, None)
        elif kind == SAMPLE and now < end:
            result.timeline.append((now, fleet.spec, len(fleet.ready_pods())))
            push(now + sample_s, SAMPLE, None)
    fleet.account(end)  # nothing after the trace's end is billed: the drain only finishes measuring latency
    result.pod_seconds = fleet.pod_seconds
    return result
