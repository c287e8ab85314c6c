"""Pure: when an idle fleet goes to zero replicas, and how requests held at a router bring it back."""

# The rules (decide() calls them; minReplicas 0 enables the first):
# - To zero: only after a whole idle window (spec.autoscaling.scaleToZeroAfterSeconds). A round is idle when
#   every ready pod reported, none holds a request (waiting + running 0), none finished or refused one since its
#   previous scrape (kvfleet_requests_total flat: so none arrived in between, however short), and the routers
#   that answered hold none for this deployment while none failed to answer. The window runs from the first
#   idle round of an unbroken stretch. The window is the stabilization of this step: the scale-down window and
#   rate limits, made for noisy load, do not delay it (nothing is noisy about no request at all), but a
#   scale-down selectPolicy of Disabled does (the user's word). Without a router answering, nothing could bring
#   a replica back: the fleet stays at one.
# - The other rules never take the last replica: below one they stop at one (limitedBy scaleToZeroWindow).
# - From zero: requests held at a router for this deployment (or still on a pod being removed) scale 0 → at
#   least 1 in the next round, exempt from stabilization, rate limits, selectPolicy and the reversal rule: zero
#   was the autoscaler's own choice, and a held request waits for it. With a queue target the step is sized
#   for the held requests (held / target, the rest under the scale-up rate limit), so a burst does not wait a
#   startup for each doubling.

from __future__ import annotations

import math
from dataclasses import dataclass

from kvfleet_operator.autoscaling.behavior import Recommendation, ScaleEvent, event_horizon, rate_limit
from kvfleet_operator.autoscaling.decision import (
    AutoscalerState,
    AutoscalingPolicy,
    Decision,
    LimitedBy,
    Observation,
)
from kvfleet_operator.autoscaling.reason import describe_rate


def count(n: float, noun: str) -> str:
    """E.g. "1 request", "3 requests", "2.5 requests"."""
    return f"{n:g} {noun}" if n == 1 else f"{n:g} {noun}s"


def quiet(obs: Observation) -> bool:
    """Whether this round saw no demand at all (the rules at the top of this module)."""
    return (obs.ready_replicas > 0 and obs.reporting_replicas == obs.ready_replicas and obs.queue_depth == 0
            and obs.requests_arrived == 0 and obs.held_requests == 0 and obs.routers_failing == 0)


def busy(obs: Observation) -> str:
    """Why this round is not idle, e.g. "3 requests held at the router for this deployment"."""
    if obs.held_requests > 0:
        return f"{count(obs.held_requests, 'request')} held at the router for this deployment"
    if obs.queue_depth:
        return f"{count(obs.queue_depth, 'request')} waiting or running"
    if obs.requests_arrived:
        return f"{count(obs.requests_arrived, 'request')} finished or refused since the last round"
    if obs.ready_replicas == 0:
        return "no ready replica to read"
    if obs.reporting_replicas < obs.ready_replicas:
        return f"only {obs.reporting_replicas} of {obs.ready_replicas} ready pods reported metrics"
    if obs.routers_failing:
        return f"{count(obs.routers_failing, 'router')} could not be read (their held requests are unknown)"
    return "request counters not read twice yet"


def idle_since(obs: Observation, since: float | None) -> float | None:
    """The start of the idle stretch this round continues (now if it starts one); None when not idle."""
    if not quiet(obs):
        return None
    return since if since is not None else obs.now


@dataclass(frozen=True)
class ToZero:
    """What the scale-to-zero rule says this round: `go` (scale to 0 now, `text` the whole reason), else the
    limit that holds a lower recommendation at one (`text` its words) and a `note` for any other decision."""

    go: bool
    limited: LimitedBy
    text: str
    note: str = ""


