"""decide(): one test per rule, with the numbers worked by hand."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

import pytest

from kvfleet_operator.autoscaling.decide import (
    AutoscalerState,
    AutoscalingPolicy,
    Behavior,
    Decision,
    LatencyTarget,
    Observation,
    Proposal,
    Recommendation,
    ScaleEvent,
    ScalingPolicy,
    ScalingRules,
    decide,
)

NOW = 1000.0
TTFT = LatencyTarget("ttft", 95, 0.5)
QUEUE = AutoscalingPolicy(min_replicas=1, max_replicas=20, queue_depth_per_replica=10)
LATENCY = AutoscalingPolicy(min_replicas=1, max_replicas=20, latency_targets=(TTFT,))
EXPIRED = AutoscalerState(recommendations=(Recommendation(0.0, 1),))  # windows long past: nothing held


def obs(**kw: Any) -> Observation:
    base: dict[str, Any] = dict(now=NOW, current_replicas=4, ready_replicas=4, starting_replicas=0,
                                reporting_replicas=4)
    return Observation(**(base | kw))


def ttft(seconds: float | None) -> dict[str, float | None]:
    return {"ttft_p95": seconds}


def test_queue_proposal_assumes_depth_grows_faster_than_load() -> None:
    d = decide(QUEUE, obs(queue_depth=80), EXPIRED)
    # 2.0 per replica of target; depth ∝ load^1.5, so ceil(4 × 2^(2/3)) = ceil(4 × 1.587) = ceil(6.35) = 7.
    assert d.proposals == (Proposal("queue", 80, 10, 7),)
    assert (d.desired_replicas, d.limited_by) == (7, "none")
    assert d.reason == "queue depth 80 at target 10 per replica with 4 ready: proposing 7; scaling to 7"


def test_tolerance_holds_small_deviations() -> None:
    d = decide(QUEUE, obs(queue_depth=42), EXPIRED)  # ratio 1.05: ceil(4 × 1.05^(2/3)) = 5, but within 10%
    assert (d.desired_replicas, d.limited_by) == (4, "tolerance")
    assert "within tolerance 10%, keeping 4" in d.reason


def test_scale_down_leaves_headroom_against_flapping() -> None:
    # 0.2 per replica: down to where each holds at most 0.9: ceil(4 × (0.2 / 0.9)^(2/3)) = ceil(1.47) = 2.
    assert decide(QUEUE, obs(queue_depth=8), EXPIRED).desired_replicas == 2
    # 0.75 per replica: ceil(4 × (0.75 / 0.9)^(2/3)) = ceil(4 × 0.886) = ceil(3.54) = 4: a linear HPA would
    # go to 3 and have each replica at 1.0 × 4/3 ^ 1.5 = 1.54 of target, then scale back up.
    d = decide(QUEUE, obs(queue_depth=30), EXPIRED)
    assert (d.desired_replicas, d.limited_by) == (4, "none")


def test_queue_moves_only_when_newest_and_window_mean_agree() -> None:
    # Newest 80 (2.0 per replica) but the window's mean 42 (1.05): a spike, not yet a trend: hold.
    assert decide(QUEUE, obs(queue_depth=80, queue_depth_mean=42), EXPIRED).desired_replicas == 4
    # Both over target: up on the lower, 60 (1.5): ceil(4 × 1.5^(2/3)) = ceil(4 × 1.310) = 6.
    up = decide(QUEUE, obs(queue_depth=80, queue_depth_mean=60), EXPIRED)
    assert (up.desired_replicas, up.proposals[0].observed) == (6, 60)
    # Both under: down on the higher, 8 (0.2): 2, as in the test above; the newest 2 alone would give 1.
    down = decide(QUEUE, obs(queue_depth=2, queue_depth_mean=8), EXPIRED)
    assert (down.desired_replicas, down.proposals[0].observed) == (2, 8)


def test_scale_down_stabilization_keeps_the_highest_recent_recommendation() -> None:
    first = decide(QUEUE, obs(queue_depth=8), AutoscalerState())  # the window starts with the current count
    assert (first.desired_replicas, first.limited_by) == (4, "scaleDownStabilization")
    assert first.reason.endswith("held at 4 by the 300s scale-down stabilization window")
    at_299 = decide(QUEUE, obs(now=NOW + 299, queue_depth=8), first.state)
    assert at_299.desired_replicas == 4
    at_300 = decide(QUEUE, obs(now=NOW + 300, queue_depth=8), first.state)  # the seed at NOW is out: (t-300, t]
    assert at_300.desired_replicas == 2


def test_scale_down_rate_halves_at_most_per_period() -> None:
    d = decide(QUEUE, obs(current_replicas=10, ready_replicas=10, reporting_replicas=10, queue_depth=0), EXPIRED)
    assert (d.desired_replicas, d.limited_by) == (5, "scaleDownRate")
    assert "limited to 5 by scale-down rate (-50% per 15s)" in d.reason


def test_scale_up_rate_and_the_reason_sentence() -> None:
    double = Behavior(scale_up=ScalingRules(0, (ScalingPolicy("Percent", 100, 15),)))
    policy = replace(LATENCY, behavior=double)
    d = decide(policy, obs(current_replicas=2, ready_replicas=2, reporting_replicas=2, latency=ttft(1.8)), EXPIRED)
    # ceil(2 ready × 1.8 / 0.5) = ceil(7.2) = 8; doubling allows 4.
    assert (d.desired_replicas, d.limited_by) == (4, "scaleUpRate")
    assert d.reason == ("ttft p95 1.8s > target 0.5s with 2 ready: proposing 8; limited to 4 by scale-up rate "
                        "(+100% per 15s)")
    assert d.state.scale_events == (ScaleEvent(NOW, 2),)


def test_rate_limits_count_changes_already_made_in_the_period() -> None:
    hpa_up = Behavior(scale_up=ScalingRules(0, (ScalingPolicy("Percent", 100, 15), ScalingPolicy("Pods", 4, 15))))
    policy = replace(LATENCY, behavior=hpa_up)
    state = replace(EXPIRED, scale_events=(ScaleEvent(NOW - 10, 4),))
    # Now 6, 2 at the period's start: max(2 × 2, 2 + 4) = 6 allowed, so nothing more until the event ages out.
    d = decide(policy, obs(current_replicas=6, ready_replicas=6, reporting_replicas=6, latency=ttft(5.0)), state)
    assert (d.desired_replicas, d.limited_by) == (6, "scaleUpRate")
    later = decide(policy, obs(now=NOW + 6, current_replicas=6, ready_replicas=6, reporting_replicas=6,
                               latency=ttft(5.0)), state)
    assert later.desired_replicas == 12  # event out of the 15 s period: max(6 × 2, 6 + 4) = 12


@pytest.mark.parametrize(("select", "expected"), [("Max", 6), ("Min", 4), ("Disabled", 2)])
def test_select_policy(select: Literal["Max", "Min", "Disabled"], expected: int) -> None:
    rules = ScalingRules(0, (ScalingPolicy("Percent", 100, 15), ScalingPolicy("Pods", 4, 15)), select)
    policy = replace(LATENCY, behavior=Behavior(scale_up=rules))
    d = decide(policy, obs(current_replicas=2, ready_replicas=2, reporting_replicas=2, latency=ttft(5.0)), EXPIRED)
    assert d.desired_replicas == expected


def test_scale_up_stabilization_takes_the_lowest_recent_recommendation() -> None:
    policy = replace(LATENCY, behavior=Behavior(scale_up=ScalingRules(60, (ScalingPolicy("Pods", 10, 15),))))
    state = AutoscalerState(recommendations=(Recommendation(NOW - 30, 3),))
    d = decide(policy, obs(current_replicas=2, ready_replicas=2, reporting_replicas=2, latency=ttft(2.0)), state)
    assert (d.desired_replicas, d.limited_by) == (3, "scaleUpStabilization")  # proposal 8, lowest in 60 s is 3


def test_cold_start_counts_starting_replicas_as_capacity_on_the_way() -> None:
    state = replace(EXPIRED, startup_durations=(80.0, 90.0, 100.0))
    d = decide(LATENCY, obs(current_replicas=8, ready_replicas=2, starting_replicas=6, reporting_replicas=2,
                            latency=ttft(1.5)), state)
    # ceil(2 × 1.5 / 0.5) = 6 <= 8 that exist: the same demand does not add pods while they load.
    assert (d.desired_replicas, d.limited_by) == (8, "none")
    assert d.expected_startup_seconds == 90.0
    assert "proposing 6, covered by the 6 starting, expected ready in ~90s; keeping 8" in d.reason


def test_latency_waits_for_replicas_on_their_way_unless_the_queue_agrees() -> None:
    both = replace(QUEUE, latency_targets=(TTFT,))
    loading = obs(current_replicas=6, ready_replicas=2, starting_replicas=4, reporting_replicas=2, latency=ttft(5.0))
    # Latency asks ceil(2 × 5.0 / 0.5) = 20. The 2 ready hold 60, 3.0 each of target; with all 6 serving that is
    # 3.0 × (2/6)^1.5 = 0.58 each: those on the way suffice, so latency holds (the queue alone would say 5).
    assert decide(both, replace(loading, queue_depth=60), EXPIRED).desired_replicas == 6
    # 200 held is 10 each, 10 × 0.19 = 1.9 once all serve: the queue agrees capacity is short, latency's 20 wins.
    assert decide(both, replace(loading, queue_depth=200), EXPIRED).desired_replicas == 20


def test_starting_replicas_past_the_grace_are_replaced() -> None:
    policy = replace(LATENCY, startup_grace_seconds=300)
    o = obs(current_replicas=4, ready_replicas=2, starting_replicas=2, reporting_replicas=2,
            starting_ages=(1000.0, 10.0), latency=ttft(1.0))
    d = decide(policy, o, EXPIRED)
    # Proposal ceil(2 × 2) = 4 > 3 really on the way, plus the stuck one: 5.
    assert d.desired_replicas == 5
    assert "1 starting for over 300s no longer count" in d.reason
    learned = replace(EXPIRED, startup_durations=(100.0,))  # no grace set: twice the expected 100 s
    assert decide(LATENCY, o, learned).desired_replicas == 5
    assert decide(LATENCY, o, EXPIRED).desired_replicas == 4  # nothing learned yet: every pod is on its way


def test_expected_startup_is_the_median_of_the_last_ten() -> None:
    state = replace(EXPIRED, startup_durations=tuple(float(x) for x in range(1, 10)))
    d = decide(QUEUE, obs(queue_depth=40, new_startup_durations=(100.0, 200.0)), state)
    assert d.state.startup_durations == (2, 3, 4, 5, 6, 7, 8, 9, 100, 200)
    assert d.expected_startup_seconds == 6.5


def test_partial_metrics_never_scale_down_but_may_scale_up() -> None:
    down = decide(QUEUE, obs(reporting_replicas=3, queue_depth=6), EXPIRED)
    assert (down.desired_replicas, down.limited_by) == (4, "partialMetrics")
    assert "only 3 of 4 ready pods reported metrics" in down.reason
    # Up on what is seen: 80 over 3 reporting is 2.667 each; ceil(4 × 2.667^(2/3)) = ceil(4 × 1.923) = 8.
    assert decide(QUEUE, obs(reporting_replicas=3, queue_depth=80), EXPIRED).desired_replicas == 8


def test_no_metrics_keeps_the_count() -> None:
    d = decide(replace(QUEUE, latency_targets=(TTFT,)), obs(reporting_replicas=0, latency=ttft(None)), EXPIRED)
    assert (d.desired_replicas, d.limited_by, d.proposals) == (4, "noMetrics", ())


def test_unschedulable_pods_block_scale_up_not_scale_down() -> None:
    up = decide(QUEUE, obs(current_replicas=5, starting_replicas=1, unschedulable_replicas=1, queue_depth=80),
                EXPIRED)
    assert (up.desired_replicas, up.limited_by) == (5, "capacityBlocked")
    down = decide(QUEUE, obs(current_replicas=5, starting_replicas=1, unschedulable_replicas=1, queue_depth=8),
                  EXPIRED)
    assert down.desired_replicas < 5


def test_min_and_max_win_over_everything() -> None:
    assert decide(replace(QUEUE, max_replicas=5), obs(queue_depth=80), EXPIRED).limited_by == "maxReplicas"
    low = decide(replace(QUEUE, min_replicas=3), obs(current_replicas=1, ready_replicas=1, reporting_replicas=1,
                                                     queue_depth=0), EXPIRED)
    assert (low.desired_replicas, low.limited_by) == (3, "minReplicas")
    partial = obs(current_replicas=8, ready_replicas=8, reporting_replicas=2, queue_depth=0)
    assert decide(replace(QUEUE, max_replicas=5), partial, EXPIRED).desired_replicas == 5  # the user's bound


@pytest.mark.parametrize("mode", ["external", "off"])
def test_only_builtin_mode_decides(mode: Literal["external", "off"]) -> None:
    with pytest.raises(ValueError, match="builtin"):
        decide(replace(QUEUE, mode=mode), obs(queue_depth=8), EXPIRED)


def test_latency_alone_steps_down_one_replica_at_a_time() -> None:
    d = decide(LATENCY, obs(latency=ttft(0.1)), EXPIRED)  # ceil(4 × 0.2) = 1, but latency is flat: 3
    assert (d.proposals[0].replicas, d.desired_replicas) == (1, 3)


def test_latency_under_target_leaves_scale_down_to_the_queue_and_near_target_holds() -> None:
    both = replace(QUEUE, latency_targets=(TTFT,))
    assert decide(both, obs(queue_depth=8, latency=ttft(0.1)), EXPIRED).desired_replicas == 2
    near = decide(both, obs(queue_depth=8, latency=ttft(0.52)), EXPIRED)  # within 10% of the target: hold
    assert (near.desired_replicas, near.limited_by) == (4, "tolerance")


def test_state_round_trips_and_status_is_camel_case() -> None:
    d: Decision = decide(QUEUE, obs(queue_depth=80), AutoscalerState())
    assert AutoscalerState.from_dict(d.state.to_dict()) == d.state
    status = d.status()
    assert status["desiredReplicas"] == 7 and status["limitedBy"] == "none"
    assert status["proposals"] == [{"source": "queue", "observed": 80, "target": 10, "replicas": 7}]
    later = decide(QUEUE, obs(now=NOW + 1000, current_replicas=7, ready_replicas=7, reporting_replicas=7,
                              queue_depth=70), d.state)
    assert [r.time for r in later.state.recommendations] == [NOW + 1000]  # older than every window: dropped
    assert later.state.scale_events == ()
