"""decide(): one test per rule, with the numbers worked by hand."""

from __future__ import annotations

import math
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
from kvfleet_operator.autoscaling.votes import LATENCY_STEP_MAX

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
    quarter = Behavior(scale_up=ScalingRules(0, (ScalingPolicy("Percent", 25, 15),)))
    policy = replace(LATENCY, behavior=quarter)
    d = decide(policy, obs(latency=ttft(1.8)), EXPIRED)
    # 1.8 / 0.5 = 3.6 times the target, but latency is a hockey stick near saturation: at most LATENCY_STEP_MAX
    # times the ready replicas, ceil(4 × 1.5) = 6 (not ceil(4 × 3.6) = 15); +25% allows ceil(4 × 1.25) = 5.
    assert d.proposals == (Proposal("ttft_p95", 1.8, 0.5, math.ceil(4 * LATENCY_STEP_MAX)),)
    assert (d.desired_replicas, d.limited_by) == (5, "scaleUpRate")
    assert d.reason == (f"ttft p95 1.8s > target 0.5s with 4 ready: proposing {math.ceil(4 * LATENCY_STEP_MAX)}; "
                        "limited to 5 by scale-up rate (+25% per 15s)")
    assert d.state.scale_events == (ScaleEvent(NOW, 1),)


def test_rate_limits_count_changes_already_made_in_the_period() -> None:
    hpa_up = Behavior(scale_up=ScalingRules(0, (ScalingPolicy("Percent", 100, 15), ScalingPolicy("Pods", 4, 15))))
    policy = replace(QUEUE, behavior=hpa_up)
    state = replace(EXPIRED, scale_events=(ScaleEvent(NOW - 10, 4),))
    # 600 held by 6 is 10 per replica of target: ceil(6 × 10^(2/3)) = ceil(6 × 4.642) = ceil(27.85) = 28.
    six = dict(current_replicas=6, ready_replicas=6, reporting_replicas=6, queue_depth=600)
    # Now 6, 2 at the period's start: max(2 × 2, 2 + 4) = 6 allowed, so nothing more until the event ages out.
    d = decide(policy, obs(**six), state)
    assert (d.proposals[0].replicas, d.desired_replicas, d.limited_by) == (28, 6, "scaleUpRate")
    later = decide(policy, obs(now=NOW + 6, **six), state)
    # The event is out of the 15 s period: max(6 × 2, 6 + 4) = 12.
    assert (later.desired_replicas, later.limited_by) == (12, "scaleUpRate")


@pytest.mark.parametrize(("select", "expected"), [("Max", 6), ("Min", 4), ("Disabled", 2)])
def test_select_policy(select: Literal["Max", "Min", "Disabled"], expected: int) -> None:
    rules = ScalingRules(0, (ScalingPolicy("Percent", 100, 15), ScalingPolicy("Pods", 4, 15)), select)
    policy = replace(QUEUE, behavior=Behavior(scale_up=rules))
    # 200 held by 2 is 10 per replica of target: ceil(2 × 10^(2/3)) = ceil(9.28) = 10; the policies allow
    # 2 × 2 = 4 (Percent) and 2 + 4 = 6 (Pods).
    d = decide(policy, obs(current_replicas=2, ready_replicas=2, reporting_replicas=2, queue_depth=200), EXPIRED)
    assert (d.proposals[0].replicas, d.desired_replicas) == (10, expected)


def test_scale_up_stabilization_takes_the_lowest_recent_recommendation() -> None:
    policy = replace(LATENCY, behavior=Behavior(scale_up=ScalingRules(60, (ScalingPolicy("Pods", 10, 15),))))
    state = AutoscalerState(recommendations=(Recommendation(NOW - 30, 5),))
    d = decide(policy, obs(latency=ttft(2.0)), state)
    # Proposal ceil(4 × min(2.0 / 0.5, 1.5)) = 6; the lowest recommendation in the last 60 s is 5.
    assert (d.proposals[0].replicas, d.desired_replicas, d.limited_by) == (6, 5, "scaleUpStabilization")
    assert d.reason.endswith("held at 5 by the 60s scale-up stabilization window")


