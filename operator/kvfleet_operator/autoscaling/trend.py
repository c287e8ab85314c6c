"""The demand trend an autoscaler acts on: a least-squares line through request-rate samples, the load it projects."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Ten minutes: long enough that a ripple of a few minutes averages out and only the underlying move remains.
TREND_WINDOW_S = 600.0
MIN_SAMPLES = 8  # two minutes of 15 s rounds before any trend is claimed
T_STAT = 3.0  # the slope must be this many standard errors away from flat to count
# The line describes the samples when they scatter around it by at most this share of its level: Poisson noise
# and a ripple of some percent do, a step (a line drawn through two plateaus) does not.
MAX_SPREAD = 0.15


@dataclass(frozen=True)
class Trend:
    """The fitted value now (e.g. requests/s), its slope per second, whether the slope is significant, and the
    samples' spread around the line (the residuals' standard deviation)."""

    level: float
    slope: float
    significant: bool
    spread: float = 0.0

    @property
    def falling(self) -> bool:
        """A significant fall."""
        return self.significant and self.slope < 0

    @property
    def rising(self) -> bool:
        """A significant rise."""
        return self.significant and self.slope > 0

    @property
    def fits(self) -> bool:
        """Whether the line describes the samples (spread within MAX_SPREAD of the level), so that its level is a
        better estimate of the value now than the newest, noisy sample."""
        return self.level > 0 and self.spread <= MAX_SPREAD * self.level

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
    spread = math.sqrt(sum((y - level - slope * t) ** 2 for t, y in points) / (n - 2))
    significant = abs(slope) >= T_STAT * spread / math.sqrt(sxx) and slope != 0
    return Trend(level, slope, significant, spread)


@dataclass(frozen=True)
class Projection:
    """The load (e.g. replicas at the queue target) a request-rate trend projects: the newest load rescaled from
    the newest rate to the line. `interval`: seconds since the previous round; `window`: the scale-down one."""

    trend: Trend
    load: float
    rate: float
    interval: float
    window: int

    def at(self, seconds: float) -> float:
        """The load `seconds` from now."""
        return self.load * max(self.trend.at(seconds), 0.0) / self.rate

    def now(self) -> float:
        """The load now: on the line where it fits and the newest rate sits above it (noise), else the newest."""
        return self.at(0.0) if self.trend.fits and self.trend.level < self.rate else self.load

    def per_min(self) -> str:
        """The trend's slope in percent of its level per minute, e.g. "5%"."""
        return f"{abs(self.trend.slope) * 60 / self.trend.level:.0%}" if self.trend.level > 0 else "to zero"
