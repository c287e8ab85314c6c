"""capacity.py: the per-replica line fitted from (tokens/s, requests held) samples, its latency ceiling, the demand,
and the model carried in AutoscalerState; numbers worked by hand."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvfleet_operator.autoscaling import capacity
from kvfleet_operator.autoscaling.capacity import (
    ASSUMED_UTILISATION,
    CEILING_TTL_S,
    HALF_LIFE_S,
    LATENCY_ONLY_UTILISATION,
    MIN_SAMPLES,
    MIN_SPREAD,
    PREFILL_BOUND_SHARE,
    SAMPLE_WINDOW_S,
    STEADY,
    Demand,
)
from kvfleet_operator.autoscaling.decide import (
    AutoscalerState,
    AutoscalingPolicy,
    Observation,
    Recommendation,
    ScaleEvent,
    decide,
)
from kvfleet_operator.autoscaling.decision import Capacity, Flow, Line

NOW = 10_000.0
W, M = 0.004, 1000.0  # 4 ms per token alone, saturating at 1000 tokens/s per replica
LINE = Line(W, M, True)


def depth(s: float, w: float = W, m: float = M) -> float:
    """The batching model: a replica serving s tokens/s holds s·w / (1 - s/M) requests."""
    return s * w / (1 - s / m)


def samples(loads: list[float], noise: float = 0.0, seed: int = 7, spacing: float = 15.0
            ) -> tuple[tuple[float, float, float], ...]:
    """(time, s, q) samples on the model, newest at NOW, with multiplicative noise on q."""
    rng = random.Random(seed)
    n = len(loads)
    return tuple((NOW - spacing * (n - 1 - i), s, depth(s) * (1 + rng.uniform(-noise, noise)))
                 for i, s in enumerate(loads))


def test_the_line_is_the_batching_model() -> None:
    # s/q = 1/w - s/(w·M): at 500 tokens/s (half of saturation) a replica holds 500 × 0.004 / 0.5 = 4 requests,
    # and holds 4 at 4 / (0.004 + 4/1000) = 500 tokens/s.
    assert LINE.depth(500) == pytest.approx(4.0)
    assert LINE.at_depth(4) == pytest.approx(500.0)
    assert LINE.depth(M) == float("inf")
    for s in (10.0, 250.0, 900.0):
        assert LINE.at_depth(LINE.depth(s)) == pytest.approx(s)


def test_fit_recovers_w_and_m_from_noisy_samples() -> None:
    # 24 rounds over 100..800 tokens/s per replica (std/mean ≈ 0.46, well over MIN_SPREAD), q within ±3%.
    loads = [100.0 + 700.0 * ((7 * i) % 24) / 23 for i in range(24)]
    line = capacity.fit(samples(loads, noise=0.03), NOW)
    assert line is not None and line.fitted
    assert line.w == pytest.approx(W, rel=0.05)
    assert line.m == pytest.approx(M, rel=0.05)
    # Without noise it is exact (the weights do not matter on a line).
    exact = capacity.fit(samples(loads), NOW)
    assert exact is not None
    assert (exact.w, exact.m) == pytest.approx((W, M))


def test_fit_weighs_recent_samples_more() -> None:
    # Old samples (an hour of half-lives ago) from a replica twice as slow, new ones from this one: the new win.
    loads = [100.0 + 30.0 * i for i in range(MIN_SAMPLES * 2)]
    old = tuple((NOW - 6 * HALF_LIFE_S, s, depth(s, 2 * W, M / 2) if s < M / 2 else 100.0) for s in loads[:8])
    line = capacity.fit((*old, *samples(loads)), NOW)
    assert line is not None
    assert line.w == pytest.approx(W, rel=0.05) and line.m == pytest.approx(M, rel=0.1)


def test_fit_needs_enough_samples_and_spread_and_a_saturating_line() -> None:
    loads = [100.0 + 700.0 * i / 23 for i in range(24)]
    assert capacity.fit(samples(loads[:MIN_SAMPLES - 1]), NOW) is None  # too few
    assert capacity.fit(samples(loads[:: 24 // MIN_SAMPLES][:MIN_SAMPLES]), NOW) is not None  # just enough
    # The load barely moved (500 ± 5%: std/mean ≈ 0.03 < MIN_SPREAD): the slope is noise, no fit.
    narrow = [500.0 * (1 + 0.05 * ((-1) ** i)) for i in range(24)]
    assert capacity.fit(samples(narrow), NOW) is None
    spread = [500.0 * (1 + 2 * MIN_SPREAD * ((-1) ** i)) for i in range(24)]  # std/mean = 2 × MIN_SPREAD
    assert capacity.fit(samples(spread), NOW) is not None
    # q falling faster than s rises: s/q grows with s, no saturation in it.
    rising = tuple((NOW, s, 1000.0 / s) for s in loads)
    assert capacity.fit(rising, NOW) is None


def test_fit_never_puts_saturation_below_what_was_served() -> None:
    # Points that say M = 600, yet a replica was seen serving 800: M is at least 1.05 × 800 = 840.
    loads = [100.0 + 25.0 * i for i in range(20)]  # up to 575
    pts = (*((NOW, s, depth(s, W, 600.0)) for s in loads), (NOW, 800.0, 50.0))
    line = capacity.fit(pts, NOW)
    assert line is not None and line.m >= 1.05 * 800


def test_assumed_runs_a_replica_at_its_queue_target_at_a_third_of_saturation() -> None:
    u = ASSUMED_UTILISATION
    # Without a queue target the point itself is at a third of saturation: M = 300 / (1/3) = 900,
    # w = (1 - 1/3) × 6 / 300 = 0.01333; the line passes through (300, 6).
    line = capacity.assumed(300.0, 6.0, None)
    assert line.m == pytest.approx(300.0 / u) and not line.fitted
    assert line.w == pytest.approx((1 - u) * 6.0 / 300.0)
    assert line.depth(300.0) == pytest.approx(6.0)
    # With a queue target q* = 4: w·M = q*(1 - u)/u = 8, and through (300, 6): M = 300 × (8 + 6) / 6 = 700,
    # w = 8 / 700. A replica holding 4 serves 4 / (8/700 + 4/700) = 233 tokens/s = M / 3.
    line = capacity.assumed(300.0, 6.0, 4.0)
    assert (line.m, line.w) == pytest.approx((700.0, 8 / 700)) and not line.fitted
    assert line.depth(300.0) == pytest.approx(6.0)
    assert line.at_depth(4.0) == pytest.approx(u * line.m)
    # A point at the queue target: a replica serves what it serves now.
    assert capacity.assumed(300.0, 4.0, 4.0).at_depth(4.0) == pytest.approx(300.0)


def flow(completed: float = 10.0, arrived: float | None = None, tokens: float = 3000.0, pods: float = 4) -> Flow:
    """`tokens` prompt + output tokens/s (2:1) through `pods` pods."""
    return Flow(completed, completed if arrived is None else arrived, tokens * 2 / 3, tokens / 3, pods)


def obs(**kw: Any) -> Observation:
    base: dict[str, Any] = dict(now=NOW, current_replicas=4, ready_replicas=4, starting_replicas=0,
                                reporting_replicas=4, flow=flow())
    return Observation(**(base | kw))


def test_steady_means_arrivals_within_STEADY_of_completions() -> None:
    assert capacity.steady(obs(flow=flow(10.0, 10.0)))
    assert capacity.steady(obs(flow=flow(10.0, 10.0 * (1 + STEADY))))
    assert capacity.steady(obs(flow=flow(10.0, 10.0 * (1 - STEADY))))
    assert not capacity.steady(obs(flow=flow(10.0, 10.0 * (1 + 1.5 * STEADY))))  # a backlog building up
    assert not capacity.steady(obs(flow=flow(10.0, 10.0 * (1 - 1.5 * STEADY))))  # draining
    assert not capacity.steady(obs(flow=flow(0.0, 0.0)))  # nothing completed: nothing to tell
    assert not capacity.steady(obs(flow=None))


def test_a_window_a_replica_joined_is_not_steady() -> None:
    """Arrivals matching completions say nothing while the replicas changed within the window: a new one's first
    traffic predates its first scrape, and the load moved between pods (a draining backlog can read balanced)."""
    assert capacity.steady(obs(flow=flow(pods=4.0)))
    assert not capacity.steady(obs(flow=flow(pods=3.25)))  # one of the 4 covers only the last quarter
    assert not capacity.steady(obs(flow=flow(pods=3.0)))  # one not covered at all (its first scrape)


def test_demand_is_arrivals_at_the_windows_tokens_per_request() -> None:
    # 3000 tokens/s over 10 completions/s: 300 tokens a request; 11 arriving: 3300 tokens/s of demand (not the
    # 3000 served, which flattens at capacity); 750 served per replica.
    d = capacity.demand(obs(flow=flow(10.0, 11.0)), 15.0)
    assert d == Demand(3300.0, 11.0, 300.0, 750.0)
    # The panic window: the last interval's arrivals if higher; requests held at routers cleared within a round.
    d = capacity.demand(obs(flow=flow(10.0, 11.0), flow_last=flow(10.0, 14.0), held_requests=30.0), 15.0)
    assert d is not None and (d.requests_per_s, d.tokens_per_s) == (14.0 + 30 / 15, (14.0 + 2.0) * 300)
    # Unknown: no flow, no pod covered, nothing completed, or a ready pod silent (its load is unknown).
    assert capacity.demand(obs(flow=None), 15.0) is None
    assert capacity.demand(obs(flow=flow(pods=0)), 15.0) is None
    assert capacity.demand(obs(flow=flow(0.0, 3.0)), 15.0) is None
    assert capacity.demand(obs(reporting_replicas=3), 15.0) is None


def test_observe_samples_steady_rounds_and_assumes_a_line_until_it_can_fit() -> None:
    o = obs(queue_depth=4 * depth(750.0))  # 750 per replica holding 12 each (3 × 4 / 1)
    d = capacity.demand(o, 15.0)
    cap = capacity.observe(Capacity(), o, d, NOW, 4.0)
    assert len(cap.samples) == 1 and cap.samples[0] == pytest.approx((NOW, 750.0, 12.0))
    assert cap.line == capacity.assumed(750.0, cap.samples[0][2], 4.0)  # one point: assumed, not fitted
    # An unsteady round (a backlog building: 12 arriving, 10 completing) adds no sample and keeps the line.
    surge = obs(flow=flow(10.0, 12.0), queue_depth=60.0)
    kept = capacity.observe(cap, surge, capacity.demand(surge, 15.0), NOW + 15, 4.0)
    assert (kept.samples, kept.line) == (cap.samples, cap.line)
    # No queue depth (or none held): no sample.
    assert capacity.observe(Capacity(), obs(), d, NOW, 4.0).samples == ()
    assert capacity.observe(Capacity(), obs(queue_depth=0.0), d, NOW, 4.0).samples == ()
    # Samples older than SAMPLE_WINDOW_S leave.
    old = Capacity(((NOW - SAMPLE_WINDOW_S - 1, 100.0, 1.0), (NOW - 10, 200.0, 2.0)), None, None)
    assert capacity.observe(old, obs(), d, NOW, 4.0).samples == ((NOW - 10, 200.0, 2.0),)


def test_a_sample_pairs_the_windows_service_with_the_windows_mean_depth() -> None:
    """Little's law holds between averages over one span: as a burst drains, the window still served its tokens
    while the newest depth is already small; that pair (far above the line) had flattened the fit."""
    o = obs(queue_depth=4 * 2.0, queue_depth_mean=4 * depth(750.0))  # each replica holds 2 now, 12 on average
    cap = capacity.observe(Capacity(), o, capacity.demand(o, 15.0), NOW, 4.0)
    assert cap.samples[0] == pytest.approx((NOW, 750.0, 12.0))
    # Without the window's mean (an older caller), the newest depth.
    o = obs(queue_depth=4 * 2.0)
    assert capacity.observe(Capacity(), o, capacity.demand(o, 15.0), NOW, 4.0).samples[0] == pytest.approx(
        (NOW, 750.0, 2.0))


def test_a_queue_of_float_noise_is_no_sample() -> None:
    """A queue depth near zero (hypothesis found 5e-324) would put the line through it out of float range: M inf,
    w 0, and per_replica dividing by zero. It adds no sample and assumes no line."""
    o = obs(queue_depth=4e-320)  # 1e-320 requests per replica
    cap = capacity.observe(Capacity(), o, capacity.demand(o, 15.0), NOW, 4.0)
    assert cap == Capacity()
    assert capacity.per_replica(cap, 4.0, 0.1) is None


def test_observe_fits_once_the_samples_allow_and_keeps_a_fitted_line() -> None:
    loads = [100.0 + 700.0 * i / (MIN_SAMPLES - 2) for i in range(MIN_SAMPLES - 1)]
    before = Capacity(samples(loads), capacity.assumed(300.0, 1.0, 4.0), None)
    s = 400.0  # this round: 400 per replica, on the model
    o = obs(flow=flow(tokens=4 * s), queue_depth=4 * depth(s))
    cap = capacity.observe(before, o, capacity.demand(o, 15.0), NOW + 15, 4.0)
    assert len(cap.samples) == MIN_SAMPLES and cap.line is not None and cap.line.fitted
    assert (cap.line.w, cap.line.m) == pytest.approx((W, M))
    # Later rounds at one load (no spread to fit on): the fitted line stays, not re-assumed from one point.
    flat = Capacity(tuple((NOW - 15 * i, s, depth(s)) for i in range(MIN_SAMPLES)), LINE, None)
    again = capacity.observe(flat, o, capacity.demand(o, 15.0), NOW + 15, 4.0)
    assert again.line == LINE


def test_per_replica_at_the_queue_target_under_the_ceiling() -> None:
    cap = Capacity((), LINE, None)
    assert capacity.per_replica(Capacity(), 4.0, 0.1) is None  # no line yet
    # q* = 4: 4 / (0.004 + 4/1000) = 500 tokens/s; latency targets alone: half of saturation, 500 too.
    assert capacity.per_replica(cap, 4.0, 0.1) == pytest.approx(500.0)
    assert capacity.per_replica(cap, None, 0.1) == pytest.approx(LATENCY_ONLY_UTILISATION * M)
    # q* = 9: 9 / (0.004 + 0.009) = 692.3 tokens/s.
    assert capacity.per_replica(cap, 9.0, 0.1) == pytest.approx(9 / 0.013)
    # A latency ceiling at 400 tokens/s: capacity is 400 less the margin twice (below the breach, then headroom),
    # 400 × 0.9² = 324 at 10%.
    low = Capacity((), LINE, (NOW, 400.0))
    assert capacity.per_replica(low, 4.0, 0.1) == pytest.approx(324.0)
    assert capacity.per_replica(low, 4.0, 0.0) == pytest.approx(400.0)
    # A ceiling above the queue target's capacity changes nothing.
    assert capacity.per_replica(Capacity((), LINE, (NOW, 900.0)), 4.0, 0.1) == pytest.approx(500.0)


def test_correct_lowers_lifts_and_forgets_the_ceiling() -> None:
    cap = Capacity((), LINE, None)
    low = capacity.correct(cap, 400.0, breached=True, met=False, now=NOW)
    assert low.ceiling == (NOW, 400.0) and low.line == LINE
    # A breach at a higher load keeps the lower ceiling (and renews it); at a lower load lowers it.
    assert capacity.correct(low, 450.0, True, False, NOW + 15).ceiling == (NOW + 15, 400.0)
    assert capacity.correct(low, 350.0, True, False, NOW + 15).ceiling == (NOW + 15, 350.0)
    # The targets met at a load above the ceiling: the ceiling was wrong, lift it; met below it: it stays.
    assert capacity.correct(low, 450.0, False, True, NOW + 15).ceiling is None
    assert capacity.correct(low, 380.0, False, True, NOW + 15).ceiling == (NOW, 400.0)
    # Neither breached nor met (between the tolerances): it stays until CEILING_TTL_S without a new breach.
    assert capacity.correct(low, 450.0, False, False, NOW + CEILING_TTL_S - 1).ceiling == (NOW, 400.0)
    assert capacity.correct(low, 450.0, False, False, NOW + CEILING_TTL_S).ceiling is None
    assert capacity.correct(low, None, False, False, NOW + CEILING_TTL_S + 1).ceiling is None


def test_prefill_bound_is_a_short_queue_wait() -> None:
    target = 0.5
    assert capacity.prefill_bound(obs(queue_time_p95=PREFILL_BOUND_SHARE * target * 0.9), target)
    assert not capacity.prefill_bound(obs(queue_time_p95=PREFILL_BOUND_SHARE * target), target)
    assert not capacity.prefill_bound(obs(queue_time_p95=None), target)  # unknown: not claimed


def test_capacity_round_trips_through_json_and_the_state() -> None:
    cap = Capacity(((NOW - 30, 400.0, 2.5), (NOW, 500.0, 4.0)), Line(W, M, True), (NOW - 5, 450.0))
    assert cap.to_list() == [[[NOW - 30, 400.0, 2.5], [NOW, 500.0, 4.0]], [W, M, True], [NOW - 5, 450.0]]
    assert Capacity.from_list(cap.to_list()) == cap
    assert Capacity.from_list(Capacity().to_list()) == Capacity()
    assert Capacity.from_list(None) == Capacity() and Capacity.from_list([]) == Capacity()
    unfitted = Capacity((), Line(0.01, 900.0, False), None)
    assert Capacity.from_list(unfitted.to_list()) == unfitted
    state = AutoscalerState((Recommendation(NOW, 4),), (ScaleEvent(NOW - 10, 1),), (90.0,), ((NOW, 3000.0),),
                            None, cap)
    d = state.to_dict()
    assert d["capacity"] == cap.to_list()
    assert AutoscalerState.from_dict(d) == state
    # A state stored by an operator before the capacity model: no model yet.
    del d["capacity"]
    assert AutoscalerState.from_dict(d).capacity == Capacity()


def test_decide_carries_the_model_between_rounds() -> None:
    policy = AutoscalingPolicy(min_replicas=1, max_replicas=20, queue_depth_per_replica=4)
    o = obs(flow=flow(tokens=2000.0), queue_depth=16.0)  # 500 per replica, holding 4 each
    d = decide(policy, o, AutoscalerState())
    assert d.state.capacity.samples == ((NOW, 500.0, 4.0),)
    assert d.state.capacity.line == capacity.assumed(500.0, 4.0, 4.0)
    assert AutoscalerState.from_dict(d.state.to_dict()) == d.state


def test_the_model_survives_a_round_at_zero_replicas() -> None:
    # What a replica serves does not change while there are none: the learned line and ceiling should outlive
    # a stretch at zero (zero.from_zero rebuilds the state from its own fields and drops `capacity`).
    policy = AutoscalingPolicy(min_replicas=0, max_replicas=20, queue_depth_per_replica=4)
    learned = Capacity(((NOW - 60, 500.0, 4.0),), LINE, (NOW - 60, 450.0))
    at_zero = Observation(now=NOW, current_replicas=0, ready_replicas=0, starting_replicas=0, reporting_replicas=0,
                          held_requests=2.0, routers_reporting=1)
    d = decide(policy, at_zero, AutoscalerState(capacity=learned))
    assert d.desired_replicas >= 1
    assert d.state.capacity == learned
