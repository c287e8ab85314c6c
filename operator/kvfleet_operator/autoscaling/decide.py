"""The autoscaling decision, a pure function: policy + observation + carried state → desired replicas and why."""

# The rules, in the order decide() applies them (the simulator in bench/autoscale/ checks them on many loads):
# - The capacity model (capacity.py): demand in tokens/s (arrivals, not the served rate, at the window's tokens
#   per request; requests held at routers; the last interval's arrivals if higher: the panic window) over what one
#   replica serves at the targets, learned online from the agents' counters. Up: past the tolerance of what
#   serves or is on its way. Down: only to where the load over fewer replicas fits with the tolerance as margin;
#   the scale-down stabilization window then takes the highest of these over its span, so a scale-down holds at
#   the window's peak demand (a feasibility check, not a timed ban). A significant demand trend (trend.py) sizes
#   a rise for the next round and a fall for the window's end, never below the load now; a fall only where the
#   line describes its samples (at the bottom of a cycle they curve away from it, and the load is turning). A
#   backlog past the queue target that the replicas serving or on their way would clear too slowly is sized to
#   clear within DRAIN_S (the requests queued during a cold start otherwise wait minutes).
# - Latency percentiles correct the model: a fresh, complete, queueing-bound breach lowers the per-replica
#   capacity to below the load it happened at (so the same round proposes more); a TTFT breach whose requests
#   hardly waited is prefill-bound and says so instead of adding replicas. Stale or partial data never votes up.
# - Without token counters (older agents, a pod's first scrape) the queue rule decides: depth ∝ load^1.5,
#   n = ceil(ready × per_pod_ratio^(1/1.5)), and an over-target latency adds at most half the ready replicas.
# - Cold start: replicas that exist but are not ready count as capacity on the way (a vote <= current adds
#   nothing); those starting for longer than the grace do not, and a vote above is raised to replace them. The
#   grace is twice the learned startup time, or the startup probe's budget before any is learned.
# - HPA behavior: stabilization windows (up: lowest recommendation in its window, down: highest), then the
#   rate-limit policies over their periods, combined by selectPolicy.
# - Guards: never down on partial metrics; up past the Pending-unschedulable budget waits for those pods (a
#   node autoscaler provisions for the ones within it); no proposals: no change.
# - Last, clamp to [min, max]: the user's explicit bound wins over every rule above. With minReplicas 0 the
#   rules above stop at one replica; zero is reached, and left, only by zero.py's rules (an idle window; requests
#   held at a router), which also decide alone while the fleet is at zero.

from __future__ import annotations

import statistics

from kvfleet_operator.autoscaling import capacity, zero
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
    Capacity,
    Decision,
    LatencyTarget,
    LimitedBy,
    Observation,
    Proposal,
)
from kvfleet_operator.autoscaling.reason import explain
from kvfleet_operator.autoscaling.trend import TREND_WINDOW_S, Projection, trend
from kvfleet_operator.autoscaling.votes import QUEUE_DEPTH_EXPONENT, fleet_load, proposals

STARTUP_HISTORY = 10  # startup durations kept; the median of these is the expected time to ready


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
        2 * expected if expected is not None else policy.startup_budget_seconds)
    stale = sum(1 for age in obs.starting_ages if age > grace)
    interval = now - state.rates[-1][0] if state.rates else 15.0
    dem = capacity.demand(obs, interval)
    cap, notes = _model(policy, obs, state.capacity, dem)
    load, rate = _load_and_rate(policy, obs, cap, dem)
    # The trend's samples are in one unit: tokens/s once the model has a flow (the earlier requests/s are dropped).
    kept = () if dem is not None and not state.capacity.samples else state.rates
    rates = (*(x for x in kept if x[0] > now - TREND_WINDOW_S), *(((now, rate),) if rate is not None else ()))
    up, down = policy.behavior.scale_up, policy.behavior.scale_down
    tr = trend(rates, now)
    projection = None
    if tr is not None and load is not None and rates[-1][1] > 0 and rates[-1][0] == now:
        projection = Projection(tr, load, rates[-1][1], now - rates[-2][0], down.stabilization_window_seconds)
    v = proposals(policy, obs, stale, projection, cap, dem, expected or 0.0)
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
    if partial and desired < current:
        desired, limited = current, "partialMetrics"
    room = max(policy.unschedulable_budget - obs.unschedulable_replicas, 0)
    if obs.unschedulable_replicas > 0 and desired > current + room:
        desired, limited = current + room, "capacityBlocked"
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
        durations, rates, idle, cap)
    if step is not None and step.go:
        reason = step.text
    else:
        reason = explain(policy, obs, winner, raw, desired, limited, expected, step.text if step is not None else "")
        if step is not None and step.note and limited not in ("scaleToZeroWindow", "noRouter"):
            reason += f" ({step.note})"
    for note in (*notes, *v.notes):
        reason += f" ({note})"
    if stale:
        reason += f" ({stale} starting for over {grace:.0f}s no longer count as capacity on the way)"
    return Decision(now, current, obs.ready_replicas, obs.starting_replicas, desired, tuple(v.proposals), limited,
                    reason, expected, new_state)


