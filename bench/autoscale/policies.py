"""The policies compared: kvfleet's real decision function, and ports of the HPA and KubeAI algorithms."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from replica import ReplicaModel
from simulator import Autoscaler, Fleet

from kvfleet_operator.autoscaling.decide import (
    AutoscalerState,
    AutoscalingPolicy,
    Behavior,
    Decision,
    LatencyTarget,
    Observation,
    Recommendation,
    ScaleEvent,
    ScalingPolicy,
    ScalingRules,
    decide,
    rate_limit,
    stabilize,
)
from kvfleet_operator.autoscaling.scrape import MetricsWindow
from kvfleet_operator.config import OperatorConfig

UNSCHEDULABLE_GRACE_S = OperatorConfig().unschedulable_grace_seconds  # Pending this long → counted unschedulable


class Kvfleet:
    """kvfleet_operator.autoscaling.decide.decide() fed through MetricsWindow, as the operator's timer would do."""

    def __init__(self, policy: AutoscalingPolicy, interval: float = 15.0, window_s: float = 60.0) -> None:
        self.name, self.interval, self.policy = "kvfleet", interval, policy
        self.window = MetricsWindow(window_s)
        self.state = AutoscalerState()
        self.decisions: list[Decision] = []

    def tick(self, now: float, fleet: Fleet) -> int:
        """One round of the operator's loop (autoscaling/loop.py's tick), with the simulated fleet and router."""
        snaps = fleet.scrape(now)
        ready = fleet.ready_pods()
        # As the loop does: the window follows the ready pods (one that misses a scrape keeps its history).
        self.window.update(snaps, live={p.name for p in ready}, now=now)
        complete = len(snaps) == len(ready)
        queue: float | None = None
        queue_mean: float | None = None
        if snaps:  # with a pod missing, the window's sums would mix in its stale sample: this round's sum only
            if complete:
                queue, queue_mean = self.window.queue_depth(), self.window.mean_queue_depth()
            else:
                queue = sum(s.queue_depth for s in snaps)
        latency = {t.source: self.window.latency(t.metric, t.percentile / 100) for t in self.policy.latency_targets}
        kv = [s.kv_usage for s in snaps if s.kv_usage is not None]
        obs = Observation(now, fleet.spec, len(ready), len(fleet.pods) - len(ready), len(snaps),
                          unschedulable_replicas=fleet.unschedulable(now, UNSCHEDULABLE_GRACE_S),
                          queue_depth=queue, queue_depth_mean=queue_mean,
                          request_rate=self.window.request_rate(),
                          latency=latency, new_startup_durations=fleet.take_startups(),
                          starting_ages=fleet.starting_ages(now),
                          held_requests=float(len(fleet.held)), routers_reporting=1,  # one router, always read
                          requests_arrived=self.window.arrivals() if complete else None,
                          flow=self.window.flow(), flow_last=self.window.flow(last=True),
                          queue_time_p95=self.window.quantile("queue", 0.95),
                          kv_usage=max(kv) if kv else None)
        d = decide(self.policy, obs, self.state)
        self.state = d.state
        self.decisions.append(d)
        return d.desired_replicas


# HPA's defaults (pkg/apis/autoscaling/v2/defaults.go): up max(100%, 4 pods)/15 s, no window; down 100%/15 s
# after a 300 s window.
HPA_BEHAVIOR = Behavior(ScalingRules(0, (ScalingPolicy("Percent", 100, 15), ScalingPolicy("Pods", 4, 15))),
                        ScalingRules(300, (ScalingPolicy("Percent", 100, 15),)))


