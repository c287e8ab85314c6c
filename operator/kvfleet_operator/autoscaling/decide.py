"""The autoscaling decision, a pure function: policy + observation + carried state → desired replicas and why."""

# The rules, in the order decide() applies them (the simulator in bench/autoscale/ tuned the choices):
# - Proposals, one per signal, each held at the current count while its observed/target ratio is within
#   1 ± tolerance (as in the HPA); the largest vote wins.
#   queue: depth ∝ load^1.5, so n = ceil(ready × per_pod_ratio^(1/1.5)); going down, to where each replica
#   would hold at most 1 - tolerance of the target (hysteresis); the newest depth and the window's mean must
#   agree to move (up on the lower of the two, down on the higher). The request rate's 10-minute least-squares
#   trend (trend.py) projects the load: the newest load rescaled from the newest rate to the line. The rate,
#   not the depth, carries the trend: depth per replica changes when replicas do, demand does not.
#   - While the rate falls significantly, a scale-down asks for the load projected to when the scale-down
#     window releases it (no hysteresis: the trend moves it, not noise), never below the load now: the window
#     then answers the fall on time instead of a window late, and a pause in the fall costs nothing. The load
#     now is the newest one, or, where the line fits the samples and the newest rate sits above it, the load
#     on the line: that excess is noise.
#   - While it rises significantly, the queue also votes for the load projected to the next round: the trend
#     is the agreement the window's mean would otherwise give, so a ramp is followed a window sooner.
#   latency: n = ceil(ready × observed / target), ready as the base. Over target it never asks for fewer
#   than current, and while replicas are on their way it adds only if the queue agrees (the latency of the
#   ready ones keeps growing while others load: the same demand). Under target it does not vote when a queue
#   target is set (latency is flat below saturation); alone, it steps down one replica at a time.
# - Cold start: replicas that exist but are not ready count as capacity on the way (a vote <= current adds
#   nothing); those starting for longer than the grace do not, and a vote above is raised to replace them.
# - HPA behavior: stabilization windows (up: lowest recommendation in its window, down: highest), then the
#   rate-limit policies over their periods, combined by selectPolicy.
# - No reversal on noise: within the scale-down window after a scale-down, scaling back up takes a latency
#   target over its tolerance, or the queue over twice its tolerance (a ripple that the scale-down window
#   held, then released, must not bring the replica straight back).
# - Guards: never down on partial metrics; never up while pods are unschedulable; no proposals: no change.
# - Last, clamp to [min, max]: the user's explicit bound wins over every rule above.

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from kvfleet_operator.autoscaling.behavior import (
    DEFAULT_SCALE_DOWN,
    DEFAULT_SCALE_UP,
    Behavior,
    Recommendation,
    ScaleEvent,
    ScalingPolicy,
    ScalingRules,
    rate_limit,
    stabilize,
)
from kvfleet_operator.autoscaling.trend import TREND_WINDOW_S, Projection, trend

Mode = Literal["builtin", "external", "off"]
LatencyMetric = Literal["ttft", "itl", "e2e"]
LimitedBy = Literal["none", "tolerance", "scaleUpStabilization", "scaleUpRate", "scaleDownStabilization",
                    "scaleDownRate", "recentScaleDown", "minReplicas", "maxReplicas", "partialMetrics",
                    "capacityBlocked", "noMetrics"]
STARTUP_HISTORY = 10  # startup durations kept; the median of these is the expected time to ready
# Queue depth per replica ∝ (load per replica)^k. For a replica whose step time grows linearly with its batch,
# depth = r·A / (1 - r·B): the local exponent is 1 + rB / (1 - rB), 1.5 at a third of the decode-bound
# saturation rate, where a sensible queue target sits. The simulator's replica measures ~1.5 there as well.
QUEUE_DEPTH_EXPONENT = 1.5


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
    startup_grace_seconds: float | None = None  # None: twice the expected (learned) startup time


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


@dataclass(frozen=True)
class AutoscalerState:
    """Everything carried between decisions; to_dict()/from_dict() let the operator persist it across restarts."""

    recommendations: tuple[Recommendation, ...] = ()
    scale_events: tuple[ScaleEvent, ...] = ()
    startup_durations: tuple[float, ...] = ()
    rates: tuple[tuple[float, float], ...] = ()  # (time, the fleet's request rate) for the trend

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"recommendations": [[r.time, r.replicas] for r in self.recommendations],
                "scaleEvents": [[e.time, e.change] for e in self.scale_events],
                "startupDurations": list(self.startup_durations), "requestRates": [[t, x] for t, x in self.rates]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AutoscalerState:
        """Inverse of to_dict()."""
        return cls(tuple(Recommendation(float(t), int(n)) for t, n in d.get("recommendations", [])),
                   tuple(ScaleEvent(float(t), int(n)) for t, n in d.get("scaleEvents", [])),
                   tuple(float(x) for x in d.get("startupDurations", [])),
                   tuple((float(t), float(x)) for t, x in d.get("requestRates", [])))


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


