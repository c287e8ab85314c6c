"""decide()'s plain data: the policy and the observation in, the state carried between rounds, the decision out."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvfleet_operator.autoscaling.behavior import Behavior, Recommendation, ScaleEvent

Mode = Literal["builtin", "external", "off"]
LatencyMetric = Literal["ttft", "itl", "e2e"]
LimitedBy = Literal["none", "tolerance", "scaleUpStabilization", "scaleUpRate", "scaleDownStabilization",
                    "scaleDownRate", "recentScaleDown", "minReplicas", "maxReplicas", "partialMetrics",
                    "capacityBlocked", "noMetrics", "scaleToZeroWindow", "noRouter"]
# The idle window's default, as spec.autoscaling.scaleToZeroAfterSeconds's in models.py.
SCALE_TO_ZERO_AFTER_S = 300


@dataclass(frozen=True)
class LatencyTarget:
    """Keep the fleet's `percentile` of `metric` (over the metrics window) at or under `seconds`."""

    metric: LatencyMetric
    percentile: float
    seconds: float

    @property
    def source(self) -> str:
        """The key of this target in Observation.latency and in proposals, e.g. "ttft_p95"."""
        return f"{self.metric}_p{self.percentile:g}"


@dataclass(frozen=True)
class AutoscalingPolicy:
    """spec.autoscaling, free of Kubernetes types. Only mode "builtin" is decided here (see decide())."""

    mode: Mode = "builtin"
    min_replicas: int = 1
    max_replicas: int = 10
    tolerance: float = 0.1
    queue_depth_per_replica: float | None = None
    latency_targets: tuple[LatencyTarget, ...] = ()
    behavior: Behavior = field(default_factory=Behavior)
    # None: twice the expected (learned) startup time, or before any is learned the startup probe's budget (a pod
    # the kubelet has not restarted by then may still come up; past it, it is surely stuck).
    startup_grace_seconds: float | None = None
    startup_budget_seconds: float = 3600.0
    # Pods Pending-unschedulable at once that scale-up may still ask past (a node autoscaler provisions for them);
    # beyond it, scale-up waits for them to schedule.
    unschedulable_budget: int = 4
    # With min_replicas 0: idle this long (see zero.py) → 0 replicas. Ignored while min_replicas >= 1.
    scale_to_zero_after_seconds: float = SCALE_TO_ZERO_AFTER_S


@dataclass(frozen=True)
class Flow:
    """Requests and tokens per second through the reporting pods (MetricsWindow.flow): fleet totals over one span."""

    completed: float  # requests finished or refused per second
    arrived: float  # requests arriving per second: completions plus the rise of waiting + running
    prompt_tokens: float  # prompt tokens per second, of the requests served
    output_tokens: float  # generated tokens per second
    pods: float  # replicas' worth the figures cover: pod-seconds over the span (a pod new to it covers part)

    @property
    def tokens_per_request(self) -> float | None:
        """Prompt plus output tokens per completed request (None: none completed)."""
        return (self.prompt_tokens + self.output_tokens) / self.completed if self.completed > 0 else None


@dataclass(frozen=True)
class Observation:
    """What the operator saw this round. Starting = pods that exist but are not ready (pending ones included)."""

    now: float
    current_replicas: int  # the Deployment's spec.replicas
    ready_replicas: int
    starting_replicas: int
    reporting_replicas: int  # ready pods whose /metrics scrape succeeded
    unschedulable_replicas: int = 0  # Pending-Unschedulable past the grace period
    queue_depth: float | None = None  # waiting + running summed over reporting pods, newest scrape
    queue_depth_mean: float | None = None  # the same averaged over the metrics window (None: only the newest)
    request_rate: float | None = None  # requests/s admitted over the last scrape interval, all pods (None: unknown)
    latency: Mapping[str, float | None] = field(default_factory=dict)  # LatencyTarget.source → seconds, None: no data
    new_startup_durations: tuple[float, ...] = ()  # creation → ready of pods that became ready since last round
    starting_ages: tuple[float, ...] = ()  # seconds since creation of each starting pod (empty: all on the way)
    # The routers' view: requests held for this deployment (it had no ready replica), at the routers that answered.
    held_requests: float = 0.0
    routers_reporting: int = 0  # router pods whose /metrics scrape succeeded
    routers_failing: int = 0  # router pods (or namespaces of them) that could not be read: their holds are unknown
    # Requests the reporting pods finished or refused since their previous scrape (kvfleet_requests_total's
    # increase): with waiting + running at 0, none arrived in between. None: unknown (a pod's first scrape).
    requests_arrived: float | None = None
    # The capacity model's inputs (None: unknown, e.g. agents without the counters or a pod's first scrape).
    flow: Flow | None = None  # over the metrics window
    flow_last: Flow | None = None  # over the last scrape interval: the panic window
    queue_time_p95: float | None = None  # time waiting before prefill, p95 over the window (queueing vs prefill)
    kv_usage: float | None = None  # the highest KV cache usage ratio among reporting pods, newest scrape