def _model(policy: AutoscalingPolicy, obs: Observation, cap: Capacity,
           dem: capacity.Demand | None) -> tuple[Capacity, list[str]]:
    """This round's capacity model: the new sample and fit, then the latency correction (fresh, complete data
    only), with a note when a breach lowered the capacity."""
    cap = capacity.observe(cap, obs, dem, obs.now, policy.queue_depth_per_replica)
    if dem is None or cap.line is None:
        return cap, []
    tol, notes = policy.tolerance, []
    breached = met = False
    # Only a breach the model did not foresee corrects it: demand within what the ready replicas serve by the
    # model, and steady (the last interval's arrivals within tolerance of the window's). A breach while demand
    # exceeds the fleet is the model's own proposal to make; one during a jump measures the jump, not capacity.
    per = capacity.per_replica(cap, policy.queue_depth_per_replica, 0.0)
    last = obs.flow_last.arrived if obs.flow_last is not None else None
    foreseen = per is not None and dem.tokens_per_s > obs.ready_replicas * per
    steady = (last is not None and obs.flow is not None and capacity.steady(obs)
              and abs(last - obs.flow.arrived) <= tol * obs.flow.arrived)
    for t in policy.latency_targets:
        seen = obs.latency.get(t.source)
        if seen is None:
            continue
        if (seen > t.seconds * (1 + tol) and steady and not foreseen
                and not (t.metric == "ttft" and capacity.prefill_bound(obs, t.seconds))):
            breached = True
            notes.append(f"{t.source.replace('_', ' ')} {seen:.3g}s over {t.seconds:g}s at "
                         f"{dem.served_per_replica:,.0f} tokens/s per replica: capacity lowered below it")
        met = met or seen <= t.seconds * (1 - tol)
    met = met and not breached
    before = cap.ceiling
    cap = capacity.correct(cap, dem.served_per_replica, breached, met, obs.now)
    return cap, notes if cap.ceiling != before else []  # notes only where the breach lowered the capacity


def _load_and_rate(policy: AutoscalingPolicy, obs: Observation, cap: Capacity,
                   dem: capacity.Demand | None) -> tuple[float | None, float | None]:
    """The load in replicas and the demand sample the trend keeps: tokens/s by the model where it has a line,
    else the queue rule's load and the requests/s admitted."""
    per = capacity.per_replica(cap, policy.queue_depth_per_replica, policy.tolerance) if dem is not None else None
    if dem is not None and per is not None and per > 0:
        return dem.tokens_per_s / per, dem.tokens_per_s
    if cap.samples:
        return fleet_load(policy, obs), None  # the trend is in tokens/s by now: a requests/s sample would corrupt it
    rate = obs.request_rate if obs.reporting_replicas == obs.ready_replicas else None  # a silent pod's is unknown
    return fleet_load(policy, obs), rate


__all__ = ["DEFAULT_SCALE_DOWN", "DEFAULT_SCALE_UP", "QUEUE_DEPTH_EXPONENT", "AutoscalerState", "AutoscalingPolicy",
           "Behavior", "Decision", "LatencyTarget", "LimitedBy", "Observation", "Proposal", "Recommendation",
           "ScaleEvent", "ScalingPolicy", "ScalingRules", "decide", "fleet_load", "rate_limit", "stabilize"]