def decide(policy: AutoscalingPolicy, obs: Observation, state: AutoscalerState) -> Decision:
    """Decide the replicas for mode "builtin" (rules at the top of this module). Modes "external" and "off" must
    not call this: there the operator does not own replicas (an HPA/KEDA or the user does), so a decision would
    only mislead; it raises ValueError."""
    if policy.mode != "builtin":
        raise ValueError(f"decide() is for mode builtin, not {policy.mode!r}")
    now, current = obs.now, obs.current_replicas
    durations = (state.startup_durations + obs.new_startup_durations)[-STARTUP_HISTORY:]
    expected = statistics.median(durations) if durations else None
    # Like HPA's first sync: seed the windows with the current count, so a restart does not scale down at once.
    recs = state.recommendations or (Recommendation(now, current),)
    grace = policy.startup_grace_seconds if policy.startup_grace_seconds is not None else (
        2 * expected if expected is not None else None)
    stale = sum(1 for age in obs.starting_ages if grace is not None and age > grace)
    load = fleet_load(policy, obs)
    rate = obs.request_rate if obs.reporting_replicas == obs.ready_replicas else None  # a silent pod's is unknown
    rates = (*(x for x in state.rates if x[0] > now - TREND_WINDOW_S), *(((now, rate),) if rate is not None else ()))
    up, down = policy.behavior.scale_up, policy.behavior.scale_down
    tr = trend(rates, now)
    projection = None
    if tr is not None and load is not None and rates[-1][1] > 0 and rates[-1][0] == now:
        projection = Projection(tr, load, rates[-1][1], now - rates[-2][0], down.stabilization_window_seconds)
    v = _proposals(policy, obs, stale, projection)
    partial = obs.reporting_replicas < obs.ready_replicas
    limited: LimitedBy = "none"
    raw, winner = max(v.votes, key=lambda x: x[0]) if v.votes else (current, None)
    if winner is None:
        limited = "noMetrics"
    elif raw == current and v.held:
        limited = "tolerance"
    stabilized = stabilize(current, raw, recs, up, down, now)
    if stabilized != raw:
        limited = "scaleUpStabilization" if raw > current else "scaleDownStabilization"
    desired = rate_limit(current, stabilized, state.scale_events, up, down, now)
    if desired != stabilized:
        limited = "scaleUpRate" if stabilized > current else "scaleDownRate"
    last_down = max((e.time for e in state.scale_events if e.change < 0), default=-math.inf)
    if desired > current and now - last_down < down.stabilization_window_seconds and not v.strong_up:
        desired, limited = current, "recentScaleDown"
    if partial and desired < current:
        desired, limited = current, "partialMetrics"
    if obs.unschedulable_replicas > 0 and desired > current:
        desired, limited = current, "capacityBlocked"
    if desired < policy.min_replicas or desired > policy.max_replicas:
        limited = "minReplicas" if desired < policy.min_replicas else "maxReplicas"
        desired = min(max(desired, policy.min_replicas), policy.max_replicas)
    horizon = max(up.stabilization_window_seconds, down.stabilization_window_seconds)
    # Scale events are kept for the rate-limit periods and, for the reversal rule, the scale-down window.
    period = max((p.period_seconds for p in up.policies + down.policies), default=0)
    period = max(period, down.stabilization_window_seconds)
    new_state = AutoscalerState(
        (*(r for r in recs if r.time > now - horizon), Recommendation(now, raw)),
        (*(e for e in state.scale_events if e.time > now - period),
         *((ScaleEvent(now, desired - current),) if desired != current else ())),
        durations, rates)
    reason = _reason(policy, obs, winner, raw, desired, limited, expected, now - last_down)
    if v.trend_note and winner is not None and winner.source == "queue":
        reason += f" ({v.trend_note})"
    if stale:
        reason += f" ({stale} starting for over {grace:.0f}s no longer count as capacity on the way)"
    return Decision(now, current, obs.ready_replicas, obs.starting_replicas, desired, tuple(v.proposals), limited,
                    reason, expected, new_state)


def _ceil(x: float) -> int:
    """Ceiling that ignores float noise (3.0000000001 → 3)."""
    return math.ceil(x - 1e-9)