@dataclass(frozen=True)
class Line:
    """A fitted (or assumed) s/q line: w seconds per token alone, m tokens/s at saturation, per replica."""

    w: float
    m: float
    fitted: bool

    def depth(self, s: float) -> float:
        """Requests a replica holds while serving s tokens/s (infinite at or past saturation)."""
        return s * self.w / (1 - s / self.m) if s < self.m else math.inf

    def at_depth(self, q: float) -> float:
        """Tokens/s per replica at which it holds q requests (the inverse of depth())."""
        return q / (self.w + q / self.m)


@dataclass(frozen=True)
class Capacity:
    """What the model carries between rounds: recent (time, s, q) samples per replica, the last line, and the
    latency ceiling (time, tokens/s per replica) if a queueing-bound percentile was recently over its target."""

    samples: tuple[tuple[float, float, float], ...] = ()
    line: Line | None = None
    ceiling: tuple[float, float] | None = None

    def to_list(self) -> list[object]:
        """JSON-ready form."""
        line = None if self.line is None else [self.line.w, self.line.m, self.line.fitted]
        return [[list(s) for s in self.samples], line, None if self.ceiling is None else list(self.ceiling)]

    @classmethod
    def from_list(cls, d: Sequence[object] | None) -> Capacity:
        """Inverse of to_list()."""
        if not d:
            return cls()
        samples, line, ceiling = d
        return cls(tuple((float(t), float(s), float(q)) for t, s, q in samples),  # type: ignore[attr-defined]
                   None if line is None else Line(float(line[0]), float(line[1]), bool(line[2])),  # type: ignore[index]
                   None if ceiling is None else (float(ceiling[0]), float(ceiling[1])))  # type: ignore[index]


@dataclass(frozen=True)
class AutoscalerState:
    """Everything carried between decisions; to_dict()/from_dict() let the operator persist it across restarts."""

    recommendations: tuple[Recommendation, ...] = ()
    scale_events: tuple[ScaleEvent, ...] = ()
    startup_durations: tuple[float, ...] = ()
    rates: tuple[tuple[float, float], ...] = ()  # (time, the fleet's request rate) for the trend
    idle_since: float | None = None  # the first round of the current idle stretch (zero.py); None: not idle
    capacity: Capacity = field(default_factory=lambda: Capacity())  # the capacity model (capacity.py)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"recommendations": [[r.time, r.replicas] for r in self.recommendations],
                "scaleEvents": [[e.time, e.change] for e in self.scale_events],
                "startupDurations": list(self.startup_durations), "requestRates": [[t, x] for t, x in self.rates],
                "idleSince": self.idle_since, "capacity": self.capacity.to_list()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AutoscalerState:
        """Inverse of to_dict()."""
        return cls(tuple(Recommendation(float(t), int(n)) for t, n in d.get("recommendations", [])),
                   tuple(ScaleEvent(float(t), int(n)) for t, n in d.get("scaleEvents", [])),
                   tuple(float(x) for x in d.get("startupDurations", [])),
                   tuple((float(t), float(x)) for t, x in d.get("requestRates", [])),
                   None if d.get("idleSince") is None else float(d["idleSince"]),
                   Capacity.from_list(d.get("capacity")))


@dataclass(frozen=True)
class Proposal:
    """One signal's answer: the replicas its formula asks for (before tolerance and the cold-start rule)."""

    source: str  # "queue" or a LatencyTarget.source
    observed: float  # queue: total depth; latency: seconds
    target: float  # queue: per replica; latency: seconds
    replicas: int


@dataclass(frozen=True)
class Decision:
    """The outcome of one round, with its inputs and reason, and the state to carry to the next round."""

    time: float
    current_replicas: int
    ready_replicas: int
    starting_replicas: int
    desired_replicas: int
    proposals: tuple[Proposal, ...]
    limited_by: LimitedBy
    reason: str
    expected_startup_seconds: float | None
    state: AutoscalerState

    def status(self) -> dict[str, Any]:
        """The CR status form (camelCase), without the carried state."""
        return {"time": self.time, "currentReplicas": self.current_replicas, "readyReplicas": self.ready_replicas,
                "startingReplicas": self.starting_replicas, "desiredReplicas": self.desired_replicas,
                "proposals": [{"source": p.source, "observed": p.observed, "target": p.target,
                               "replicas": p.replicas} for p in self.proposals],
                "limitedBy": self.limited_by, "reason": self.reason,
                "expectedStartupSeconds": self.expected_startup_seconds}