def test_cold_start_counts_starting_replicas_as_capacity_on_the_way() -> None:
    state = replace(EXPIRED, startup_durations=(80.0, 90.0, 100.0))
    d = decide(LATENCY, obs(current_replicas=8, ready_replicas=2, starting_replicas=6, reporting_replicas=2,
                            latency=ttft(1.5)), state)
    # ceil(2 × min(1.5 / 0.5, 1.5)) = 3 <= 8 that exist: the same demand does not add pods while they load.
    assert (d.desired_replicas, d.limited_by) == (8, "none")
    assert d.expected_startup_seconds == 90.0
    assert "proposing 3, covered by the 6 starting, expected ready in ~90s; keeping 8" in d.reason


def test_latency_waits_for_replicas_on_their_way_and_the_queue_sizes_the_rise() -> None:
    both = replace(QUEUE, latency_targets=(TTFT,))
    loading = obs(current_replicas=6, ready_replicas=2, starting_replicas=4, reporting_replicas=2, latency=ttft(5.0))
    # Latency shows ceil(2 × min(5.0 / 0.5, 1.5)) = 3, but with replicas on their way it only holds the count: the
    # latency of the 2 ready keeps growing while the others load. The 2 ready hold 60, 3.0 each of target; with
    # all 6 serving that is 3.0 × (2/6)^1.5 = 0.58 each, so the queue alone would go down to
    # ceil(2 × (3.0 / 0.9)^(2/3)) = ceil(4.46) = 5: latency's hold keeps 6.
    held = decide(both, replace(loading, queue_depth=60), EXPIRED)
    assert [(p.source, p.replicas) for p in held.proposals] == [("queue", 5), ("ttft_p95", 3)]
    assert held.desired_replicas == 6
    # 200 held is 10 each, 10 × 0.19 = 1.9 once all serve: capacity is short, and the queue sizes the rise,
    # ceil(2 × 10^(2/3)) = ceil(9.28) = 10 (the old linear latency vote asked ceil(2 × 10) = 20).
    up = decide(both, replace(loading, queue_depth=200), EXPIRED)
    assert [(p.source, p.replicas) for p in up.proposals] == [("queue", 10), ("ttft_p95", 3)]
    assert (up.desired_replicas, up.limited_by) == (10, "none")
    # Latency alone, asking more than exist (ceil(4 × min(1.0 / 0.5, 1.5)) = 6 > 5) while one is on its way: hold.
    one_more = obs(current_replicas=5, starting_replicas=1, starting_ages=(10.0,), latency=ttft(1.0))
    held_alone = decide(LATENCY, one_more, EXPIRED)
    assert (held_alone.proposals[0].replicas, held_alone.desired_replicas) == (6, 5)


def test_starting_replicas_past_the_grace_are_replaced() -> None:
    policy = replace(LATENCY, startup_grace_seconds=300)
    o = obs(current_replicas=6, ready_replicas=4, starting_replicas=2, starting_ages=(1000.0, 10.0), latency=ttft(1.0))
    d = decide(policy, o, EXPIRED)
    # Proposal ceil(4 × min(1.0 / 0.5, 1.5)) = 6 > 5 really on the way, plus the stuck one: 7.
    assert d.desired_replicas == 7
    assert "1 starting for over 300s no longer count" in d.reason
    learned = replace(EXPIRED, startup_durations=(100.0,))  # no grace set: twice the expected 100 s
    assert decide(LATENCY, o, learned).desired_replicas == 7
    # Nothing learned yet: the grace is the startup probe's budget, and 1000 s is within it: every pod is on its
    # way, and while they are, latency does not add.
    budget = LATENCY.startup_budget_seconds
    assert budget > 1000
    assert decide(LATENCY, o, EXPIRED).desired_replicas == 6
    stuck = decide(LATENCY, replace(o, starting_ages=(budget + 1, 10.0)), EXPIRED)
    assert stuck.desired_replicas == 7
    assert f"1 starting for over {budget:.0f}s no longer count" in stuck.reason


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