def to_zero(policy: AutoscalingPolicy, obs: Observation, idle: float | None) -> ToZero | None:
    """The scale-to-zero rule for a fleet of one or more replicas; None while minReplicas >= 1."""
    if policy.min_replicas > 0:
        return None
    window = policy.scale_to_zero_after_seconds
    if obs.routers_reporting == 0:
        failing = f" ({count(obs.routers_failing, 'router')} could not be read)" if obs.routers_failing else ""
        text = (f"no kvfleet-router answered{failing}, and only requests held at a router bring a replica back "
                "from zero")
        return ToZero(False, "noRouter", f"keeping 1: {text}", f"not scaling to zero: {text}")
    if idle is None:
        return ToZero(False, "scaleToZeroWindow",
                      f"keeping 1 until idle for the {window:g}s scale-to-zero window (not idle: {busy(obs)})")
    idle_for = obs.now - idle
    if idle_for < window:
        return ToZero(False, "scaleToZeroWindow",
                      f"keeping 1 until idle for the {window:g}s scale-to-zero window (idle for {idle_for:.0f}s)",
                      f"idle for {idle_for:.0f}s of the {window:g}s scale-to-zero window")
    if policy.behavior.scale_down.select_policy == "Disabled":
        # Scale-down is then held at the current count by the rate limit (limitedBy scaleDownRate): only a note.
        return ToZero(False, "scaleDownRate", "", f"idle for {idle_for:.0f}s, but scale-down is Disabled")
    routers = count(obs.routers_reporting, "router")
    return ToZero(True, "none", f"idle for {idle_for:.0f}s (scale-to-zero window {window:g}s): no request "
                  f"waiting, running or arriving at {obs.ready_replicas} ready, none held at {routers}; scaling to 0")


def from_zero(policy: AutoscalingPolicy, obs: Observation, state: AutoscalerState, durations: tuple[float, ...],
              expected: float | None) -> Decision:
    """The decision for a fleet at zero replicas (the rules at the top of this module)."""
    now, up, down = obs.now, policy.behavior.scale_up, policy.behavior.scale_down
    demand = obs.held_requests + (obs.queue_depth or 0.0)
    limited: LimitedBy = "none"
    if demand > 0:
        target = policy.queue_depth_per_replica
        sized = max(1, math.ceil(demand / target - 1e-9)) if target else 1
        n = min(sized, policy.max_replicas)
        if n < sized:
            limited = "maxReplicas"
        allowed = max(1, rate_limit(0, n, state.scale_events, up, down, now))  # beyond the first replica
        if allowed < n:
            n, limited = allowed, "scaleUpRate"
        n = max(n, policy.min_replicas)
        parts = [f"{count(obs.held_requests, 'request')} held at the router for this deployment"
                 if obs.held_requests else "",
                 f"{count(obs.queue_depth or 0.0, 'request')} on pods being removed" if obs.queue_depth else ""]
        reason = f"{' and '.join(p for p in parts if p)}: scaling 0 → {n}"
        if target and sized > 1:
            reason += f" (sized for {demand:g} at queue target {target:g} per replica)"
        if limited == "maxReplicas":
            reason += f", capped at maxReplicas {n}"
        elif limited == "scaleUpRate":
            reason += f", beyond the first limited by scale-up rate ({describe_rate(up, True)})"
    elif policy.min_replicas > 0:
        n, limited = policy.min_replicas, "minReplicas"
        reason = f"at 0 replicas: raised to minReplicas {n}"
    else:
        n = 0
        failing = (f"; {count(obs.routers_failing, 'router')} could not be read, so requests held there are not "
                   "seen") if obs.routers_failing else ""
        if obs.routers_reporting:
            reason = f"scaled to zero: nothing held at {count(obs.routers_reporting, 'router')}{failing}; keeping 0"
        else:
            limited = "noRouter"
            reason = (f"scaled to zero, and no kvfleet-router answered{failing}: no held request can bring a "
                      "replica back; keeping 0")
    # The windows restart from here: the rounds at zero recommended nothing a window should weigh against demand.
    events = tuple(e for e in state.scale_events if e.time > now - event_horizon(up, down))
    new_state = AutoscalerState((Recommendation(now, n),), (*events, *((ScaleEvent(now, n),) if n else ())),
                                durations, capacity=state.capacity)  # what a replica serves outlives a stretch at 0
    return Decision(now, 0, obs.ready_replicas, obs.starting_replicas, n, (), limited, reason, expected, new_state)
