"""decide(): the queue rule's request-rate trend, and what keeps a scale-down from flapping, numbers worked by hand."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from kvfleet_operator.autoscaling.decide import (
    AutoscalerState,
    AutoscalingPolicy,
    LatencyTarget,
    Observation,
    Recommendation,
    ScaleEvent,
    decide,
)

NOW = 1000.0
QUEUE = AutoscalingPolicy(min_replicas=1, max_replicas=20, queue_depth_per_replica=10)
BOTH = replace(QUEUE, latency_targets=(LatencyTarget("ttft", 95, 0.5),))


def obs(**kw: Any) -> Observation:
    base: dict[str, Any] = dict(now=NOW, current_replicas=4, ready_replicas=4, starting_replicas=0,
                                reporting_replicas=4)
    return Observation(**(base | kw))


def rate_line(per_min: float, ready: int = 8, samples: tuple[tuple[float, float], ...] | None = None
              ) -> AutoscalerState:
    """Request-rate samples every 15 s over the last 5 minutes, on a line through 40 requests/s now that moves
    `per_min` of that per minute (or the given samples); recommendations expired."""
    rates = samples or tuple((NOW - 15 * i, 40.0 * (1 - per_min * i / 4)) for i in range(20, 0, -1))
    return AutoscalerState(recommendations=(Recommendation(0.0, ready),), rates=rates)


# 8 ready at target 10: a depth of 50.7 is a load of 8 × (50.7 / 80)^(2/3) = 5.90 replicas at target.
FALL_OBS = dict(current_replicas=8, ready_replicas=8, reporting_replicas=8, queue_depth=50.7, request_rate=40.0)


def test_without_a_trend_scale_down_keeps_the_hysteresis() -> None:
    # 5.90 / 0.9^(2/3) = 6.33 → 7.
    assert decide(QUEUE, obs(**FALL_OBS), AutoscalerState(recommendations=(Recommendation(0.0, 8),))
                  ).desired_replicas == 7


def test_a_steady_fall_is_sized_for_the_end_of_the_scale_down_window() -> None:
    # The rate falls 5% of 40/s a minute: in 300 s it is 30/s, 0.75 of now, so the load will be 5.90 × 0.75 =
    # 4.43 → 5; the load now (5.90 → 6) is the floor. Without the trend the window would release 7 only five
    # minutes from now.
    d = decide(QUEUE, obs(**FALL_OBS), rate_line(-0.05))
    assert (d.desired_replicas, d.limited_by) == (6, "none")



def test_a_fall_the_line_does_not_describe_is_not_projected() -> None:
    """A noisy load at the bottom of a cycle: the line through its last 5 minutes still falls significantly, but the
    samples scatter around it by a third of its level (a curve that has turned, not a line). Projecting it to the
    window's end sized the fleet for a trough the load was already leaving: the simulator's sinusoid scaled down
    there and back up within 5 minutes, a flap every cycle. The hysteresis alone decides (7, as without a trend)."""
    level = [1.6 * (42.5 - 17.5 * math.cos(2 * math.pi * i / 40)) for i in range(20, 40)]  # peak to trough
    samples = tuple((NOW - 15 * (20 - j), v * (1.15 if j % 2 else 0.85)) for j, v in enumerate(level))
    d = decide(QUEUE, obs(**FALL_OBS), rate_line(0, samples=samples))
    assert (d.desired_replicas, "falling" in d.reason) == (7, False)


def test_a_steep_fall_never_goes_below_what_the_load_now_needs() -> None:
    # The rate would be below zero in 300 s; the newest load, 5.90, still needs 6.
    assert decide(QUEUE, obs(**FALL_OBS), rate_line(-0.5)).desired_replicas == 6


def test_a_newest_rate_above_a_fitting_line_is_noise_and_does_not_hold_the_floor() -> None:
    # The same steep fall, but this round's rate reads 56/s: the fit through it is level 42.84, spread 3.33
    # (8% of the level: the line fits), so the load now is 5.90 × 42.84 / 56 = 4.51 → 5, not 6.
    d = decide(QUEUE, obs(**(FALL_OBS | dict(request_rate=56.0))), rate_line(-0.5))
    assert d.desired_replicas == 5
    # A step from 80/s to 40/s is significant too, but a line through two plateaus does not fit them (spread
    # 35% of the level): it is not projected at all, and the newest load with the hysteresis decides (7, as
    # without a trend).
    step = tuple((NOW - 15 * i, 80.0 if i > 10 else 40.0) for i in range(20, 0, -1))
    assert decide(QUEUE, obs(**(FALL_OBS | dict(request_rate=56.0))), rate_line(0, samples=step)
                  ).desired_replicas == 7


def test_a_rise_or_a_noisy_flat_rate_is_not_a_fall() -> None:
    assert decide(QUEUE, obs(**FALL_OBS), rate_line(0.05)).desired_replicas == 7
    flat = rate_line(0.0)
    noisy = replace(flat, rates=tuple((t, x + (8.0 if i % 2 else -8.0)) for i, (t, x) in enumerate(flat.rates)))
    assert decide(QUEUE, obs(**FALL_OBS), noisy).desired_replicas == 7


# 4 ready at target 10 holding 43.5: ratio 1.0875, inside the 10% tolerance; a load of 4 × 1.0875^(2/3) = 4.23.
RISE_OBS = dict(queue_depth=43.5, queue_depth_mean=43.5, request_rate=40.0)


def test_a_significant_rise_sizes_for_the_next_round_past_the_tolerance() -> None:
    # The rate rises 20% of 40/s a minute: at the next round (15 s) it is 42/s, so the load is 4.23 × 42 / 40 =
    # 4.44, past the tolerance of 4 replicas (4 × 1.1^(2/3) = 4.26): up to 5 instead of holding.
    assert decide(QUEUE, obs(**RISE_OBS), rate_line(0.0)).limited_by == "tolerance"
    d = decide(QUEUE, obs(**RISE_OBS), rate_line(0.2, ready=4))
    assert (d.desired_replicas, d.limited_by) == (5, "none")
    # A gentle rise (5%/min: 4.23 × 40.5 / 40 = 4.28) that stays within the tolerance holds.
    assert decide(QUEUE, obs(**(RISE_OBS | dict(queue_depth=42.0, queue_depth_mean=42.0))),
                  rate_line(0.05, ready=4)).desired_replicas == 4


def test_the_state_carries_rate_samples_for_the_trend() -> None:
    d = decide(QUEUE, obs(**FALL_OBS), rate_line(-0.05))
    assert d.state.rates[-1] == (NOW, 40.0) and len(d.state.rates) == 21
    assert AutoscalerState.from_dict(d.state.to_dict()) == d.state
    later = decide(QUEUE, obs(**FALL_OBS, now=NOW + 590), d.state)  # samples older than 600 s are dropped
    assert [t for t, _ in later.state.rates] == [t for t, _ in d.state.rates if t > NOW - 10] + [NOW + 590]
    # A pod that did not report: the fleet's rate is unknown, so no sample (and never down on partial data).
    partial = decide(QUEUE, obs(**(FALL_OBS | dict(reporting_replicas=7))), d.state)
    assert partial.state.rates == d.state.rates and partial.desired_replicas == 8


def after_scale_down(seconds_ago: float) -> AutoscalerState:
    return AutoscalerState(recommendations=(Recommendation(0.0, 4),),
                           scale_events=(ScaleEvent(NOW - seconds_ago, -1),))


def test_a_scale_down_leaves_the_headroom_that_keeps_the_same_load_from_bringing_it_back() -> None:
    # No timed ban on scaling back up after a scale-down: the scale-down itself is sized not to flap. 5 holding
    # 30 is 0.6 of target each: down to where each would hold 0.9, ceil(5 × (0.6 / 0.9)^(2/3)) = ceil(3.82) = 4.
    five = dict(current_replicas=5, ready_replicas=5, reporting_replicas=5)
    d = decide(QUEUE, obs(**five, queue_depth=30), AutoscalerState(recommendations=(Recommendation(0.0, 5),)))
    assert d.desired_replicas == 4 and d.state.scale_events == (ScaleEvent(NOW, -1),)
    # The same load on the 4 left: depth ∝ load^1.5, so each holds 0.6 × (5/4)^1.5 = 0.84 of target, 33.5 in
    # all: ratio 0.84, under the target, so a minute later it stays at 4 (no flap).
    again = decide(QUEUE, obs(now=NOW + 60, queue_depth=33.5), d.state)
    assert (again.desired_replicas, again.proposals[0].replicas) == (4, 4)
    assert again.state.scale_events == (ScaleEvent(NOW, -1),)
    # A real rise a minute after a scale-down scales up at once: ratio 1.2 (48 over 4 × 10) asks for
    # ceil(4 × 1.2^(2/3)) = ceil(4.52) = 5 (the old rule held it for the rest of the scale-down window).
    up = decide(QUEUE, obs(queue_depth=48), after_scale_down(60))
    assert (up.desired_replicas, up.limited_by) == (5, "none")
    assert decide(BOTH, obs(queue_depth=48, latency={"ttft_p95": 0.52}), after_scale_down(60)
                  ).desired_replicas == 5
    # Within the tolerance it holds, scale-down or not: 43 over 40 is 1.075.
    assert decide(QUEUE, obs(queue_depth=43), after_scale_down(60)).limited_by == "tolerance"


def test_scale_downs_are_remembered_for_the_scale_down_window() -> None:
    d = decide(QUEUE, obs(current_replicas=8, ready_replicas=8, reporting_replicas=8, queue_depth=8),
               AutoscalerState(recommendations=(Recommendation(0.0, 8),)))
    assert d.desired_replicas == 4 and d.state.scale_events == (ScaleEvent(NOW, -4),)
    later = decide(QUEUE, obs(now=NOW + 299, queue_depth=40), d.state)
    assert later.state.scale_events == (ScaleEvent(NOW, -4),)
    assert decide(QUEUE, obs(now=NOW + 300, queue_depth=40), d.state).state.scale_events == ()


# votes._queue_vote lost the trend notes the queue rule had before the capacity model (decide._proposals wrote
# them into Votes.trend_note): the numbers above still follow the trend, but the reason no longer says why.


def test_a_fall_sized_by_the_trend_says_so() -> None:
    d = decide(QUEUE, obs(**FALL_OBS), rate_line(-0.05))
    assert d.reason.endswith("(request rate falling 5%/min: sized for the end of the 300s scale-down window)")


def test_a_rise_sized_by_the_trend_says_so() -> None:
    d = decide(QUEUE, obs(**RISE_OBS), rate_line(0.2, ready=4))
    assert d.reason.endswith("(request rate rising 20%/min: sized for the next round's load)")
