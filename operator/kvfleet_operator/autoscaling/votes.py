"""Each signal's proposal and vote: the capacity model's, the queue rule's (without token counters), latency's."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvfleet_operator.autoscaling import capacity
from kvfleet_operator.autoscaling.capacity import Demand
from kvfleet_operator.autoscaling.decision import AutoscalingPolicy, Capacity, Observation, Proposal
from kvfleet_operator.autoscaling.trend import Projection

# Queue depth per replica ∝ (load per replica)^k, the rule for agents without token counters (the capacity model
# replaces it where they have them): for a replica whose step time grows linearly with its batch, the local
# exponent is 1 + rB / (1 - rB), 1.5 at a third of the decode-bound saturation rate, where a queue target sits.
QUEUE_DEPTH_EXPONENT = 1.5
# Without the capacity model, an over-target latency asks for at most this many times the ready replicas: latency
# is a hockey stick near saturation, and a linear vote on it overshoots several-fold.
LATENCY_STEP_MAX = 1.5
NOISE_Z = 2.0  # scale-down headroom: this many standard deviations of the demand around its 10-minute trend
# A backlog past the queue target is sized to clear within this many seconds: demand alone leaves the requests
# that queued during a cold start waiting minutes (every one of them past the TTFT target) while the fleet serves
# only what arrives. In the suite, 60 s held the bar in 18 of 33 cases against 15 without; 120 s, 16.
DRAIN_S = 60.0
MAX_MARGIN = 2 / 3  # at most three times the capacity the load needs (a burst to 3x its base)


def ceil(x: float) -> int:
    """Ceiling that ignores float noise (3.0000000001 → 3); an unbounded load asks for a bounded count (the clamp
    to maxReplicas follows)."""
    return math.ceil(min(x, 1e9) - 1e-9)


@dataclass
class Votes:
    """What proposals() found: every proposal, the votes cast (not every proposal votes), whether tolerance held
    any, and notes for the reason (trend, a latency correction, a prefill-bound latency)."""

    proposals: list[Proposal] = field(default_factory=list)
    votes: list[tuple[int, Proposal]] = field(default_factory=list)
    held: bool = False
    notes: list[str] = field(default_factory=list)


def fleet_load(policy: AutoscalingPolicy, obs: Observation) -> float | None:
    """The load in replicas at the queue target by the queue rule, from the newest depth; None without a queue
    target or on partial metrics (a missing pod's load is unknown)."""
    target = policy.queue_depth_per_replica
    if target is None or obs.queue_depth is None or obs.ready_replicas == 0 or (
            obs.reporting_replicas < obs.ready_replicas):
        return None
    per_pod: float = (obs.queue_depth / obs.ready_replicas / target) ** (1 / QUEUE_DEPTH_EXPONENT)
    return obs.ready_replicas * per_pod


def proposals(policy: AutoscalingPolicy, obs: Observation, stale: int, proj: Projection | None, cap: Capacity,
              dem: Demand | None, lead: float = 0.0) -> Votes:
    """Every signal's proposal and vote (rules at the top of decide.py); `lead`: seconds a new replica takes to
    serve (the expected startup), how far ahead a rising demand is sized."""
    v = Votes()
    per = capacity.per_replica(cap, policy.queue_depth_per_replica, policy.tolerance) if dem is not None else None
    if dem is not None and per is not None and per > 0:
        _capacity_vote(policy, obs, stale, proj, dem, per, v, lead)
        if cap.line is not None and not cap.line.fitted:
            _confirm_by_queue(policy, obs, v)
        modelled = True
    else:
        _queue_vote(policy, obs, stale, proj, v)
        modelled = False
    _latency_votes(policy, obs, stale, modelled, v)
    return v


def _up(obs: Observation, stale: int, n: int) -> int:
    """Cold start: only a vote above what serves or is on its way adds pods (and replaces the stale ones)."""
    return n + stale if n > obs.current_replicas - stale else obs.current_replicas


def _capacity_vote(policy: AutoscalingPolicy, obs: Observation, stale: int, proj: Projection | None, dem: Demand,
                   per: float, v: Votes, lead: float) -> None:
    """Demand over per-replica capacity: up past tolerance of what serves or is on its way; down only where the
    load over fewer replicas still fits with the tolerance as margin (the scale-down window then takes the
    highest of these over its span: the feasibility check holds at the window's peak)."""
    current, tol = obs.current_replicas, policy.tolerance
    effective = current - stale
    load = dem.tokens_per_s / per  # replicas' worth of demand at the targets
    if proj is not None and proj.trend.rising:
        # A replica asked for now serves only after its startup: size a rise for then (or the next round).
        horizon = max(proj.interval, lead)
        ahead = load * max(proj.trend.at(horizon), 0.0) / max(proj.rate, 1e-9)
        if ahead > load:
            load = ahead
            v.notes.append(f"demand rising {proj.per_min()}/min: sized for {horizon:.0f}s ahead, when a new "
                           "replica would serve")
    load = _with_backlog(policy, obs, dem, per, effective, load, lead, v)
    if load > effective * (1 + tol):
        # Up to where the load fits with the tolerance as margin, as a scale-down must: demand keeps moving while
        # the new replicas start, and stopping exactly at the load would leave each at its target.
        n, within = ceil(load / (1 - tol)), False
    else:
        # The margin is the tolerance, or the demand's own noise around its trend (NOISE_Z standard deviations)
        # where that is larger: headroom a noisy or bursty load will use before a new replica could start.
        noise = proj.trend.spread / proj.trend.level if proj is not None and proj.trend.level > 0 else 0.0
        margin = min(max(tol, NOISE_Z * noise), MAX_MARGIN)
        n = ceil(load / (1 - margin))
        if margin > tol and n > ceil(load / (1 - tol)):
            v.notes.append(f"{margin:.0%} headroom for the demand's noise")
        if proj is not None and proj.trend.falling and proj.trend.fits and n < current:
            # Sized for when the scale-down window releases it, never below the load now (the trend moves it). Only
            # a line that describes its samples is projected: near a cycle's trough the samples curve away from the
            # line through its fall, and projecting it sized the fleet for a trough the load was leaving (the
            # suite's noisy sinusoid scaled down there and back up within 5 minutes, every cycle).
            at_end = load * max(proj.trend.at(proj.window), 0.0) / max(proj.rate, 1e-9)
            sized = ceil(max(at_end, load))
            if sized < n:
                n = sized
                v.notes.append(f"demand falling {proj.per_min()}/min: sized for the end of the "
                               f"{proj.window}s scale-down window")
        within = n >= current
    p = Proposal("capacity", dem.tokens_per_s, per, n)
    v.proposals.append(p)
    v.held |= within and n != current
    v.votes.append((current if within else _up(obs, stale, n) if n > effective else n, p))


def _with_backlog(policy: AutoscalingPolicy, obs: Observation, dem: Demand, per: float, effective: int,
                  load: float, lead: float, v: Votes) -> float:
    """The load plus what clears the backlog (requests held past the queue target) within DRAIN_S, where the
    replicas serving or on their way, each at its target, would take longer than that or than a new replica takes
    to start (a backlog they clear first needs nobody new)."""
    target = policy.queue_depth_per_replica
    if target is None or obs.queue_depth is None or dem.tokens_per_request <= 0:
        return load
    backlog = (obs.queue_depth - obs.ready_replicas * target) * dem.tokens_per_request  # tokens
    if backlog <= 0:
        return load
    surplus = effective * per - dem.tokens_per_s
    if surplus > 0 and backlog / surplus <= max(lead, DRAIN_S):
        return load
    v.notes.append(f"a backlog of {backlog / dem.tokens_per_request:,.0f} requests past the queue target: sized to "
                   f"clear it within {DRAIN_S:.0f}s")
    return load + backlog / DRAIN_S / per


def _confirm_by_queue(policy: AutoscalingPolicy, obs: Observation, v: Votes) -> None:
    """An assumed line (no fit yet) is a prior: its vote moves only the way the queue itself points past the
    tolerance (a move the fit would undo a few minutes later is a flap in the making)."""
    target, tol = policy.queue_depth_per_replica, policy.tolerance
    if target is None or obs.queue_depth is None or obs.reporting_replicas == 0 or not v.votes:
        return
    ratio = obs.queue_depth / obs.reporting_replicas / target
    n, p = v.votes[-1]
    current = obs.current_replicas
    if (n > current and ratio <= 1 + tol) or (n < current and ratio >= 1 - tol):
        v.votes[-1] = (current, p)
        v.held = True
        v.notes.append(f"capacity not fitted yet: waiting for the queue ({ratio:.2f} of target) to agree")


def _queue_vote(policy: AutoscalingPolicy, obs: Observation, stale: int, proj: Projection | None,
                v: Votes) -> None:
    """The queue rule, for agents without token counters (or before their flow is known)."""
    current, ready, tol = obs.current_replicas, obs.ready_replicas, policy.tolerance
    effective = current - stale
    target = policy.queue_depth_per_replica
    depths = [q + obs.held_requests for q in (obs.queue_depth, obs.queue_depth_mean) if q is not None]
    if target is not None and obs.reporting_replicas == 0 and obs.held_requests > 0:
        # No replica serves yet (all starting): the held requests alone size the fleet, linearly.
        n = ceil(obs.held_requests / target)
        p = Proposal("queue", obs.held_requests, target, n)
        v.proposals.append(p)
        v.votes.append((_up(obs, stale, n) if n > effective else current, p))
        return
    if target is None or not depths or obs.reporting_replicas == 0:
        return
    k = QUEUE_DEPTH_EXPONENT

    def ratio_of(q: float) -> float:  # per replica of target, once those on the way serve too
        return q / obs.reporting_replicas / target * (ready / effective) ** k if effective else math.inf

    # The newest depth and the window's mean must agree to move: up on the lower, down on the higher.
    lo, hi = min(depths), max(depths)
    ratio = ratio_of(lo) if ratio_of(lo) > 1 else ratio_of(hi) if ratio_of(hi) < 1 else 1.0
    depth = lo if ratio > 1 else hi if ratio < 1 else depths[0]
    per_pod = depth / obs.reporting_replicas / target
    hysteresis = 1.0 if ratio >= 1 else 1 - tol  # going down, stop where each would hold 1 - tolerance
    n = ceil(ready * (per_pod / hysteresis) ** (1 / k))
    within = abs(ratio - 1) <= tol
    if ratio < 1 and proj is not None and proj.trend.falling and proj.trend.fits:
        sized = ceil(max(proj.at(proj.window), proj.now()))
        if sized < n and sized < current:
            v.notes.append(f"request rate falling {proj.per_min()}/min: sized for the end of the {proj.window}s "
                           "scale-down window")
        n = min(n, sized)
    elif proj is not None and proj.trend.rising and proj.at(proj.interval) > effective * (1 + tol) ** (1 / k):
        n, within = max(n, ceil(proj.at(proj.interval))), False
        v.notes.append(f"request rate rising {proj.per_min()}/min: sized for the next round's load")
    p = Proposal("queue", depth, target, n)
    v.proposals.append(p)
    v.held |= within and n != current
    v.votes.append((current if within else _up(obs, stale, n) if n > effective else n, p))


def _latency_votes(policy: AutoscalingPolicy, obs: Observation, stale: int, modelled: bool, v: Votes) -> None:
    """Latency percentiles: shown always; with the capacity model they corrected it already (decide() lowered its
    ceiling on a queueing-bound breach), so they vote only without it, and then by at most LATENCY_STEP_MAX."""
    current, ready, tol = obs.current_replicas, obs.ready_replicas, policy.tolerance
    complete = 0 < obs.reporting_replicas == ready
    for t in policy.latency_targets:
        seen = obs.latency.get(t.source)
        if seen is None or ready == 0:
            continue
        ratio = seen / t.seconds
        bound = t.metric == "ttft" and capacity.prefill_bound(obs, t.seconds)
        n = ceil(ready * min(ratio, LATENCY_STEP_MAX)) if ratio > 1 + tol and not bound else (
            current if ratio > 1 else max(ceil(ready * ratio), 1))
        p = Proposal(t.source, seen, t.seconds, n)
        v.proposals.append(p)
        if ratio > 1 + tol and bound:
            v.notes.append(f"{t.source.replace('_', ' ')} {seen:.3g}s over {t.seconds:g}s is prefill-bound (queue "
                           f"wait p95 {obs.queue_time_p95:.3g}s): more replicas would not lower it")
            continue
        if modelled or not complete:
            continue  # stale or partial data never votes up; the model already took a fresh breach in
        if abs(ratio - 1) <= tol:
            v.held |= n != current
            v.votes.append((current, p))
        elif ratio > 1:
            # Over target never asks for fewer than current; replicas on their way already answer it.
            v.votes.append((_up(obs, stale, n) if stale or obs.starting_replicas == 0 else current, p))
        elif policy.queue_depth_per_replica is None:
            # Latency alone is flat until saturation: step down one ready replica at a time.
            v.votes.append((max(n, ready - 1), p))
