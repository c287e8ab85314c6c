"""autoscaling/status.py: the spec as a policy; a Decision in the CRD's status shape; state back after a restart."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from kvfleet_operator.autoscaling.decide import DEFAULT_SCALE_UP, AutoscalerState, Decision, Proposal, ScaleEvent
from kvfleet_operator.autoscaling.fleet import Fleet, Pod
from kvfleet_operator.autoscaling.status import autoscaling_status, conditions, decision_status, policy, rebuild_state
from kvfleet_operator.builders import STARTUP_FAILURES, STARTUP_PERIOD_SECONDS
from kvfleet_operator.models import AutoscalingSpec
from kvfleet_operator.status import AutoscalingStatus, InferenceDeploymentStatus, human_seconds

NOW = 1767225600.0  # 2026-01-01T00:00:00Z


def decision(current: int = 2, desired: int = 4, limited_by: Any = "none", t: float = NOW,
             expected: float | None = 42.04) -> Decision:
    proposals = (Proposal("queue", 30.0, 4.0, 4), Proposal("ttft_p95", math.nan, 0.5, 1))
    return Decision(t, current, 2, 0, desired, proposals, limited_by,
                    "queue depth 30 at target 4 per replica with 2 ready: proposing 4; scaling to 4", expected,
                    AutoscalerState())


def test_policy_takes_the_crds_defaults_and_every_knob() -> None:
    spec = AutoscalingSpec.model_validate({
        "mode": "builtin", "minReplicas": 2, "maxReplicas": 9, "tolerance": 0.2,
        "targets": {"queueDepthPerReplica": 6, "latency": [{"metric": "ttft", "percentile": 95, "seconds": 0.5}]},
        "behavior": {"scaleDown": {"stabilizationWindowSeconds": 20}}})
    p = policy(spec)
    assert (p.min_replicas, p.max_replicas, p.tolerance, p.queue_depth_per_replica) == (2, 9, 0.2, 6)
    assert [t.source for t in p.latency_targets] == ["ttft_p95"]
    assert p.behavior.scale_down.stabilization_window_seconds == 20
    # The CRD's scale-up default, which is the one the autoscaler was tuned with.
    assert [(q.type, q.value, q.period_seconds) for q in p.behavior.scale_up.policies] == [
        ("Percent", 400, 15), ("Pods", 16, 15)]
    assert p.behavior.scale_up == DEFAULT_SCALE_UP
    # Before any startup is learned, a starting pod counts as on its way for as long as the startup probe lets it
    # try (the kubelet restarts it after that): the probe the builders put on the agent's container.
    assert p.startup_budget_seconds == STARTUP_PERIOD_SECONDS * STARTUP_FAILURES


def test_a_capacity_proposal_in_the_crds_shape() -> None:
    d = dataclasses.replace(decision(), proposals=(Proposal("capacity", 3150.0, 500.0, 7),))
    out = decision_status(d).model_dump(mode="json", by_alias=True, exclude_none=True)
    assert out["proposals"] == [{"source": "capacity", "observed": 3150.0, "target": 500.0, "replicas": 7}]
    InferenceDeploymentStatus.model_validate({"autoscaling": {"lastDecision": out}})


def test_decision_in_the_crds_shape() -> None:
    d = decision_status(decision())
    out = d.model_dump(mode="json", by_alias=True, exclude_none=True)
    assert out["time"] == "2026-01-01T00:00:00Z"  # RFC3339, not the decision's epoch float
    assert "expectedStartupSeconds" not in out
    assert out["proposals"][1] == {"source": "ttft_p95", "target": 0.5, "replicas": 1}  # NaN is no observation
    assert (out["currentReplicas"], out["desiredReplicas"], out["limitedBy"]) == (2, 4, "none")


def test_history_keeps_ten_changes_newest_first() -> None:
    status: dict[str, object] = {}
    for i in range(12):
        status = autoscaling_status(decision(current=i, desired=i + 1, t=NOW + i), status, 0.123456).model_dump(
            mode="json", by_alias=True, exclude_none=True)
    kept = autoscaling_status(decision(current=5, desired=5, t=NOW + 99), status, None)
    assert len(kept.history) == 10 and kept.history[0].current_replicas == 11  # an unchanged decision adds none
    assert kept.last_decision is not None and kept.last_decision.desired_replicas == 5
    assert status["expectedStartupSeconds"] == 42.0 and status["lastTtftP95Seconds"] == 0.1235
    assert status["ttftP95"] == "123ms" and "itlP95" not in status  # nothing observed: no column text
    full = InferenceDeploymentStatus.model_validate({"autoscaling": status})  # what the CRD schema holds
    assert isinstance(full.autoscaling, AutoscalingStatus)


@pytest.mark.parametrize(("seconds", "text"), [(0.1718, "172ms"), (0.0214, "21.4ms"), (0.00412, "4.12ms"),
                                               (2.5, "2.50s"), (250.0, "250s")])
def test_latency_columns_carry_their_unit(seconds: float, text: str) -> None:
    assert human_seconds(seconds) == text
    out = autoscaling_status(decision(2, 2, t=NOW), None, seconds, seconds / 10)
    assert out.ttft_p95 == text and out.itl_p95 == human_seconds(seconds / 10)


def test_state_after_a_restart_comes_back_from_the_status() -> None:
    status = autoscaling_status(decision(2, 4, t=NOW), None, None).model_dump(mode="json", by_alias=True)
    state = rebuild_state(status)
    assert state.scale_events == (ScaleEvent(NOW, 2),) and state.startup_durations == (42.0,)
    assert state.recommendations == ()  # decide() seeds them with the current count: no scale-down at once
    assert rebuild_state(None) == AutoscalerState()


def pod(name: str, message: str = "") -> Pod:
    return Pod(name, f"u-{name}", NOW, NOW, f"http://{name}/metrics", NOW if message else None, message)


@pytest.mark.parametrize(("limited_by", "active", "limited"), [("none", "True", "False"),
                                                              ("scaleDownStabilization", "True", "True"),
                                                              ("noMetrics", "False", "True")])
def test_conditions(limited_by: str, active: str, limited: str) -> None:
    fleet = Fleet((pod("a"), pod("b")), (pod("c", "0/3 nodes are available"),), (pod("c", "0/3 nodes are available"),))
    out = {c["type"]: c for c in conditions(decision(limited_by=limited_by), fleet, {"b": "timeout after 2s"},
                                            generation=3, now="2026-01-01T00:00:00Z", previous=[])}
    assert out["ScalingActive"]["status"] == active and out["ScalingLimited"]["status"] == limited
    if limited_by == "scaleDownStabilization":
        assert out["ScalingLimited"]["reason"] == "ScaleDownStabilization"
    assert (out["CapacityBlocked"]["status"], out["CapacityBlocked"]["reason"]) == ("True", "Unschedulable")
    assert "0/3 nodes are available" in out["CapacityBlocked"]["message"]
    metrics = out["MetricsAvailable"]
    assert (metrics["status"], metrics["reason"]) == ("False", "ScrapeFailed")
    assert "1/2 ready pods reported" in metrics["message"] and "b: timeout after 2s" in metrics["message"]
    assert all(c["observedGeneration"] == 3 for c in out.values())


def test_the_learned_startup_carries_its_unit_and_sample_count() -> None:
    d = dataclasses.replace(decision(expected=83.96), state=AutoscalerState(startup_durations=(80.0, 83.96, 90.0)))
    out = autoscaling_status(d, None, None).model_dump(mode="json", by_alias=True, exclude_none=True)
    assert (out["expectedStartupSeconds"], out["expectedStartup"], out["startupSamples"]) == (84.0, "84.0s", 3)
    nothing = autoscaling_status(decision(expected=None), None, None).model_dump(by_alias=True, exclude_none=True)
    assert not {"expectedStartupSeconds", "expectedStartup", "startupSamples"} & set(nothing)  # none learned yet


def test_capacity_blocked_does_not_claim_a_freeze_the_budget_lifts() -> None:
    # One pod Pending-unschedulable and the decision scaled past it (within the budget): the condition must not
    # tell the user that nothing scales up until it schedules.
    fleet = Fleet((pod("a"),), (pod("c", "0/3 nodes are available"),), (pod("c", "0/3 nodes are available"),))
    out = {c["type"]: c for c in conditions(decision(current=2, desired=5), fleet, {}, generation=1,
                                            now="2026-01-01T00:00:00Z", previous=[])}
    assert out["CapacityBlocked"]["status"] == "True"
    assert "no scale-up until they schedule" not in out["CapacityBlocked"]["message"]
