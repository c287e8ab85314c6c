"""Scale to zero and back (autoscaling/zero.py through decide()): one test per rule, worked by hand."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from pydantic import ValidationError

from kvfleet_operator.autoscaling.decide import (
    AutoscalerState,
    AutoscalingPolicy,
    Behavior,
    Observation,
    Recommendation,
    ScaleEvent,
    ScalingPolicy,
    ScalingRules,
    decide,
)
from kvfleet_operator.autoscaling.status import policy
from kvfleet_operator.config import OperatorConfig
from kvfleet_operator.models import AutoscalingSpec
from kvfleet_operator.plan import child_keys, make_plan

NOW = 1000.0
ZERO = AutoscalingPolicy(min_replicas=0, max_replicas=20, queue_depth_per_replica=10, scale_to_zero_after_seconds=60)
EXPIRED = AutoscalerState(recommendations=(Recommendation(0.0, 1),))  # windows long past: nothing held


def idle(**kw: Any) -> Observation:
    """One ready replica with nothing waiting, running, arriving or held, and one router that answered."""
    base: dict[str, Any] = dict(now=NOW, current_replicas=1, ready_replicas=1, starting_replicas=0,
                                reporting_replicas=1, queue_depth=0.0, queue_depth_mean=0.0, requests_arrived=0.0,
                                routers_reporting=1)
    return Observation(**(base | kw))


def at_zero(**kw: Any) -> Observation:
    base: dict[str, Any] = dict(now=NOW, current_replicas=0, ready_replicas=0, starting_replicas=0,
                                reporting_replicas=0, routers_reporting=1)
    return Observation(**(base | kw))


def test_an_idle_fleet_keeps_one_replica_until_the_window_has_passed_then_goes_to_zero() -> None:
    first = decide(ZERO, idle(), EXPIRED)
    # The queue asks for 0; the other rules stop at one while the idle window runs (it starts now).
    assert (first.desired_replicas, first.limited_by, first.state.idle_since) == (1, "scaleToZeroWindow", NOW)
    assert first.reason.endswith("; keeping 1 until idle for the 60s scale-to-zero window (idle for 0s)")
    half = decide(ZERO, idle(now=NOW + 30), first.state)
    assert (half.desired_replicas, half.state.idle_since) == (1, NOW)
    assert "(idle for 30s)" in half.reason
    done = decide(ZERO, idle(now=NOW + 60), half.state)
    assert (done.desired_replicas, done.limited_by) == (0, "none")
    assert done.reason == ("idle for 60s (scale-to-zero window 60s): no request waiting, running or arriving at 1 "
                           "ready, none held at 1 router; scaling to 0")
    assert done.state.scale_events[-1] == ScaleEvent(NOW + 60, -1)


def test_any_demand_restarts_the_window() -> None:
    started = decide(ZERO, idle(), EXPIRED).state
    for obs, why in [(idle(held_requests=3.0), "3 requests held at the router for this deployment"),
                     (idle(queue_depth=1.0), "1 request waiting or running"),
                     (idle(requests_arrived=2.0), "2 requests finished or refused since the last round"),
                     (idle(requests_arrived=None), "request counters not read twice yet"),
                     (idle(routers_failing=1), "1 router could not be read (their held requests are unknown)"),
                     (idle(ready_replicas=2, current_replicas=2), "only 1 of 2 ready pods reported metrics")]:
        d = decide(ZERO, replace(obs, now=NOW + 120), started)
        assert d.desired_replicas >= 1 and d.state.idle_since is None, why
        if d.limited_by == "scaleToZeroWindow":
            assert d.reason.endswith(f"(not idle: {why})"), d.reason


def test_held_requests_count_as_queue_depth_while_replicas_serve() -> None:
    # 3 held + 5 in the agents' queue on 1 replica at target 10: 0.8 per replica, within hysteresis: keep 1.
    d = decide(ZERO, idle(queue_depth=5.0, queue_depth_mean=5.0, held_requests=3.0), EXPIRED)
    assert d.proposals[0].observed == 8 and d.desired_replicas == 1
    assert d.reason.startswith("queue depth 8 (with 3 held at the router) at target 10 per replica with 1 ready")
    # Held requests while the only replica is still starting size the fleet on their own, linearly.
    starting = decide(ZERO, idle(ready_replicas=0, reporting_replicas=0, starting_replicas=1, queue_depth=None,
                                 held_requests=30.0, starting_ages=(5.0,)), EXPIRED)
    assert (starting.proposals[0].observed, starting.desired_replicas) == (30, 3)


def test_the_idle_window_is_the_only_stabilization_of_the_step_to_zero() -> None:
    # Three replicas whose scale-down window (300 s, default) still holds a recommendation of 3: idle past the
    # scale-to-zero window, they go to zero at once, rate limits aside (nothing is noisy about no request).
    state = AutoscalerState(recommendations=(Recommendation(NOW - 10, 3),), idle_since=NOW - 60)
    d = decide(ZERO, idle(current_replicas=3, ready_replicas=3, reporting_replicas=3), state)
    assert (d.desired_replicas, d.limited_by) == (0, "none")
    # A scale-down selectPolicy of Disabled is the user's word: it holds even the last replica.
    disabled = replace(ZERO, behavior=Behavior(scale_down=ScalingRules(0, (), "Disabled")))
    kept = decide(disabled, idle(), state)
    assert (kept.desired_replicas, kept.limited_by) == (1, "scaleDownRate")
    assert kept.reason.endswith("limited to 1 by scale-down rate (selectPolicy Disabled) (idle for 60s, but "
                                "scale-down is Disabled)")
    # Without a router, a fleet the other rules keep (here the scale-down window) is told why zero is not taken.
    held = decide(ZERO, idle(routers_reporting=0), AutoscalerState(idle_since=NOW - 3600))
    assert held.limited_by == "scaleDownStabilization" and held.reason.endswith(
        "(not scaling to zero: no kvfleet-router answered, and only requests held at a router bring a replica "
        "back from zero)")


def test_without_a_router_answering_zero_would_be_one_way_so_one_replica_stays() -> None:
    d = decide(ZERO, idle(routers_reporting=0), replace(EXPIRED, idle_since=NOW - 3600))
    assert (d.desired_replicas, d.limited_by) == (1, "noRouter")
    assert d.reason.endswith("; keeping 1: no kvfleet-router answered, and only requests held at a router bring a "
                             "replica back from zero")


def test_minimum_one_never_goes_to_zero_nor_tracks_idleness_in_the_reason() -> None:
    d = decide(replace(ZERO, min_replicas=1), idle(), replace(EXPIRED, idle_since=NOW - 3600))
    assert (d.desired_replicas, d.limited_by) == (1, "minReplicas") and "scale-to-zero" not in d.reason


def test_a_held_request_brings_one_replica_back_at_the_next_round_whatever_the_windows() -> None:
    # A 600 s scale-up stabilization window full of zero recommendations, a Percent-only scale-up policy (0% of 0
    # is 0), and a scale-down 10 s ago: none of them delays the step from zero.
    slow = replace(ZERO, behavior=Behavior(scale_up=ScalingRules(600, (ScalingPolicy("Percent", 100, 60),)),
                                           scale_down=ScalingRules(300, (ScalingPolicy("Percent", 100, 15),))))
    state = AutoscalerState(recommendations=(Recommendation(NOW - 30, 0),), scale_events=(ScaleEvent(NOW - 10, -1),))
    d = decide(slow, at_zero(held_requests=3.0), state)
    assert (d.desired_replicas, d.limited_by) == (1, "none")
    assert d.reason == "3 requests held at the router for this deployment: scaling 0 → 1"
    assert d.state.recommendations == (Recommendation(NOW, 1),) and d.state.scale_events[-1] == ScaleEvent(NOW, 1)
    disabled = replace(ZERO, behavior=Behavior(scale_up=ScalingRules(0, (), "Disabled")))
    assert decide(disabled, at_zero(held_requests=1.0), state).desired_replicas == 1


def test_the_step_from_zero_is_sized_for_the_held_requests_within_the_rate_limit_and_max() -> None:
    big = decide(ZERO, at_zero(held_requests=45.0), AutoscalerState())  # default: +16 pods per 15 s allowed
    assert (big.desired_replicas, big.limited_by) == (5, "none")
    assert big.reason.endswith("scaling 0 → 5 (sized for 45 at queue target 10 per replica)")
    capped = decide(replace(ZERO, max_replicas=3), at_zero(held_requests=45.0), AutoscalerState())
    assert (capped.desired_replicas, capped.limited_by) == (3, "maxReplicas")
    percent = replace(ZERO, behavior=Behavior(scale_up=ScalingRules(0, (ScalingPolicy("Percent", 400, 15),))))
    limited = decide(percent, at_zero(held_requests=45.0), AutoscalerState())
    assert (limited.desired_replicas, limited.limited_by) == (1, "scaleUpRate")
    latency_only = replace(ZERO, queue_depth_per_replica=None)
    assert decide(latency_only, at_zero(held_requests=45.0), AutoscalerState()).desired_replicas == 1
    # Requests still on a pod being removed (it was ready as the Deployment went to zero) are demand too.
    draining = decide(ZERO, at_zero(ready_replicas=1, reporting_replicas=1, queue_depth=2.0), AutoscalerState())
    assert draining.desired_replicas == 1 and draining.reason.startswith("2 requests on pods being removed")


def test_at_zero_without_demand_it_stays_and_says_what_it_read() -> None:
    d = decide(ZERO, at_zero(routers_reporting=2), AutoscalerState(idle_since=NOW - 90))
    assert (d.desired_replicas, d.limited_by, d.reason) == (
        0, "none", "scaled to zero: nothing held at 2 routers; keeping 0")
    assert d.state == AutoscalerState((Recommendation(NOW, 0),))  # no idle stretch, no trend across the gap
    failing = decide(ZERO, at_zero(routers_failing=1), AutoscalerState())
    assert failing.reason == ("scaled to zero: nothing held at 1 router; 1 router could not be read, so requests "
                              "held there are not seen; keeping 0")
    alone = decide(ZERO, at_zero(routers_reporting=0), AutoscalerState())
    assert (alone.desired_replicas, alone.limited_by) == (0, "noRouter")
    raised = decide(replace(ZERO, min_replicas=2), at_zero(), AutoscalerState())
    assert (raised.desired_replicas, raised.limited_by) == (2, "minReplicas")


def test_the_idle_stretch_survives_the_state_round_trip() -> None:
    d = decide(ZERO, idle(), EXPIRED)
    assert AutoscalerState.from_dict(d.state.to_dict()) == d.state and d.state.to_dict()["idleSince"] == NOW


def test_min_replicas_zero_is_valid_in_every_mode_and_the_window_must_cover_a_round() -> None:
    for mode, extra in (("builtin", {"targets": {"queueDepthPerReplica": 4}}), ("external", {}), ("off", {})):
        a = AutoscalingSpec.model_validate({"mode": mode, "minReplicas": 0, "maxReplicas": 3, **extra})
        assert (a.min_replicas, a.scale_to_zero_after_seconds) == (0, 300)
    assert policy(AutoscalingSpec.model_validate({
        "mode": "builtin", "minReplicas": 0, "scaleToZeroAfterSeconds": 45,
        "targets": {"queueDepthPerReplica": 4}})).scale_to_zero_after_seconds == 45
    with pytest.raises(ValidationError, match="scaleToZeroAfterSeconds must be >= intervalSeconds"):
        AutoscalingSpec.model_validate({"minReplicas": 0, "intervalSeconds": 60, "scaleToZeroAfterSeconds": 30})
    # The window only matters at minReplicas 0: a long interval stays valid beside the default window.
    assert AutoscalingSpec.model_validate({"intervalSeconds": 600}).scale_to_zero_after_seconds == 300
    with pytest.raises(ValidationError, match="greater than or equal to 10"):
        AutoscalingSpec.model_validate({"minReplicas": 0, "intervalSeconds": 5, "scaleToZeroAfterSeconds": 5})


def deployment_replicas(spec: dict[str, Any], live: int | None) -> int:
    body = {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "m", "namespace": "ns", "uid": "u1", "generation": 1}, "spec": spec}
    children: dict[Any, Any] = {key: None for key in child_keys("m")}
    if live is not None:
        children["Deployment", "m"] = {"kind": "Deployment", "spec": {"replicas": live}, "metadata": {
            "name": "m", "namespace": "ns", "uid": "d1", "ownerReferences": [{
                "apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceDeployment", "name": "m",
                "uid": "u1", "controller": True}]}}
    return make_plan(body, children, OperatorConfig(), None).desired


def test_the_reconcile_creates_one_replica_then_keeps_the_autoscalers_zero() -> None:
    spec = {"model": {"name": "m", "source": {"pvc": {"claimName": "c"}}},
            "autoscaling": {"mode": "builtin", "minReplicas": 0, "maxReplicas": 4,
                            "targets": {"queueDepthPerReplica": 4}}}
    assert deployment_replicas(spec, None) == 1  # shows the spec serves; the idle window then takes it to zero
    assert deployment_replicas(spec, 0) == 0  # the resync does not undo a scale to zero
    external = {**spec, "replicas": 0, "autoscaling": {"mode": "external", "minReplicas": 0, "maxReplicas": 4}}
    assert deployment_replicas(external, None) == 0  # an HPA/KEDA (or the user) owns spec.replicas there