def fleet_load(policy: AutoscalingPolicy, obs: Observation) -> float | None:
    """The load in replicas at the queue target (how many replicas would each hold exactly the target), from the
    newest depth; None without a queue target or on partial metrics (a missing pod's load is unknown)."""
    target = policy.queue_depth_per_replica
    if target is None or obs.queue_depth is None or obs.ready_replicas == 0 or (
            obs.reporting_replicas < obs.ready_replicas):
        return None
    per_pod: float = (obs.queue_depth / obs.ready_replicas / target) ** (1 / QUEUE_DEPTH_EXPONENT)
    return obs.ready_replicas * per_pod


@dataclass
class _Votes:
    """What _proposals() found: every proposal, the votes cast (not every proposal votes), whether tolerance held
    any, whether a scale-up is strong enough to reverse a recent scale-down, and what the trend changed."""

    proposals: list[Proposal] = field(default_factory=list)
    votes: list[tuple[int, Proposal]] = field(default_factory=list)
    held: bool = False
    strong_up: bool = False
    trend_note: str = ""


def _proposals(policy: AutoscalingPolicy, obs: Observation, stale: int, proj: Projection | None) -> _Votes:
    """Each signal's proposal and vote (rules at the top of this module)."""
    current, ready, tol = obs.current_replicas, obs.ready_replicas, policy.tolerance
    effective = current - stale
    v = _Votes()

    def up(n: int) -> int:  # cold start: only a vote above what serves or is on its way adds pods
        return n + stale if n > effective else current

    target = policy.queue_depth_per_replica
    queue_agrees: bool | None = None  # whether the queue asks for more than what serves or is on its way
    depths = [q for q in (obs.queue_depth, obs.queue_depth_mean) if q is not None]
    if target is not None and depths and obs.reporting_replicas > 0:
        # Depth = rate × time in system (Little), and a batched step slows as the batch grows, so depth per
        # replica grows faster than load per replica: n replicas would each hold per_pod × (ready / n)^k.
        # (HPA assumes k = 1: it overshoots while new replicas load, and removes too many, then adds them
        # back.) per_pod is the average over reporting pods, as the HPA takes it.
        k = QUEUE_DEPTH_EXPONENT

        def ratio_of(q: float) -> float:  # per replica of target, once those on the way serve too
            return q / obs.reporting_replicas / target * (ready / effective) ** k if effective else math.inf

        # The newest depth and the window's mean must agree to move: up on the lower, down on the higher.
        lo, hi = min(depths), max(depths)
        ratio = ratio_of(lo) if ratio_of(lo) > 1 else ratio_of(hi) if ratio_of(hi) < 1 else 1.0
        depth = lo if ratio > 1 else hi if ratio < 1 else depths[0]
        per_pod = depth / obs.reporting_replicas / target
        # Going down, stop where each replica would hold at most 1 - tolerance (hysteresis): scaling back up
        # then takes a real rise in load (2 × tolerance), not noise.
        hysteresis = 1.0 if ratio >= 1 else 1 - tol
        n = _ceil(ready * (per_pod / hysteresis) ** (1 / k))
        within = abs(ratio - 1) <= tol
        if ratio < 1 and proj is not None and proj.trend.falling:
            # A recommendation acts only once it is the highest in the scale-down window: size it for the
            # window's end; the load now is the floor should the fall stop. No hysteresis: the trend moves this
            # proposal, not noise (and a reversal soon after a scale-down needs strong evidence, see decide()).
            sized = _ceil(max(proj.at(proj.window), proj.now()))
            if sized < n and sized < current:
                v.trend_note = (f"request rate falling {proj.per_min()}/min: sized for the end of the "
                                f"{proj.window}s scale-down window")
            n = min(n, sized)
        elif proj is not None and proj.trend.rising:
            # Past the tolerance (in load: depth ∝ load^k) of what serves or is on its way by the next round:
            # the trend confirms the rise, so the tolerance does not hold it, nor the lower depth alone size it.
            ahead = proj.at(proj.interval)
            if ahead > effective * (1 + tol) ** (1 / k):
                n, within = max(n, _ceil(ahead)), False
                v.trend_note = f"request rate rising {proj.per_min()}/min: sized for the next round's load"
        p = Proposal("queue", depth, target, n)
        v.proposals.append(p)
        v.held |= within and n != current
        queue_agrees = ratio > 1 + tol or (bool(v.trend_note) and n > current)
        v.strong_up |= ratio > (1 + tol) ** 2
        v.votes.append((current if within else up(n) if n > effective else n, p))
    for t in policy.latency_targets:
        seen = obs.latency.get(t.source)
        if seen is None or ready == 0:
            continue
        ratio = seen / t.seconds
        n = _ceil(ready * ratio)  # ready is the base: only they produced the latency
        p = Proposal(t.source, seen, t.seconds, n)
        v.proposals.append(p)
        if abs(ratio - 1) <= tol:
            v.held |= n != current
            v.votes.append((current, p))
        elif ratio > 1:
            # Over target never asks for fewer than current. It measures only the ready replicas and grows while
            # others load, so with replicas on their way it adds only if the queue (which counts them) agrees.
            short = effective <= ready or queue_agrees is None or queue_agrees
            v.votes.append((up(n) if short else current, p))
            v.strong_up = True
        elif target is not None:
            pass  # under target, latency does not vote: it is flat until saturation, so the queue decides
        else:
            # Latency alone: it is flat until saturation, so its ratio does not measure spare capacity.
            # Step down one ready replica at a time; the scale-down window spaces the steps.
            v.votes.append((max(n, ready - 1), p))
    return v


