"""Pure: spec → autoscaler policy, Decision → the CRD's status.autoscaling and conditions, and back after a restart."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from kvfleet_operator.autoscaling.decide import (
    AutoscalerState,
    AutoscalingPolicy,
    Behavior,
    Decision,
    LatencyTarget,
    ScaleEvent,
    ScalingPolicy,
    ScalingRules,
)
from kvfleet_operator.autoscaling.fleet import Fleet, timestamp
from kvfleet_operator.autoscaling.router_demand import RouterDemand
from kvfleet_operator.builders import STARTUP_FAILURES, STARTUP_PERIOD_SECONDS
from kvfleet_operator.models import AutoscalingSpec, ScaleDownRules, ScaleUpRules
from kvfleet_operator.status import (
    AUTOSCALER_CONDITIONS,
    CAPACITY_BLOCKED,
    METRICS_AVAILABLE,
    SCALING_ACTIVE,
    SCALING_LIMITED,
    AutoscalingStatus,
    Condition,
    ScalingDecision,
    ScalingProposal,
    condition,
    human_seconds,
)

HISTORY = 10  # decisions that changed replicas kept in status, newest first


def rfc3339(t: float) -> str:
    """Unix seconds as a Kubernetes timestamp."""
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _rules(r: ScaleUpRules | ScaleDownRules) -> ScalingRules:
    return ScalingRules(r.stabilization_window_seconds,
                        tuple(ScalingPolicy(p.type, p.value, p.period_seconds) for p in r.policies), r.select_policy)


def policy(a: AutoscalingSpec) -> AutoscalingPolicy:
    """spec.autoscaling as the pure decision function's policy (the CRD's defaults, not decide.py's)."""
    return AutoscalingPolicy(
        mode=a.mode, min_replicas=a.min_replicas, max_replicas=a.max_replicas, tolerance=a.tolerance,
        queue_depth_per_replica=a.targets.queue_depth_per_replica,
        latency_targets=tuple(LatencyTarget(t.metric, t.percentile, t.seconds) for t in a.targets.latency),
        behavior=Behavior(_rules(a.behavior.scale_up), _rules(a.behavior.scale_down)),
        startup_grace_seconds=a.startup_grace_seconds, scale_to_zero_after_seconds=a.scale_to_zero_after_seconds,
        startup_budget_seconds=float(STARTUP_PERIOD_SECONDS * STARTUP_FAILURES))


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def decision_status(d: Decision) -> ScalingDecision:
    """One Decision in the CRD's shape: an RFC3339 time, and no expectedStartupSeconds (that sits one level up)."""
    return ScalingDecision(
        time=rfc3339(d.time), current_replicas=d.current_replicas, ready_replicas=d.ready_replicas,
        starting_replicas=d.starting_replicas, desired_replicas=d.desired_replicas,
        proposals=[ScalingProposal(source=p.source, observed=_finite(p.observed), target=p.target,
                                   replicas=p.replicas) for p in d.proposals][:16],
        limited_by=d.limited_by, reason=d.reason[:1024])


def autoscaling_status(d: Decision, previous: Mapping[str, Any] | None,
                       ttft_p95: float | None, itl_p95: float | None = None) -> AutoscalingStatus:
    """status.autoscaling after decision `d`; `previous` is the stored status.autoscaling (for the history); the
    window's TTFT and ITL p95 in seconds (None: nothing observed)."""
    last = decision_status(d)
    history = []
    for h in (previous or {}).get("history") or []:
        with contextlib.suppress(ValidationError):  # an entry of another shape (older operator) is dropped
            history.append(ScalingDecision.model_validate(h))
    if d.desired_replicas != d.current_replicas:
        history.insert(0, last)
    expected = None if d.expected_startup_seconds is None else round(d.expected_startup_seconds, 1)
    return AutoscalingStatus(
        last_decision=last, history=history[:HISTORY], expected_startup_seconds=expected,
        expected_startup=None if expected is None else f"{expected:.1f}s",
        startup_samples=len(d.state.startup_durations) if expected is not None else None,
        last_ttft_p95_seconds=None if _finite(ttft_p95) is None else round(ttft_p95 or 0.0, 4),
        ttft_p95=_human(ttft_p95), itl_p95=_human(itl_p95))


def _human(seconds: float | None) -> str | None:
    value = _finite(seconds)
    return None if value is None else human_seconds(value)


def _camel(limited_by: str) -> str:
    return limited_by[:1].upper() + limited_by[1:]