def test_unschedulable_pods_limit_scale_up_to_the_pending_budget_not_scale_down() -> None:
    pending = obs(current_replicas=5, starting_replicas=1, unschedulable_replicas=1, queue_depth=80)
    # 80 over 4 reporting is 2.0 of target each, 2.0 × (4/5)^1.5 = 1.43 once the fifth serves: up to
    # ceil(4 × 2^(2/3)) = 7. A node autoscaler provisions for Pending pods: with 1 unschedulable, the default
    # budget of 4 leaves room for 3 more, up to 8, so 7 goes through.
    assert QUEUE.unschedulable_budget == 4
    up = decide(QUEUE, pending, EXPIRED)
    assert (up.desired_replicas, up.limited_by) == (7, "none")
    # A budget of 2 leaves room for 1: 6, and the reason says why.
    tight = decide(replace(QUEUE, unschedulable_budget=2), pending, EXPIRED)
    assert (tight.desired_replicas, tight.limited_by) == (6, "capacityBlocked")
    assert tight.reason.endswith("limited to 6: 1 unschedulable pod, at most 2 pending at once")
    # At the budget (2 of 2 unschedulable) scale-up waits for them: 120 over 4 is 3.0 each, 3.0 × (4/6)^1.5 = 1.63
    # once all 6 serve, asking ceil(4 × 3^(2/3)) = 9, but no room is left.
    full = decide(replace(QUEUE, unschedulable_budget=2), obs(current_replicas=6, starting_replicas=2,
                                                              unschedulable_replicas=2, queue_depth=120), EXPIRED)
    assert (full.proposals[0].replicas, full.desired_replicas, full.limited_by) == (9, 6, "capacityBlocked")
    down = decide(QUEUE, replace(pending, queue_depth=8), EXPIRED)
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
    # Within 10% over the target: latency proposes the current 4 and holds it against the queue's 2.
    near = decide(both, obs(queue_depth=8, latency=ttft(0.52)), EXPIRED)
    assert [(p.source, p.replicas) for p in near.proposals] == [("queue", 2), ("ttft_p95", 4)]
    assert near.desired_replicas == 4


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


def test_latency_votes_only_on_complete_fresh_data() -> None:
    six = dict(current_replicas=6, ready_replicas=6, starting_replicas=0)
    # Every pod reporting: 0.9 / 0.5 = 1.8 over target, capped at LATENCY_STEP_MAX: ceil(6 × 1.5) = 9.
    fresh = decide(LATENCY, obs(**six, reporting_replicas=6, latency=ttft(0.9)), EXPIRED)
    assert fresh.desired_replicas == math.ceil(6 * LATENCY_STEP_MAX)
    # A metrics dropout: 0 of 6 pods reporting, the window still holding their last percentile. The old linear
    # vote scaled 6 → ceil(6 × 1.8) = 11 on it; now nothing votes.
    dropout = decide(LATENCY, obs(**six, reporting_replicas=0, latency=ttft(0.9)), EXPIRED)
    assert (dropout.desired_replicas, dropout.limited_by) == (6, "noMetrics")
    assert dropout.reason.startswith("no metrics from 6 ready (0 reporting)")
    # Partial (3 of 6): shown, but no vote either. The queue decides on what the 3 report: 30 over 3 is 1.0 of
    # its target each, ceil(6 × 1.0^(2/3)) = 6: keep.
    partial = decide(replace(QUEUE, latency_targets=(TTFT,)),
                     obs(**six, reporting_replicas=3, queue_depth=30, latency=ttft(0.9)), EXPIRED)
    assert [(p.source, p.replicas) for p in partial.proposals] == [("queue", 6), ("ttft_p95", 9)]
    assert (partial.desired_replicas, partial.limited_by) == (6, "none")
