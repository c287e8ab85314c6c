"""Pure: one class of one tiered model, promoted a tier when its answers' quality stays low, demoted back with
hysteresis; time is passed in (`now`, seconds).

The monitor scores sampled answers against the top tier's (agreement.py) and records them here, per tier: the
serving tier's scores decide promotion, and once promoted, the scores of the tier just below (the demotion
probe) decide the way back. Each measured tier collects scores in tumbling windows of `window_s`; a window
closes once it has run that long and holds `min_samples` scores (until then it keeps collecting, so that a
handful of scores never decides), and every change restarts every window empty.

No oscillation: promotion from tier t needs a closed window of t's scores with mean < threshold, and demotion
back to t needs one with mean >= threshold + hysteresis. A window's mean lies between its lowest and highest
score (it is kept there exactly, despite rounding), so while each tier's scores stay within a band narrower than
the hysteresis (a constant quality, or one with noise under hysteresis / 2), no tier can satisfy both: the class
only ever moves up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from kvfleet_router.tier_config import Quality


@dataclass(frozen=True)
class Change:
    """A promotion or demotion, with the closed window that decided it (its mean and its number of scores)."""

    kind: Literal["promoted", "demoted"]
    from_tier: int
    to_tier: int
    mean: float
    samples: int


class _Window:
    """One tier's scores since `start`."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.count = 0
        self.total = 0.0
        self.low = math.inf
        self.high = -math.inf

    def add(self, score: float) -> None:
        self.count += 1
        self.total += score
        self.low = min(self.low, score)
        self.high = max(self.high, score)

    def mean(self) -> float:
        # Within [low, high] as the true mean is: rounding in the sum must not move a constant signal's mean
        # across the threshold (the no-oscillation argument counts on it).
        return min(max(self.total / self.count, self.low), self.high)


class Promotion:
    """The promotion state of one (tiered model, class): the tier serving it now, and the windows measuring it."""

    def __init__(self, base: int, top: int, quality: Quality, now: float) -> None:
        if not 0 <= base <= top:
            raise ValueError(f"base tier {base} must lie between 0 and the top tier {top}")
        self.base, self.top, self.quality = base, top, quality
        self._tier = base
        self._windows: dict[int, _Window] = {}
        self._last: dict[int, float] = {}
        self._restart(now)

    @property
    def tier(self) -> int:
        """The tier serving the class now: its base tier, raised by promotions, never above the top."""
        return min(self.top, max(self.base, self._tier))

    def verify_tiers(self) -> tuple[int, ...]:
        """The tiers whose answers the monitor should score against the top tier now: the serving tier unless it
        is the top, and once promoted, the tier just below it (the demotion probe)."""
        t = self.tier
        return tuple([t] if t < self.top else []) + tuple([t - 1] if t > self.base else [])

    def record(self, tier: int, score: float, now: float) -> None:
        """A score in [0, 1] for an answer of `tier`, taken at `now`. Ignored when the tier is not measured now,
        when the score is not a number, or when it is older than the tier's window (it belongs to a window that
        closed, or that a change threw away)."""
        window = self._windows.get(tier)
        if window is None or tier not in self.verify_tiers() or not math.isfinite(score) or now < window.start:
            return
        window.add(score)

    def evaluate(self, now: float) -> Change | None:
        """Close the windows that have run `window_s` with at least `min_samples` scores, and move the class if
        one says so: the serving tier's mean below the threshold promotes a tier, the probe's mean at or above
        threshold + hysteresis demotes one. Quality first: a promotion wins over a demotion decided at once."""
        q = self.quality
        serving = self.tier
        change: Change | None = None
        for tier in self.verify_tiers():
            window = self._windows[tier]
            if now - window.start < q.window_s or window.count < q.min_samples:
                continue
            mean = window.mean()
            self._last[tier] = mean
            self._windows[tier] = _Window(now)
            if tier == serving and mean < q.threshold:
                change = Change("promoted", serving, min(serving + 1, self.top), mean, window.count)
            elif tier == serving - 1 and mean >= q.threshold + q.hysteresis and change is None:
                change = Change("demoted", serving, tier, mean, window.count)
        if change is not None:
            self._tier = change.to_tier
            self._restart(now)
        return change

    def last_mean(self, tier: int) -> float | None:
        """The mean of `tier`'s last closed window (kept across changes); None when none closed yet."""
        return self._last.get(tier)

    def _restart(self, now: float) -> None:
        self._windows = {t: _Window(now) for t in self.verify_tiers()}
