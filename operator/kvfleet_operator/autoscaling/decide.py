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
# - Last, clamp to [min, max]: the user's explicit bound wins over every rule above. With minReplicas 0 the
#   rules above stop at one replica; zero is reached, and left, only by zero.py's rules (an idle window; requests
#   held at a router), which also decide alone while the fleet is at zero. Held requests count as queue depth.

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from kvfleet_operator.autoscaling import zero
from kvfleet_operator.autoscaling.behavior import (
    DEFAULT_SCALE_DOWN,
    DEFAULT_SCALE_UP,
    Behavior,
    Recommendation,
    ScaleEvent,
    ScalingPolicy,
    ScalingRules,
    event_horizon,
    rate_limit,
    stabilize,
)
from kvfleet_operator.autoscaling.decision import (
    AutoscalerState,
    AutoscalingPolicy,
    Decision,
    LatencyTarget,
    LimitedBy,
    Observation,
    Proposal,
)
from kvfleet_operator.autoscaling.reason import explain
from kvfleet_operator.autoscaling.trend import TREND_WINDOW_S, Projection, trend

STARTUP_HISTORY = 10  # startup durations kept; the median of these is the expected time to ready
# Queue depth per replica ∝ (load per replica)^k. For a replica whose step time grows linearly with its batch,
# depth = r·A / (1 - r·B): the local exponent is 1 + rB / (1 - rB), 1.5 at a third of the decode-bound
# saturation rate, where a sensible queue target sits. The simulator's replica measures ~1.5 there as well.
QUEUE_DEPTH_EXPONENT = 1.5


def decide(policy: AutoscalingPolicy, obs: Observation, state: AutoscalerState) -> Decision:
    """Decide the replicas for mode "builtin" (rules at the top of this module). Modes "external" and "off" must
    not call this: there the operator does not own replicas (an HPA/KEDA or the user does), so a decision would
    only mislead; it raises ValueError."""
    if policy.mode != "builtin":
        raise ValueError(f"decide() is for mode builtin, not {policy.mode!r}")
    now, current = obs.now, obs.current_replicas
    durations = (state.startup_durations + obs.new_startup_durations)[-STARTUP_HISTORY:]
    expected = statistics.median(durations) if durations else None
    if current == 0:
        return zero.from_zero(policy, obs, state, durations, expected)
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
    idle = zero.idle_since(obs, state.idle_since)
    step = zero.to_zero(policy, obs, idle)  # None unless minReplicas is 0
    floor = max(policy.min_replicas, 1)  # the rules above never take the last replica (zero.py's rules do)
    if desired < floor or desired > policy.max_replicas:
        limited = "maxReplicas" if desired > policy.max_replicas else "minReplicas" if step is None else step.limited
        desired = min(max(desired, floor), policy.max_replicas)
    if step is not None and step.go:
        desired, limited = 0, "none"
    horizon = max(up.stabilization_window_seconds, down.stabilization_window_seconds)
    new_state = AutoscalerState(
        (*(r for r in recs if r.time > now - horizon), Recommendation(now, raw)),
        (*(e for e in state.scale_events if e.time > now - event_horizon(up, down)),
         *((ScaleEvent(now, desired - current),) if desired != current else ())),
        durations, rates, idle)
    if step is not None and step.go:
        reason = step.text
    else:
        reason = explain(policy, obs, winner, raw, desired, limited, expected, now - last_down,
                         step.text if step is not None else "")
        if step is not None and step.note and limited not in ("scaleToZeroWindow", "noRouter"):
            reason += f" ({step.note})"
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
    # Requests a router holds for this deployment wait as surely as those in an agent's queue.
    depths = [q + obs.held_requests for q in (obs.queue_depth, obs.queue_depth_mean) if q is not None]
    if target is not None and obs.reporting_replicas == 0 and obs.held_requests > 0:
        # No replica serves yet (all starting): the held requests alone size the fleet, linearly (there is no
        # served load to scale from), against what is on its way.
        n = _ceil(obs.held_requests / target)
        p = Proposal("queue", obs.held_requests, target, n)
        v.proposals.append(p)
        v.votes.append((up(n) if n > effective else current, p))
        queue_agrees = n > effective
    elif target is not None and depths and obs.reporting_replicas > 0:
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


__all__ = ["DEFAULT_SCALE_DOWN", "DEFAULT_SCALE_UP", "AutoscalerState", "AutoscalingPolicy", "Behavior", "Decision",
           "LatencyTarget", "LimitedBy", "Observation", "Proposal", "Recommendation", "ScaleEvent", "ScalingPolicy",
           "ScalingRules", "decide", "fleet_load", "rate_limit", "stabilize"]
