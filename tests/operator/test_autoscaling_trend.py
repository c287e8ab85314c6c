"""trend.trend(): least-squares level and slope of rate samples, and when a slope counts as real."""

from __future__ import annotations

import pytest

from kvfleet_operator.autoscaling.trend import MAX_SPREAD, MIN_SAMPLES, TREND_WINDOW_S, trend

NOW = 5000.0


def line(slope: float, level: float, n: int = 20, every: float = 15.0) -> list[tuple[float, float]]:
    """n samples `every` seconds apart, ending now, on level + slope × (t - now)."""
    return [(NOW - every * i, level + slope * (-every * i)) for i in range(n)]


def test_a_clean_fall_is_fitted_exactly_and_significant() -> None:
    tr = trend(line(-0.005, 6.0), NOW)
    assert tr is not None
    assert tr.level == pytest.approx(6.0)
    assert tr.slope == pytest.approx(-0.005)
    assert tr.significant and tr.falling
    assert tr.at(300) == pytest.approx(4.5)


def test_a_rise_is_not_a_fall() -> None:
    tr = trend(line(0.01, 3.0), NOW)
    assert tr is not None and tr.significant and not tr.falling


def test_noise_around_a_flat_load_is_not_significant() -> None:
    # ±1 alternating around 5: the fitted slope is tiny next to its standard error.
    samples = [(t, y + (1.0 if i % 2 else -1.0)) for i, (t, y) in enumerate(line(0.0, 5.0))]
    tr = trend(samples, NOW)
    assert tr is not None
    assert abs(tr.slope) < 2e-3  # the alternation ends on a low sample: a slight tilt, nowhere near significant
    assert not tr.significant and not tr.falling


def test_a_small_slope_inside_large_noise_is_not_significant() -> None:
    samples = [(t, y + (2.0 if i % 2 else -2.0)) for i, (t, y) in enumerate(line(-0.001, 5.0))]
    tr = trend(samples, NOW)
    assert tr is not None and tr.slope < 0 and not tr.significant


def test_too_few_samples_claim_no_trend() -> None:
    assert trend(line(-0.01, 6.0, n=MIN_SAMPLES - 1), NOW) is None
    assert trend(line(-0.01, 6.0, n=MIN_SAMPLES), NOW) is not None


def test_samples_older_than_the_window_are_ignored() -> None:
    old = [(NOW - TREND_WINDOW_S - 15 * i, 100.0) for i in range(1, 10)]  # a spike long gone
    tr = trend(old + line(-0.005, 6.0), NOW)
    assert tr is not None and tr.slope == pytest.approx(-0.005)
    assert trend(old, NOW) is None


def test_samples_all_at_one_time_have_no_slope() -> None:
    assert trend([(NOW, float(i)) for i in range(10)], NOW) is None


def test_the_spread_says_whether_the_line_describes_the_samples() -> None:
    # ±0.3 alternating around a clean fall at level 6 (5%): the line fits; a step from 8 to 4 does not.
    wobbly = [(t, y + (0.3 if i % 2 else -0.3)) for i, (t, y) in enumerate(line(-0.005, 6.0))]
    tr = trend(wobbly, NOW)
    assert tr is not None and tr.falling and tr.fits
    assert tr.spread == pytest.approx(0.3, rel=0.1)
    step = [(NOW - 15 * i, 4.0 if i < 10 else 8.0) for i in range(20)]
    st = trend(step, NOW)
    assert st is not None and st.falling and not st.fits  # significant, but a line through two plateaus
    assert st.spread > MAX_SPREAD * st.level


def test_rising_is_a_significant_rise() -> None:
    tr = trend(line(0.01, 3.0), NOW)
    assert tr is not None and tr.rising and not tr.falling
    flat = trend([(t, y + (1.0 if i % 2 else -1.0)) for i, (t, y) in enumerate(line(0.0, 5.0))], NOW)
    assert flat is not None and not flat.rising