def conditions(d: Decision, fleet: Fleet, errors: Mapping[str, str], *, generation: int, now: str,
               previous: list[dict[str, Any]], routers: RouterDemand | None = None) -> list[dict[str, Any]]:
    """ScalingActive, ScalingLimited, CapacityBlocked and MetricsAvailable for decision `d` (at zero replicas,
    MetricsAvailable speaks of the `routers`: their held requests are then the only demand to read)."""
    prev = {c.get("type", ""): c for c in previous if c.get("type") in AUTOSCALER_CONDITIONS}

    def cond(type_: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
        return condition(type_, ok, reason, message, generation, now, prev)

    active = (cond(SCALING_ACTIVE, False, "NoMetrics", d.reason) if d.limited_by == "noMetrics"
              else cond(SCALING_ACTIVE, True, "ScaledToZero", d.reason) if d.desired_replicas == 0
              else cond(SCALING_ACTIVE, True, "ValidMetricFound", d.reason))
    limited = (cond(SCALING_LIMITED, False, "DesiredWithinRange", d.reason) if d.limited_by == "none"
               else cond(SCALING_LIMITED, True, _camel(d.limited_by), d.reason))
    if fleet.unschedulable:
        first = fleet.unschedulable[0]
        blocked = cond(CAPACITY_BLOCKED, True, "Unschedulable",
                       f"{len(fleet.unschedulable)} pods cannot be scheduled ({first.name}: "
                       f"{first.unschedulable_message or 'Unschedulable'}); scale-up goes on only while fewer are "
                       "Pending than the budget")
    else:
        blocked = cond(CAPACITY_BLOCKED, False, "AllPodsSchedulable", "no pod is waiting for capacity")
    ready = len(fleet.ready)
    reporting = ready - sum(1 for p in fleet.ready if p.name in errors)
    if ready == 0 and d.current_replicas == 0 and routers is not None:
        metrics = _at_zero(cond, routers)
    elif ready == 0:
        metrics = cond(METRICS_AVAILABLE, False, "NoReadyReplicas", "no ready pod to read metrics from")
    elif errors:
        detail = "; ".join(f"{pod}: {err}" for pod, err in sorted(errors.items()))
        metrics = cond(METRICS_AVAILABLE, False, "ScrapeFailed",
                       f"{reporting}/{ready} ready pods reported metrics (never scaling down on partial data): "
                       f"{detail}")
    else:
        metrics = cond(METRICS_AVAILABLE, True, "AllReplicasReporting", f"{ready}/{ready} ready pods reported metrics")
    out = [active, limited, blocked, metrics]
    for c in out:
        Condition.model_validate(c)  # the CRD would refuse it: fail here, where the bug is
    return out


def _at_zero(cond: Callable[[str, bool, str, str], dict[str, Any]], routers: RouterDemand) -> dict[str, Any]:
    """MetricsAvailable at zero replicas: whether every router could say what it holds for this deployment."""
    n, total = len(routers.reporting), len(routers.reporting) + len(routers.errors)
    if routers.errors:
        detail = "; ".join(f"{r}: {e}" for r, e in routers.errors.items())
        return cond(METRICS_AVAILABLE, False, "RouterScrapeFailed",
                    f"at zero replicas, {n}/{total} kvfleet-routers reported their held requests (requests held at "
                    f"the others do not bring a replica back): {detail}")
    if n == 0:
        return cond(METRICS_AVAILABLE, False, "NoRouter",
                    "at zero replicas, and no ready kvfleet-router pod (label app.kubernetes.io/name=kvfleet-router) "
                    "was found: no held request can bring a replica back")
    return cond(METRICS_AVAILABLE, True, "RoutersReporting",
                f"at zero replicas: {n}/{n} kvfleet-routers reported their held requests")


def rebuild_state(previous: Mapping[str, Any] | None) -> AutoscalerState:
    """The decision function's carried state after an operator restart, from what status.autoscaling kept.

    Scale events come back from the history (so rate limits still count recent changes) and the learned startup
    time as one sample. The stabilization windows' recommendations are not stored: decide() then seeds them
    with the current count, which delays a scale-down by one window and never causes one (the safe side)."""
    prev = previous or {}
    events = []
    for h in reversed(prev.get("history") or []):
        t = timestamp(h.get("time"))
        change = int(h.get("desiredReplicas") or 0) - int(h.get("currentReplicas") or 0)
        if t is not None and change:
            events.append(ScaleEvent(t, change))
    expected = prev.get("expectedStartupSeconds")
    return AutoscalerState((), tuple(events), (float(expected),) if isinstance(expected, int | float) else ())
