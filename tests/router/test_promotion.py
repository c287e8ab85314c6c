"""The promotion state machine: windows, promotion and demotion with hysteresis, and its properties under any signal
(no oscillation under a constant one, promotion within two windows of a drop, recovery after the probe window)."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet_router.promotion import Change, Promotion
from kvfleet_router.tier_config import Quality

Q = Quality(threshold=0.5, hysteresis=0.1, window_s=100.0, min_samples=5)

Signal = Callable[[int, float], float]  # (tier, time) → a score for an answer of that tier at that time


def fill(p: Promotion, tier: int, score: float, now: float, n: int = 5) -> None:
    for _ in range(n):
        p.record(tier, score, now)


def drive(p: Promotion, signal: Signal, ticks: int, dt: float, per_tick: Callable[[int], int] = lambda _: 1,
          start: int = 1) -> list[tuple[float, Change]]:
    """Every dt seconds: score each measured tier per_tick(tick) times, then evaluate. The changes, with times."""
    changes = []
    for i in range(start, start + ticks):
        now = i * dt
        for tier in p.verify_tiers():
            for _ in range(per_tick(i)):
                p.record(tier, signal(tier, now), now)
        change = p.evaluate(now)
        if change is not None:
            changes.append((now, change))
    return changes


# --- the machine, step by step ----------------------------------------------------------------------------------

def test_verify_tiers_are_the_serving_tier_below_top_and_the_probe_once_promoted() -> None:
    p = Promotion(0, 2, Q, 0.0)
    assert (p.tier, p.verify_tiers()) == (0, (0,))
    fill(p, 0, 0.1, 50.0)
    assert p.evaluate(100.0) == Change("promoted", 0, 1, pytest.approx(0.1), 5)
    assert (p.tier, p.verify_tiers()) == (1, (1, 0))
    fill(p, 1, 0.1, 150.0)
    assert p.evaluate(200.0) == Change("promoted", 1, 2, pytest.approx(0.1), 5)
    assert (p.tier, p.verify_tiers()) == (2, (1,))  # the top is the reference: only the probe is measured
    assert Promotion(2, 2, Q, 0.0).verify_tiers() == ()  # a class the top serves (unmatched) is never measured
    assert Promotion(1, 3, Q, 0.0).verify_tiers() == (1,)  # nothing below the base is probed


def test_a_base_outside_the_tiers_is_refused() -> None:
    with pytest.raises(ValueError, match="base tier"):
        Promotion(3, 2, Q, 0.0)
    with pytest.raises(ValueError, match="base tier"):
        Promotion(-1, 2, Q, 0.0)


def test_a_window_decides_only_after_window_s() -> None:
    p = Promotion(0, 1, Q, 0.0)
    fill(p, 0, 0.0, 10.0, n=100)
    assert p.evaluate(99.9) is None
    assert p.last_mean(0) is None
    assert p.evaluate(100.0) == Change("promoted", 0, 1, 0.0, 100)
    assert p.tier == 1 and p.last_mean(0) == 0.0


def test_a_good_window_closes_without_a_change_and_the_next_starts_empty() -> None:
    p = Promotion(0, 1, Q, 0.0)
    fill(p, 0, 0.9, 50.0)
    assert p.evaluate(100.0) is None
    assert p.last_mean(0) == pytest.approx(0.9)
    fill(p, 0, 0.1, 150.0, n=4)  # the old window's good scores no longer count: four are too few alone
    assert p.evaluate(200.0) is None
    p.record(0, 0.1, 201.0)
    assert p.evaluate(201.0) == Change("promoted", 0, 1, pytest.approx(0.1), 5)


def test_the_mean_at_the_threshold_does_not_promote() -> None:
    p = Promotion(0, 1, Q, 0.0)
    fill(p, 0, 0.5, 1.0, n=3)
    fill(p, 0, 0.4, 1.0, n=1)
    fill(p, 0, 0.6, 1.0, n=1)  # mean 0.5: not below 0.5
    assert p.evaluate(100.0) is None and p.tier == 0
    fill(p, 0, 0.49, 101.0)
    assert p.evaluate(200.0) is not None and p.tier == 1


def test_too_few_scores_keep_the_window_open_until_enough_arrive() -> None:
    p = Promotion(0, 1, Q, 0.0)
    fill(p, 0, 0.0, 10.0, n=4)
    for now in (100.0, 500.0, 5000.0):
        assert p.evaluate(now) is None
    assert p.last_mean(0) is None
    p.record(0, 0.2, 5001.0)  # the fifth: the window, open since 0, now decides on all five
    assert p.evaluate(5001.0) == Change("promoted", 0, 1, pytest.approx(0.04), 5)


def test_demotion_needs_the_probe_at_threshold_plus_hysteresis() -> None:
    p = Promotion(0, 2, Q, 0.0)
    fill(p, 0, 0.0, 1.0)
    assert p.evaluate(100.0) is not None and p.tier == 1
    fill(p, 1, 0.9, 101.0)  # the serving tier is fine
    fill(p, 0, 0.59, 101.0)  # the probe recovered, but not past 0.5 + 0.1
    assert p.evaluate(200.0) is None
    assert (p.last_mean(0), p.last_mean(1)) == (pytest.approx(0.59), pytest.approx(0.9))
    fill(p, 1, 0.9, 201.0)
    fill(p, 0, 0.6, 201.0)
    assert p.evaluate(300.0) == Change("demoted", 1, 0, pytest.approx(0.6), 5)
    assert (p.tier, p.verify_tiers()) == (0, (0,))


def test_windows_of_the_two_measured_tiers_close_independently() -> None:
    p = Promotion(0, 2, Q, 0.0)
    fill(p, 0, 0.0, 1.0)
    p.evaluate(100.0)
    fill(p, 0, 1.0, 150.0)  # the probe has enough; the serving tier has too few and keeps collecting
    fill(p, 1, 0.0, 150.0, n=2)
    assert p.evaluate(200.0) == Change("demoted", 1, 0, 1.0, 5)
    assert p.last_mean(1) is None


def test_a_promotion_wins_over_a_demotion_decided_at_once() -> None:
    p = Promotion(0, 2, Q, 0.0)
    fill(p, 0, 0.0, 1.0)
    p.evaluate(100.0)
    fill(p, 1, 0.0, 150.0)
    fill(p, 0, 1.0, 150.0)
    assert p.evaluate(200.0) == Change("promoted", 1, 2, 0.0, 5)
    assert p.last_mean(0) == 1.0  # the probe's window closed too, and its mean is kept


def test_scores_of_unmeasured_tiers_old_scores_and_non_numbers_are_ignored() -> None:
    p = Promotion(0, 2, Q, 0.0)
    fill(p, 1, 0.0, 10.0)  # tier 1 serves nothing of this class yet
    fill(p, 2, 0.0, 10.0)  # the top is the reference
    fill(p, 0, math.nan, 10.0)
    assert p.evaluate(100.0) is None and p.last_mean(0) is None
    fill(p, 0, 0.0, 101.0)
    assert p.evaluate(200.0) is not None  # at 200: promoted, windows restart at 200
    fill(p, 1, 0.0, 150.0)  # taken before the change: belongs to no window of the new tier
    assert p.evaluate(300.0) is None and p.tier == 1


def test_the_last_means_survive_changes() -> None:
    p = Promotion(0, 1, Q, 0.0)
    fill(p, 0, 0.2, 1.0)
    p.evaluate(100.0)
    assert p.tier == 1 and p.last_mean(0) == pytest.approx(0.2)
    assert p.last_mean(1) is None
    fill(p, 0, 0.8, 101.0)
    assert p.evaluate(200.0) == Change("demoted", 1, 0, pytest.approx(0.8), 5)
    assert p.last_mean(0) == pytest.approx(0.8)


def test_a_constant_low_quality_climbs_to_the_top_and_stays() -> None:
    p = Promotion(0, 3, Q, 0.0)
    changes = drive(p, lambda tier, now: 0.3, ticks=100, dt=10.0)
    assert [(c.from_tier, c.to_tier) for _, c in changes] == [(0, 1), (1, 2), (2, 3)]
    assert [t for t, _ in changes] == [100.0, 200.0, 300.0]
    assert p.tier == 3 and p.verify_tiers() == (2,)


def test_the_window_mean_of_a_constant_signal_is_that_constant_exactly() -> None:
    # 0.1 added up ten times is 0.9999999999999999: divided by ten, a hair under 0.1. At the threshold with no
    # hysteresis that hair would promote, and the next window's exact 0.1 would demote again.
    q = Quality(threshold=0.1, hysteresis=0.0, window_s=10.0, min_samples=10)
    p = Promotion(0, 1, q, 0.0)
    fill(p, 0, 0.1, 1.0, n=10)
    assert p.evaluate(10.0) is None
    assert p.last_mean(0) == 0.1


# --- properties -------------------------------------------------------------------------------------------------

@st.composite
def qualities(draw: st.DrawFn) -> Quality:
    threshold = draw(st.floats(0.0, 1.0))
    hysteresis = draw(st.sampled_from([0.0]) | st.floats(0.01, 1.0)) if threshold < 1.0 else 0.0
    hysteresis = min(hysteresis, 1.0 - threshold)
    return Quality(threshold=threshold, hysteresis=hysteresis, window_s=float(draw(st.integers(1, 50))),
                   min_samples=draw(st.integers(1, 10)))


@settings(max_examples=300, deadline=None)
@given(qualities(), st.integers(1, 4), st.data(), st.randoms(use_true_random=False))
def test_a_constant_signal_never_oscillates(q: Quality, top: int, data: st.DataObject, rng: random.Random) -> None:
    base = data.draw(st.integers(0, top))
    means = data.draw(st.lists(st.floats(0.0, 1.0), min_size=top + 1, max_size=top + 1))
    # Each tier's scores: its constant, or the constant with noise inside ±hysteresis/2 (a band narrower than
    # the hysteresis; the margin keeps rounding out of it).
    noisy = data.draw(st.lists(st.booleans(), min_size=top + 1, max_size=top + 1))
    half = 0.45 * q.hysteresis

    def signal(tier: int, now: float) -> float:
        return means[tier] + (rng.uniform(-half, half) if noisy[tier] else 0.0)

    dt = data.draw(st.sampled_from([1.0, 2.5, 7.0]))
    ticks = data.draw(st.integers(1, 40)) * max(1, int(q.window_s / dt))
    p = Promotion(base, top, q, 0.0)
    changes = drive(p, signal, ticks, dt, per_tick=lambda _: rng.randint(0, 3))
    kinds = [c.kind for _, c in changes]
    assert all(a == b for a, b in itertools.pairwise(kinds)), kinds  # never reverses
    assert "demoted" not in kinds  # from the base the first move is up, so none can ever go down
    tiers = [base] + [c.to_tier for _, c in changes]
    assert tiers == sorted(tiers) and all(base <= t <= top for t in tiers)
    assert all(b == a + 1 for a, b in itertools.pairwise(tiers))  # one tier a step


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 10), st.integers(1, 20), st.integers(1, 30), st.integers(1, 3), st.floats(0.0, 0.99),
       st.data())
def test_a_drop_promotes_within_two_windows(dt: int, per_window: int, min_samples: int, top: int,
                                            threshold: float, data: st.DataObject) -> None:
    window_s = dt * per_window  # ticks land on window ends exactly: no rounding in the test's clock
    q = Quality(threshold=threshold, hysteresis=0.0, window_s=float(window_s), min_samples=min_samples)
    good = data.draw(st.floats(threshold, 1.0))
    bad = data.draw(st.floats(0.0, threshold).filter(lambda x: x < threshold))
    drop = data.draw(st.floats(0.0, 10.0 * window_s))  # any moment, mid-window or not
    per_tick = math.ceil(min_samples / per_window)  # enough that every full window holds min_samples

    def signal(tier: int, now: float) -> float:
        return good if now < drop else bad

    p = Promotion(0, top, q, 0.0)
    changes = drive(p, signal, ticks=int(drop // dt) + 3 * per_window, dt=float(dt), per_tick=lambda _: per_tick)
    assert changes, "never promoted"
    when, first = changes[0]
    assert first.kind == "promoted" and first.from_tier == 0
    assert drop <= when <= drop + 2 * window_s  # and not before the drop: good windows decide nothing


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 10), st.integers(1, 20), st.integers(1, 30), st.integers(0, 5), st.data())
def test_recovery_demotes_after_the_probe_window_and_not_before_one(dt: int, per_window: int, min_samples: int,
                                                                   late: int, data: st.DataObject) -> None:
    window_s = dt * per_window
    q = Quality(threshold=0.5, hysteresis=0.2, window_s=float(window_s), min_samples=min_samples)
    per_tick = math.ceil(min_samples / per_window)
    p = Promotion(0, 2, q, 0.0)
    changes = drive(p, lambda tier, now: 0.1, ticks=per_window, dt=float(dt), per_tick=lambda _: per_tick)
    assert [c.kind for _, c in changes] == ["promoted"]
    promoted_at = changes[0][0]
    recovered = data.draw(st.floats(0.7, 1.0))  # at or past threshold + hysteresis
    recovery = promoted_at + data.draw(st.floats(0.0, float(late * window_s)))

    def signal(tier: int, now: float) -> float:
        if tier == 1:
            return 0.9  # the serving tier is fine: no further promotion
        return recovered if now >= recovery else 0.1

    start = int(promoted_at // dt) + 1
    changes = drive(p, signal, ticks=(late + 3) * per_window, dt=float(dt), per_tick=lambda _: per_tick,
                    start=start)
    assert changes and changes[0][1].kind == "demoted", changes
    when, demoted = changes[0]
    assert (demoted.from_tier, demoted.to_tier) == (1, 0) and demoted.mean >= 0.7
    assert when >= promoted_at + window_s  # the probe's first window has to run its course
    assert when <= max(recovery, promoted_at) + 2 * window_s


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 50), st.integers(1, 4), st.data())
def test_too_few_samples_never_decide(min_samples: int, top: int, data: st.DataObject) -> None:
    q = Quality(threshold=0.5, hysteresis=0.1, window_s=10.0, min_samples=min_samples)
    p = Promotion(0, top, q, 0.0)
    events = data.draw(st.lists(st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 1000.0)), max_size=min_samples - 1))
    now = 0.0
    for score, step in events:
        now += step
        p.record(0, score, now)
        assert p.evaluate(now) is None
    for later in (now + 10.0, now + 1e6):
        assert p.evaluate(later) is None
    assert p.tier == 0 and p.last_mean(0) is None
