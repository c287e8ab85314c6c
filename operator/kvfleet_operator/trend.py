"""The demand trend an autoscaler can act on: a least-squares slope of request-rate samples, and whether it is real."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Ten minutes: long enough that a ripple of a few minutes averages out and only the underlying move remains.
TREND_WINDOW_S = 600.0
MIN_SAMPLES = 8  # two minutes of 15 s rounds before any trend is claimed
T_STAT = 3.0  # the slope must be this many standard errors away from flat to count


@dataclass(frozen=True)
class Trend:
    """The fitted value now (e.g. requests/s), its slope per second, and whether the slope is significant."""

    level: float
    slope: float
    significant: bool

    @property
    def falling(self) -> bool:
        """A significant fall."""
        return self.significant and self.slope < 0

    def at(self, seconds: float) -> float:
        """The value this trend reaches `seconds` from now."""
        return self.level + self.slope * seconds


def trend(samples: Sequence[tuple[float, float]], now: float, window: float = TREND_WINDOW_S) -> Trend | None:
    """Least squares over the (time, value) samples within `window` of `now`; None under MIN_SAMPLES or when all
    samples share one time. Significant: |slope| >= T_STAT standard errors (a noiseless nonzero slope counts)."""
    points = [(t - now, y) for t, y in samples if t > now - window]
    n = len(points)
    if n < MIN_SAMPLES:
        return None
    tm = sum(t for t, _ in points) / n
    ym = sum(y for _, y in points) / n
    sxx = sum((t - tm) ** 2 for t, _ in points)
    if sxx <= 0:
        return None
    slope = sum((t - tm) * (y - ym) for t, y in points) / sxx
    level = ym - slope * tm  # the fitted value at t = 0, i.e. now
    se = math.sqrt(sum((y - level - slope * t) ** 2 for t, y in points) / (n - 2) / sxx)
    significant = abs(slope) >= T_STAT * se and slope != 0
    return Trend(level, slope, significant)
