"""decide() with the capacity model: demand in tokens/s against what one replica serves, with hand-worked numbers.

The replica of these tests: w = 4 ms per token alone, saturating at M = 1000 tokens/s, a fitted line. At the queue
target of 4 requests it serves s* = 4 / (0.004 + 4/1000) = 500 tokens/s, holding depth(s) = s·w / (1 - s/M)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest

from kvfleet_operator.autoscaling.capacity import PREFILL_BOUND_SHARE
from kvfleet_operator.autoscaling.decide import (
    AutoscalerState,
    AutoscalingPolicy,
    Decision,
    LatencyTarget,
    Observation,
    Proposal,
    Recommendation,
    decide,
)
from kvfleet_operator.autoscaling.decision import Capacity, Flow, Line
from kvfleet_operator.autoscaling.trend import trend
from kvfleet_operator.autoscaling.votes import DRAIN_S, MAX_MARGIN, NOISE_Z

NOW = 10_000.0
LINE = Line(0.004, 1000.0, True)
PER = 500.0  # tokens/s per replica at the queue target, on LINE
TAU = 300.0  # tokens per request (prompt 200 + output 100)
TTFT = LatencyTarget("ttft", 95, 0.5)
POLICY = AutoscalingPolicy(min_replicas=1, max_replicas=20, queue_depth_per_replica=4)
BOTH = replace(POLICY, latency_targets=(TTFT,))
LEARNED = AutoscalerState(recommendations=(Recommendation(0.0, 1),), capacity=Capacity(line=LINE))
AT_TARGET = 16.0  # 4 ready replicas each holding the queue target: no backlog


def up_to(load: float, policy: AutoscalingPolicy = POLICY) -> int:
    """The scale-up rule: to where `load` (replicas' worth of demand) fits with the tolerance as margin, as a
    scale-down must (the demand keeps moving while new replicas start)."""
    return math.ceil(load / (1 - policy.tolerance) - 1e-9)


def flow(tokens: float, pods: int, arrived: float | None = None) -> Flow:
    """`tokens` prompt + output tokens/s served through `pods` pods, TAU tokens a request; arrivals as completions
    unless given (requests/s)."""
    done = tokens / TAU
    return Flow(done, done if arrived is None else arrived, tokens * 2 / 3, tokens / 3, pods)


def obs(demand: float, ready: int = 4, current: int | None = None, **kw: Any) -> Observation:
    """A steady round: `demand` tokens/s arriving and served by `ready` replicas, each holding what LINE says."""
    current = ready if current is None else current
    base: dict[str, Any] = dict(now=NOW, current_replicas=current, ready_replicas=ready,
                                starting_replicas=current - ready, reporting_replicas=ready,
                                queue_depth=LINE.depth(demand / ready) * ready, flow=flow(demand, ready),
                                flow_last=flow(demand, ready))
    return Observation(**(base | kw))


def test_demand_above_capacity_scales_up_to_the_load_and_says_so() -> None:
    # 3150 tokens/s is 6.3 replicas' worth at 500 each: past 4 × 1.1, up to where it fits with the 10% margin,
    # ceil(6.3 / 0.9) = 7 (the queue rule on the same depth, 12 each of target 4 at 750 tokens/s, would ask
    # ceil(4 × 3^(2/3)) = 9).
    assert up_to(6.3) == 7
    d = decide(POLICY, obs(3150.0, queue_depth=AT_TARGET), LEARNED)  # no backlog: the demand alone sizes it
    assert d.proposals == (Proposal("capacity", 3150.0, PER, 7),)
    assert (d.desired_replicas, d.limited_by) == (7, "none")
    assert d.reason == ("demand 3,150 tokens/s against 500 tokens/s per replica at queue target 4 with 4 ready: "
                        "proposing 7; scaling to 7")


def test_demand_is_arrivals_not_what_was_served() -> None:
    # Saturated replicas serve 4 × 900 = 3600 tokens/s while 15 requests/s arrive (12 complete): the demand is
    # 15 × 300 = 4500 tokens/s, 9 replicas' worth: ceil(9 / 0.9) = 10; the served rate alone, 7.2 replicas'
    # worth, would say ceil(7.2 / 0.9) = 8.
    d = decide(POLICY, obs(3600.0, flow=flow(3600.0, 4, arrived=15.0), queue_depth=AT_TARGET), LEARNED)
    assert (d.proposals[0].observed, d.desired_replicas) == (4500.0, up_to(9.0)) == (4500.0, 10)
    # The panic window: the last interval's arrivals if higher (20/s: 6000 tokens/s, 12 replicas' worth, 14).
    d = decide(POLICY, obs(3600.0, flow=flow(3600.0, 4, arrived=15.0), flow_last=flow(3600.0, 4, arrived=20.0),
                           queue_depth=AT_TARGET), LEARNED)
    assert (d.proposals[0].observed, d.desired_replicas) == (6000.0, up_to(12.0)) == (6000.0, 14)
    # Requests held at a router count too, cleared within a round: 30 over 15 s is 2/s more, 600 tokens/s.
    held = decide(POLICY, obs(2000.0, held_requests=30.0), LEARNED)
    assert held.proposals[0].observed == pytest.approx(2600.0)
    assert "demand 2,600 tokens/s, 30 held at the router against" in held.reason


def test_scale_down_goes_only_to_where_the_load_fits_with_the_tolerance_as_margin() -> None:
    tol = POLICY.tolerance
    # 1000 tokens/s is 2.0 replicas' worth, but 2 would run at the target exactly: down to
    # ceil(2.0 / (1 - 0.1)) = ceil(2.22) = 3.
    d = decide(POLICY, obs(1000.0), LEARNED)
    assert d.proposals[0].replicas == math.ceil(2.0 / (1 - tol)) == 3
    assert (d.desired_replicas, d.limited_by) == (3, "none")
    # 1400 is 2.8 replicas' worth: 3 would be 93% busy, past the margin: ceil(2.8 / 0.9) = ceil(3.11) = 4, keep.
    assert decide(POLICY, obs(1400.0), LEARNED).desired_replicas == 4
    # 1300 is 2.6: ceil(2.6 / 0.9) = ceil(2.89) = 3.
    assert decide(POLICY, obs(1300.0), LEARNED).desired_replicas == 3
    # Within the tolerance up: 2150 is 4.3 replicas' worth, within 4 × 1.1; it holds.
    held = decide(POLICY, obs(2150.0), LEARNED)
    assert (held.desired_replicas, held.limited_by) == (4, "tolerance")


def rates_around(level: float, swing: float, n: int = 20) -> tuple[tuple[float, float], ...]:
    """Tokens/s samples every 15 s up to the last round, alternating level ± swing: noisy, no trend."""
    return tuple((NOW - 15 * i, level + (swing if i % 2 else -swing)) for i in range(n, 0, -1))


def test_a_noisy_demand_keeps_headroom_for_its_noise() -> None:
    # 6 replicas, 1300 tokens/s now (2.6 replicas' worth), the last 5 minutes swinging ±195 (15%) around 1300.
    rates = rates_around(1300.0, 195.0)
    sample = ((NOW - 15, 1300.0 / 6, LINE.depth(1300.0 / 6)),)  # the model already had samples: rates in tokens/s
    state = replace(LEARNED, rates=rates, capacity=Capacity(sample, LINE))
    tr = trend((*rates, (NOW, 1300.0)), NOW)
    assert tr is not None and not tr.significant
    margin = min(max(POLICY.tolerance, NOISE_Z * tr.spread / tr.level), MAX_MARGIN)
    assert margin > POLICY.tolerance  # the noise (about 15% of the level), not the tolerance, sets the margin
    d = decide(POLICY, obs(1300.0, ready=6), state)
    # With 2 standard deviations about 30%: ceil(2.6 / 0.7) = 4, where the tolerance alone gives 3.
    assert d.desired_replicas == math.ceil(2.6 / (1 - margin)) == 4
    assert d.reason.endswith(f"({margin:.0%} headroom for the demand's noise)")
    quiet = decide(POLICY, obs(1300.0, ready=6), replace(state, rates=rates_around(1300.0, 0.0)))
    assert quiet.desired_replicas == 3


def test_a_rising_demand_is_sized_ahead() -> None:
    # 2000 tokens/s is 4.0 replicas' worth, within 4 × 1.1; but it rose 48% of that a minute over the last
    # 2 minutes: by the next round (15 s; no startup learned to size further ahead) it is 2000 × 1.12 = 2240,
    # 4.48 replicas' worth, past 4.4: up to ceil(4.48 / 0.9) = ceil(4.98) = 5.
    rates = tuple((NOW - 15 * i, 2000.0 * (1 - 0.12 * i)) for i in range(8, 0, -1))
    sample = ((NOW - 15, 500.0, LINE.depth(500.0)),)  # the model already had samples: rates in tokens/s
    state = replace(LEARNED, rates=rates, capacity=Capacity(sample, LINE))
    assert decide(POLICY, obs(2000.0), replace(state, rates=())).limited_by == "tolerance"
    d = decide(POLICY, obs(2000.0), state)
    assert (d.desired_replicas, d.limited_by) == (up_to(4.48), "none") == (5, "none")
    assert "(demand rising 48%/min: sized for 15s ahead" in d.reason


def test_a_ripple_shorter_than_the_scale_down_window_never_flaps() -> None:
    # Two minutes at 2000 tokens/s (4 replicas' worth), two at 1000 (2), for 20 minutes: each peak's
    # recommendation holds the scale-down window, so the fleet never leaves 4, and so never comes back to it
    # (this replaced a timed ban on scaling up within the window after a scale-down).
    state, n, changes = replace(LEARNED, recommendations=(Recommendation(NOW - 1, 4),)), 4, []
    for i in range(80):
        d = decide(POLICY, obs(2000.0 if (i // 8) % 2 == 0 else 1000.0, ready=n, now=NOW + 15 * i), state)
        state, n = d.state, d.desired_replicas
        changes += [d.desired_replicas - d.current_replicas] if d.desired_replicas != d.current_replicas else []
    assert changes == [] and n == 4


def run(rounds: list[float], state: AutoscalerState, n: int, start: float = NOW) -> tuple[list[Decision], int]:
    out = []
    for i, demand in enumerate(rounds):
        d = decide(POLICY, obs(demand, ready=n, now=start + 15 * i), state)
        out.append(d)
        state, n = d.state, d.desired_replicas
    return out, n


def test_a_fall_scales_down_once_the_window_releases_it_and_a_small_rise_does_not_bring_it_back() -> None:
    # Ten rounds at 2000 tokens/s, then 1000 for 20 minutes, 1100 for 5, then 2000 again.
    rounds = [2000.0] * 10 + [1000.0] * 80 + [1100.0] * 20 + [2000.0] * 4
    ds, _ = run(rounds, replace(LEARNED, recommendations=(Recommendation(NOW - 1, 4),)), 4)
    downs = [i for i, d in enumerate(ds) if d.desired_replicas < d.current_replicas]
    ups = [i for i, d in enumerate(ds) if d.desired_replicas > d.current_replicas]
    # One scale-down, to ceil(2.0 / 0.9) = 3, no earlier than the 300 s window after the fall (round 10).
    assert len(downs) == 1 and ds[downs[0]].desired_replicas == 3
    assert (downs[0] - 10) * 15 >= POLICY.behavior.scale_down.stabilization_window_seconds
    assert downs[0] < 90
    # 1100 on 3 is 2.2 replicas' worth, within 3 × 1.1: no flap back up. Only the real rise to 2000 (4.0 > 3.3)
    # scales up, in its first round: ceil(4.0 / 0.9) = 5.
    assert ups == [110] and ds[110].desired_replicas == up_to(4.0) == 5


def queueing(demand: float = 1600.0, ready: int = 4, ttft: float = 0.9, wait: float = 0.3, **kw: Any) -> Observation:
    """A steady round at `demand` tokens/s with TTFT p95 `ttft` and the queue wait's p95 `wait`."""
    return obs(demand, ready, latency={"ttft_p95": ttft}, queue_time_p95=wait, **kw)


def test_a_prefill_bound_ttft_breach_adds_no_replica_and_says_so() -> None:
    # 1600 tokens/s is 3.2 replicas' worth (ceil(3.2 / 0.9) = 4: keep). TTFT p95 0.9 s is over its 0.5 s target,
    # but requests waited at most 0.06 s (under 25% of the target): the time goes to prefill, which more replicas
    # would not shorten.
    wait = PREFILL_BOUND_SHARE * TTFT.seconds / 2
    d = decide(BOTH, queueing(wait=wait), LEARNED)
    assert (d.desired_replicas, d.state.capacity.ceiling) == (4, None)
    assert d.reason.endswith(f"(ttft p95 0.9s over 0.5s is prefill-bound (queue wait p95 {wait:.3g}s): more "
                             "replicas would not lower it)")
    # The same without token counters (the queue rule): latency does not vote on it either.
    legacy = replace(queueing(wait=wait), flow=None, flow_last=None)
    bound = decide(replace(BOTH, queue_depth_per_replica=None), legacy, LEARNED)
    assert bound.desired_replicas == 4 and "prefill-bound" in bound.reason
    # Queueing-bound, the latency rule adds: ceil(4 × min(1.8, 1.5)) = 6.
    assert decide(replace(BOTH, queue_depth_per_replica=None), replace(legacy, queue_time_p95=0.3),
                  LEARNED).desired_replicas == 6


def test_a_queueing_bound_steady_breach_lowers_the_capacity_and_scales_up_at_once() -> None:
    # 1600 tokens/s, 400 per replica: within the 4 × 500 the model says 4 serve, yet TTFT p95 is 0.9 s over its
    # 0.5 s target and requests waited 0.3 s for it. The model was wrong: capacity at the SLO is below 400 per
    # replica. Ceiling 400, less the 10% margin twice: 324, so 1600 is 4.94 replicas' worth, past 4 × 1.1: up to
    # ceil(4.94 / 0.9) = 6.
    d = decide(BOTH, queueing(), LEARNED)
    assert d.state.capacity.ceiling == (NOW, 400.0)
    assert d.proposals[0] == Proposal("capacity", 1600.0, pytest.approx(324.0), 6)
    assert (d.desired_replicas, d.limited_by) == (6, "none")
    assert d.reason.endswith("(ttft p95 0.9s over 0.5s at 400 tokens/s per replica: capacity lowered below it)")
    # Next round on 6, TTFT back to 0.3 s (met), 267 per replica: below the ceiling, so it stays; 1600 / 324 =
    # 4.94, ceil(4.94 / 0.9) = 6: hold.
    after = decide(BOTH, queueing(ready=6, ttft=0.3, now=NOW + 15), d.state)
    assert (after.desired_replicas, after.state.capacity.ceiling) == (6, (NOW, 400.0))
    # The targets met at a load above the ceiling (2600 on 6, 433 each): it was too low, and is lifted.
    lifted = decide(BOTH, queueing(2600.0, ready=6, ttft=0.3, now=NOW + 30), after.state)
    assert lifted.state.capacity.ceiling is None


def test_a_breach_the_model_foresaw_or_measured_in_a_jump_does_not_lower_the_capacity() -> None:
    # Demand past what the ready replicas serve by the model (2400 > 4 × 500): the breach is the model's own
    # proposal to make: 4.8 replicas' worth, ceil(4.8 / 0.9) = 6, no ceiling.
    foreseen = decide(BOTH, queueing(2400.0), LEARNED)
    assert (foreseen.desired_replicas, foreseen.state.capacity.ceiling) == (up_to(4.8), None) == (6, None)
    # A jump (the last interval's arrivals 20% over the window's): the breach measures the jump, not capacity.
    jump = queueing(flow_last=flow(1600.0, 4, arrived=1600.0 / TAU * 1.2))
    d = decide(BOTH, jump, LEARNED)
    assert d.state.capacity.ceiling is None
    # (the jump's own demand, 1920 tokens/s = 3.84 replicas' worth, holds 4)
    assert d.desired_replicas == 4
    # A backlog building (arrivals 20% over completions): not steady either.
    assert decide(BOTH, queueing(flow=flow(1600.0, 4, arrived=1600.0 / TAU * 1.2)),
                  LEARNED).state.capacity.ceiling is None


def test_a_metrics_dropout_never_scales_up() -> None:
    # 0 of 6 pods reporting: the window still holds their last TTFT p95 (0.9 s, over target) and the model its
    # line. Nothing votes up: the linear latency rule once went 6 → ceil(6 × 1.8) = 11 here.
    dark = Observation(now=NOW, current_replicas=6, ready_replicas=6, starting_replicas=0, reporting_replicas=0,
                       latency={"ttft_p95": 0.9}, queue_time_p95=0.3)
    state = replace(LEARNED, recommendations=(Recommendation(NOW - 30, 6),))
    d = decide(BOTH, dark, state)
    assert (d.desired_replicas, d.limited_by) == (6, "noMetrics")
    assert d.state.capacity == state.capacity  # and nothing learned from it
    # Even were a stale flow passed: a silent ready pod's load is unknown, so the model does not decide.
    assert decide(BOTH, replace(dark, flow=flow(3000.0, 6), flow_last=flow(3000.0, 6)), state).desired_replicas == 6
    # Partial (3 of 6): never down, and latency on part of the fleet does not add either.
    partial = replace(queueing(1500.0, ready=6, ttft=0.9), reporting_replicas=3, queue_depth=6.0)
    assert decide(BOTH, partial, state).desired_replicas == 6


def test_a_stuck_starting_pod_counts_as_capacity_only_until_the_startup_budget() -> None:
    budget = POLICY.startup_budget_seconds
    # 5 replicas, 4 ready, 2300 tokens/s: 4.6 replicas' worth. The starting one (no startup learned yet) is on
    # its way: 4.6 is within 5 × 1.1, hold.
    on_way = obs(2300.0, ready=4, current=5, starting_ages=(budget - 1,))
    assert decide(POLICY, on_way, LEARNED).desired_replicas == 5
    # Past the startup probe's budget it is surely stuck: 4 really serve or come, 4.6 > 4 × 1.1:
    # ceil(4.6 / 0.9) = 6, plus one to replace the stuck pod: 7.
    stuck = decide(POLICY, replace(on_way, starting_ages=(budget + 1,)), LEARNED)
    assert stuck.desired_replicas == up_to(4.6) + 1 == 7
    assert stuck.reason.endswith(f"(1 starting for over {budget:.0f}s no longer count as capacity on the way)")


def test_an_unschedulable_pod_does_not_freeze_scale_up_within_the_pending_budget() -> None:
    budget = POLICY.unschedulable_budget
    # 6000 tokens/s is 12 replicas' worth (ceil(12 / 0.9) = 14); 5 exist, 4 ready, 1 Pending-unschedulable. A
    # node autoscaler adds nodes for Pending pods: ask for budget - 1 more (up to 5 + 3 = 8) instead of waiting.
    pending = obs(6000.0, ready=4, current=5, unschedulable_replicas=1, queue_depth=AT_TARGET)
    d = decide(POLICY, pending, LEARNED)
    assert d.proposals[0].replicas == up_to(12.0) == 14
    assert (d.desired_replicas, d.limited_by) == (5 + budget - 1, "capacityBlocked")
    assert d.reason.endswith(f"limited to {5 + budget - 1}: 1 unschedulable pod, at most {budget} pending at once")
    # Next round all 4 new ones are unschedulable too: at the budget, scale-up waits for them.
    full = obs(6000.0, ready=4, current=5 + budget - 1, unschedulable_replicas=budget, now=NOW + 15,
               queue_depth=AT_TARGET)
    assert (decide(POLICY, full, d.state).desired_replicas, decide(POLICY, full, d.state).limited_by) == (
        5 + budget - 1, "capacityBlocked")


def test_without_a_sample_yet_the_queue_rule_decides() -> None:
    # A flow, but a backlog building (arrivals 20% over completions): no steady sample, no line yet: the queue
    # rule decides on the depth, 4 × 12 = 48 at target 4: ceil(4 × 3^(2/3)) = ceil(8.32) = 9.
    o = obs(3000.0, flow=flow(3000.0, 4, arrived=12.0))
    d = decide(POLICY, o, AutoscalerState(recommendations=(Recommendation(0.0, 1),)))
    assert [(p.source, p.replicas) for p in d.proposals] == [("queue", 9)]
    assert d.state.capacity.line is None
    # A steady round gives the first sample and an assumed line: the model decides from then on.
    steady = decide(POLICY, obs(3000.0), AutoscalerState(recommendations=(Recommendation(0.0, 1),)))
    assert [p.source for p in steady.proposals] == ["capacity"]
    assert steady.state.capacity.line is not None and not steady.state.capacity.line.fitted


def test_a_round_without_completions_leaves_the_demand_trend_in_tokens_per_second() -> None:
    # Five minutes of 1000 tokens/s (2 replicas' worth) on 4 replicas, the model with samples: scale down to
    # ceil(2.0 / 0.9) = 3. A round in between where requests arrived but none finished within the window (long
    # generations) has no tokens per request, so no demand; its 3.3 requests/s must not enter the tokens/s series
    # (there it reads as a crash to 3.3 tokens/s: noise that holds the next 10 minutes at the noise margin).
    rates = tuple((NOW - 15 * i, 1000.0) for i in range(20, 0, -1))
    state = replace(LEARNED, rates=rates, capacity=Capacity(((NOW - 15, 250.0, LINE.depth(250.0)),), LINE))
    assert decide(POLICY, obs(1000.0, now=NOW + 15), state).desired_replicas == 3
    stalled = obs(1000.0, flow=Flow(0.0, 3.3, 2000 / 3, 1000 / 3, 4), flow_last=Flow(0.0, 3.3, 2000 / 3, 1000 / 3, 4),
                  request_rate=3.3)
    d = decide(POLICY, stalled, state)
    assert decide(POLICY, obs(1000.0, now=NOW + 15), d.state).desired_replicas == 3


def test_an_assumed_line_moves_only_where_the_queue_agrees() -> None:
    # No fit yet: the line is a prior (LINE, unfitted). A rising round (arrivals 30% over completions: not steady,
    # so it adds no sample and the prior stays) asks 1.3 × 3150 = 4095 tokens/s, 8.19 replicas' worth at 500:
    # ceil(8.19 / 0.9) = 10. While each replica holds only the queue target (ratio 1.0, within the tolerance) the
    # prior's vote is held: a move the fit would undo a few minutes later is a flap in the making.
    prior = replace(LEARNED, capacity=Capacity(line=replace(LINE, fitted=False)))
    rising = flow(3150.0, 4, arrived=3150.0 / TAU * 1.3)
    at_target = decide(POLICY, obs(3150.0, queue_depth=4 * 4.0, flow=rising, flow_last=rising), prior)
    assert (at_target.desired_replicas, at_target.limited_by) == (4, "tolerance")
    assert "capacity not fitted yet: waiting for the queue (1.00 of target) to agree" in at_target.reason
    # The queue over its tolerance agrees (12 each, 3.0 of target): the prior sizes the step.
    agreed = decide(POLICY, obs(3150.0, queue_depth=4 * 12.0, flow=rising, flow_last=rising), prior)
    assert agreed.desired_replicas == up_to(4095.0 / PER) == 10
    # A fitted line needs no agreement: the same round on LINE scales up at the target depth too.
    fitted = decide(POLICY, obs(3150.0, queue_depth=4 * 4.0, flow=rising, flow_last=rising), LEARNED)
    assert fitted.desired_replicas == 10


def test_a_backlog_the_fleet_would_clear_slowly_is_sized_to_clear_within_DRAIN_S() -> None:
    # 2000 tokens/s on 4 ready is exactly their worth (4 x 500); 64 requests held where 16 is the target leave 48
    # past it, 14,400 tokens. The 4 have no surplus to clear them: sized for the demand plus 14,400 / DRAIN_S =
    # 240 tokens/s more, 4.48 replicas' worth (past 4 x 1.1): ceil(4.48 / 0.9) = 5.
    d = decide(POLICY, obs(2000.0, queue_depth=64.0), LEARNED)
    assert d.desired_replicas == up_to(4 + 14_400 / DRAIN_S / PER) == 5
    assert "a backlog of 48 requests past the queue target: sized to clear it within 60s" in d.reason
    # At 1000 tokens/s the same 4 have 1000 tokens/s to spare: 14.4 s to clear it, within DRAIN_S: nobody new.
    calm = decide(POLICY, obs(1000.0, queue_depth=64.0), LEARNED)
    assert calm.desired_replicas <= 4 and "backlog" not in calm.reason
