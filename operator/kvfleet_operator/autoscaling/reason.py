"""The sentence that explains a decision: the winning signal, its proposal, and what limited it."""

from __future__ import annotations

from kvfleet_operator.autoscaling.behavior import ScalingRules
from kvfleet_operator.autoscaling.decision import AutoscalingPolicy, LimitedBy, Observation, Proposal


def describe_rate(rules: ScalingRules, up: bool) -> str:
    """E.g. "+100% or +4 pods per 15s, whichever is more"."""
    if rules.select_policy == "Disabled":
        return "selectPolicy Disabled"
    sign = "+" if up else "-"
    parts = [f"{sign}{p.value}{'%' if p.type == 'Percent' else ' pods'} per {p.period_seconds}s"
             for p in rules.policies]
    if len(parts) == 1:
        return parts[0]
    return " or ".join(parts) + (", whichever is more" if rules.select_policy == "Max" else ", whichever is less")


def explain(policy: AutoscalingPolicy, obs: Observation, win: Proposal | None, raw: int, desired: int,
            limited: LimitedBy, expected: float | None, zero_tail: str = "") -> str:
    """One human sentence: the winning signal, the proposal, and what limited it (`zero_tail`: the words of the
    scale-to-zero limits, scaleToZeroWindow and noRouter, which zero.py writes)."""
    starting = f" + {obs.starting_replicas} starting" if obs.starting_replicas else ""
    fleet = f"with {obs.ready_replicas} ready{starting}"
    if win is None:
        head = f"no metrics from {obs.ready_replicas} ready ({obs.reporting_replicas} reporting)"
    else:
        if win.source == "capacity":
            held = f", {obs.held_requests:g} held at the router" if obs.held_requests else ""
            target = (f"queue target {policy.queue_depth_per_replica:g}" if policy.queue_depth_per_replica is not None
                      else "the latency targets")
            head = (f"demand {win.observed:,.0f} tokens/s{held} against {win.target:,.0f} tokens/s per replica at "
                    f"{target} {fleet}")
        elif win.source == "queue":
            held = f" (with {obs.held_requests:g} held at the router)" if obs.held_requests else ""
            head = f"queue depth {win.observed:g}{held} at target {win.target:g} per replica {fleet}"
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
        "scaleUpRate": f"limited to {k} by scale-up rate ({describe_rate(b.scale_up, True)})",
        "scaleDownRate": f"limited to {k} by scale-down rate ({describe_rate(b.scale_down, False)})",
        "recentScaleDown": f"keeping {k}",
        "partialMetrics": f"keeping {k}: only {obs.reporting_replicas} of {obs.ready_replicas} ready pods reported "
                          "metrics, never scaling down on partial data",
        "capacityBlocked": f"limited to {k}: {obs.unschedulable_replicas} unschedulable "
                           f"pod{'' if obs.unschedulable_replicas == 1 else 's'}, at most "
                           f"{policy.unschedulable_budget} pending at once",
        "minReplicas": f"raised to minReplicas {k}", "maxReplicas": f"capped at maxReplicas {k}",
        "scaleToZeroWindow": zero_tail, "noRouter": zero_tail,
    }[limited]
    if raw != desired and limited in ("none", "minReplicas", "maxReplicas"):
        tail = f"recommending {raw}, " + tail
    return f"{head}; {tail}"