class Hpa:
    """Kubernetes HPA v2 on a Pods metric (waiting + running per pod, AverageValue target), sync every 15 s.

    replica_calculator.go's calcPlainMetricReplicas: readiness is ignored for non-CPU metrics, so a pod that
    reports counts whatever it is; a loading pod (the agent serves /metrics only once loaded) is a *missing*
    pod: on scale-up it counts as 0, on scale-down as exactly the target, and no change if that flips the
    direction. The metric is read fresh at each sync (Prometheus and the adapter add delay in practice: this
    favours the HPA). Stabilization and rate limits are the same HPA semantics kvfleet's decide() uses.
    """

    def __init__(self, target: float, min_replicas: int, max_replicas: int, tolerance: float = 0.1) -> None:
        self.name, self.interval = "hpa", 15.0
        self.target, self.min, self.max, self.tolerance = target, min_replicas, max_replicas, tolerance
        self.recs: tuple[Recommendation, ...] = ()
        self.events: tuple[ScaleEvent, ...] = ()

    def _metric_replicas(self, fleet: Fleet, now: float) -> int | None:
        current = fleet.spec
        metrics = fleet.loads(now)
        if not metrics:
            return None  # "did not receive metrics for targeted pods": the HPA does not scale
        # groupPods: a Pending pod is unready (ignored, or 0 on a scale-up); a pod without metrics is missing.
        unready = len(fleet.pending(now))
        missing = len(fleet.pods) - unready - len(metrics)
        values = list(metrics.values())
        ratio = sum(values) / len(values) / self.target
        rebalance_unready = unready > 0 and ratio > 1
        if not rebalance_unready and missing == 0:
            return current if abs(ratio - 1) <= self.tolerance else math.ceil(ratio * len(values))
        filled = values + [0.0 if ratio >= 1 else self.target] * missing + [0.0] * (unready if rebalance_unready
                                                                                  else 0)
        new_ratio = sum(filled) / len(filled) / self.target
        if abs(new_ratio - 1) <= self.tolerance or (ratio < 1 < new_ratio) or (ratio > 1 > new_ratio):
            return current
        n = math.ceil(new_ratio * len(filled))
        return current if (new_ratio < 1 and n > current) or (new_ratio > 1 and n < current) else n

    def tick(self, now: float, fleet: Fleet) -> int:
        current = fleet.spec
        raw = self._metric_replicas(fleet, now)
        if raw is None:
            return current
        if not self.recs:  # maybeInitScaleDownStabilizationWindow
            self.recs = (Recommendation(now, current),)
        up, down = HPA_BEHAVIOR.scale_up, HPA_BEHAVIOR.scale_down
        stabilized = stabilize(current, raw, self.recs, up, down, now)
        self.recs = (*(r for r in self.recs if r.time > now - 300), Recommendation(now, raw))
        desired = min(max(rate_limit(current, stabilized, self.events, up, down, now), self.min), self.max)
        self.events = tuple(e for e in self.events if e.time > now - 15)
        if desired != current:
            self.events = (*self.events, ScaleEvent(now, desired - current))
        return desired


class KubeAI:
    """KubeAI's model autoscaler (internal/modelautoscaler, modelclient.Scale), defaults of its chart.

    Every 10 s: the sum of in-flight requests across the model's pods goes into a simple moving average of
    timeWindow/interval = 600 s / 10 s = 60 samples; desired = ceil(average / targetRequests) within
    [min, max]. A scale-down happens only after ceil(scaleDownDelaySeconds / interval) = 3 lower results
    in a row; the counter resets on a result that is not lower, and (as in KubeAI) not after a scale-down.
    No rate limits. The average starts full of the first observation (KubeAI keeps it in a ConfigMap across
    restarts, so a long-running autoscaler has a full window), not of zeros.
    """

    def __init__(self, target: float, min_replicas: int, max_replicas: int, interval: float = 10.0,
                 time_window: float = 600.0, scale_down_delay: float = 30.0) -> None:
        self.name, self.interval = "kubeai", interval
        self.target, self.min, self.max = target, min_replicas, max_replicas
        self.history: deque[float] = deque(maxlen=math.ceil(time_window / interval))
        self.required = math.ceil(scale_down_delay / interval)
        self.consecutive = 0

    def tick(self, now: float, fleet: Fleet) -> int:
        loads = fleet.loads(now)
        if loads is None:  # the scrape failed: KubeAI logs it and skips this round
            return fleet.spec
        active = sum(loads.values())
        if not self.history:
            self.history.extend([active] * (self.history.maxlen or 1))
        self.history.append(active)
        desired = min(max(math.ceil(sum(self.history) / len(self.history) / self.target), self.min), self.max)
        current = fleet.spec
        if current > desired:
            if self.consecutive < self.required:
                self.consecutive += 1
                return current
        else:
            self.consecutive = 0
        return desired


@dataclass(frozen=True)
class Setup:
    """What every policy shares: the replica, the load unit, the SLO and the per-replica queue target.

    From `--calibrate` on gpu-8b with the default request mix, one replica alone: TTFT p95 0.16 s at 4
    requests/s, 0.28 s at 8 (holding 43 requests, waiting + running), 0.51 s at 10, 3.7 s at 12, and it
    saturates past ~12.5. The unit is 8 requests/s; the queue target every policy gets (the number a user
    would write: HPA averageValue, KubeAI targetRequests, kvfleet queueDepthPerReplica) is what a replica
    holds there, 45; kvfleet alone also gets the SLO itself, TTFT p95 <= 0.5 s.
    """

    model: ReplicaModel
    unit: float = 8.0  # requests/s one replica serves comfortably within the SLO
    queue_target: float = 45.0
    ttft_target: float = 0.5
    min_replicas: int = 1
    max_replicas: int = 20


def make_policies(s: Setup) -> list[Autoscaler]:
    """kvfleet with the shipped defaults (tolerance, behavior) plus the two targets; the baselines' defaults."""
    kv = AutoscalingPolicy(min_replicas=s.min_replicas, max_replicas=s.max_replicas,
                           queue_depth_per_replica=s.queue_target,
                           latency_targets=(LatencyTarget("ttft", 95, s.ttft_target),))
    return [Kvfleet(kv), Hpa(s.queue_target, s.min_replicas, s.max_replicas),
            KubeAI(s.queue_target, s.min_replicas, s.max_replicas)]
