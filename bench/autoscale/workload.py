"""Load traces (step, ramp, burst, wave) as arrival-rate curves, and seeded Poisson request streams from them."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from replica import Request


@dataclass(frozen=True)
class Trace:
    """An arrival rate over [0, duration_s), in requests per second; `peak` bounds it (for thinning)."""

    name: str
    duration_s: float
    rate: Callable[[float], float]
    peak: float


@dataclass(frozen=True)
class RequestMix:
    """Prompt and output lengths: log-normal around a median, clipped (chat-like; prompts longer than outputs)."""

    prompt_median: int = 600
    prompt_sigma: float = 0.6
    output_median: int = 180
    output_sigma: float = 0.7
    prompt_max: int = 4096
    output_max: int = 1024


def traces(unit: float, scale: float = 1.0) -> dict[str, Trace]:
    """The four traces, with `unit` requests/s = one replica's worth of load; `scale` shortens them (tests)."""

    def clamp_t(f: Callable[[float], float]) -> Callable[[float], float]:
        return lambda t: f(t / scale)

    step = clamp_t(lambda t: unit * (6.0 if 900 <= t < 3600 else 2.0))  # ×3 at 15 min, back at 60 min
    ramp = clamp_t(lambda t: unit * (1.0 + 7.0 * (1 - abs(t - 3600) / 3600)))  # 1 → 8 → 1 over 2 h
    # Base 3, and 3-minute bursts to 9 every 20 minutes (first at 10 min).
    burst = clamp_t(lambda t: unit * (9.0 if t >= 600 and (t - 600) % 1200 < 180 else 3.0))
    # A day compressed into 3 h: trough 1, peak 8, plus a faster ripple of ±10% (traffic is never smooth).
    wave = clamp_t(lambda t: unit * (1.0 + 3.5 * (1 - math.cos(2 * math.pi * t / 10800)))
                   * (1 + 0.1 * math.sin(2 * math.pi * t / 600)))
    return {
        "step": Trace("step", 5400 * scale, step, 6.0 * unit),
        "ramp": Trace("ramp", 7200 * scale, ramp, 8.0 * unit),
        "burst": Trace("burst", 7200 * scale, burst, 9.0 * unit),
        "wave": Trace("wave", 10800 * scale, wave, 8.8 * unit),
    }


def arrivals(trace: Trace, mix: RequestMix, seed: int) -> Iterator[Request]:
    """Non-homogeneous Poisson arrivals by thinning; the same seed gives every policy the same requests."""
    rng = random.Random(seed)
    t = 0.0
    while True:
        t += rng.expovariate(trace.peak)
        if t >= trace.duration_s:
            return
        if rng.random() * trace.peak > trace.rate(t):
            continue
        prompt = min(max(int(rng.lognormvariate(math.log(mix.prompt_median), mix.prompt_sigma)), 16), mix.prompt_max)
        output = min(max(int(rng.lognormvariate(math.log(mix.output_median), mix.output_sigma)), 4), mix.output_max)
        yield Request(t, prompt, output)