def _describe_rate(rules: ScalingRules, up: bool) -> str:
    """E.g. "+100% or +4 pods per 15s, whichever is more"."""
    sign = "+" if up else "-"
    parts = [f"{sign}{p.value}{'%' if p.type == 'Percent' else ' pods'} per {p.period_seconds}s"
             for p in rules.policies]
    if len(parts) == 1:
        return parts[0]
    return " or ".join(parts) + (", whichever is more" if rules.select_policy == "Max" else ", whichever is less")


def _reason(policy: AutoscalingPolicy, obs: Observation, win: Proposal | None, raw: int, desired: int,
            limited: LimitedBy, expected: float | None, since_down: float) -> str:
    """One human sentence: the winning signal, the proposal, and what limited it."""
    starting = f" + {obs.starting_replicas} starting" if obs.starting_replicas else ""
    fleet = f"with {obs.ready_replicas} ready{starting}"
    if win is None:
        head = f"no metrics from {obs.ready_replicas} ready ({obs.reporting_replicas} reporting)"
    else:
        if win.source == "queue":
            head = f"queue depth {win.observed:g} at target {win.target:g} per replica {fleet}"
        else:
            cmp = ">" if win.observed > win.target else "<="
            name = win.source.replace("_", " ")
            head = f"{name} {win.observed:.3g}s {cmp} target {win.target:g}s {fleet}"
        head += f": proposing {win.replicas}"
        if obs.starting_replicas and obs.ready_replicas < win.replicas <= obs.current_replicas:
            eta = f", expected ready in ~{expected:.0f}s" if expected is not None else ""
            head += f", covered by the {obs.starting_replicas} starting{eta}"
    b, k = policy.behavior, desired
    tail = {
        "none": f"{'scaling to' if k != obs.current_replicas else 'keeping'} {k}", "noMetrics": f"keeping {k}",
        "tolerance": f"within tolerance {policy.tolerance:.0%}, keeping {k}",
        "scaleUpStabilization": f"held at {k} by the {b.scale_up.stabilization_window_seconds}s scale-up "
                                "stabilization window",
        "scaleDownStabilization": f"held at {k} by the {b.scale_down.stabilization_window_seconds}s scale-down "
                                  "stabilization window",
        "scaleUpRate": f"limited to {k} by scale-up rate ({_describe_rate(b.scale_up, True)})",
        "scaleDownRate": f"limited to {k} by scale-down rate ({_describe_rate(b.scale_down, False)})",
        "recentScaleDown": f"keeping {k}: scaled down {since_down:.0f}s ago, and within the "
                           f"{b.scale_down.stabilization_window_seconds}s scale-down window scaling back up takes "
                           f"a latency target over tolerance or the queue over twice the tolerance",
        "partialMetrics": f"keeping {k}: only {obs.reporting_replicas} of {obs.ready_replicas} ready pods reported "
                          "metrics, never scaling down on partial data",
        "capacityBlocked": f"keeping {k}: {obs.unschedulable_replicas} pods unschedulable, no scale-up until they "
                           "schedule",
        "minReplicas": f"raised to minReplicas {k}", "maxReplicas": f"capped at maxReplicas {k}",
    }[limited]
    if raw != desired and limited in ("none", "minReplicas", "maxReplicas"):
        tail = f"recommending {raw}, " + tail
    return f"{head}; {tail}"


__all__ = ["DEFAULT_SCALE_DOWN", "DEFAULT_SCALE_UP", "AutoscalerState", "AutoscalingPolicy", "Behavior", "Decision",
           "LatencyTarget", "Observation", "Proposal", "Recommendation", "ScaleEvent", "ScalingPolicy",
           "ScalingRules", "decide", "fleet_load", "rate_limit", "stabilize"]
