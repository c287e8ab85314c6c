"""Load traces as arrival-rate curves (some seeded), request mixes, and seeded Poisson request streams from them."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from replica import Request


@dataclass(frozen=True)
class RequestMix:
    """Prompt and output lengths: log-normal around a median, clipped (chat-like; prompts longer than outputs).
    A share `long_share` of the requests instead has a long prompt, log-normal around `long_median`."""

    prompt_median: int = 600
    prompt_sigma: float = 0.6
    output_median: int = 180
    output_sigma: float = 0.7
    prompt_max: int = 4096
    output_max: int = 1024
    long_share: float = 0.0
    long_median: int = 3500
    long_sigma: float = 0.15


@dataclass(frozen=True)
class Trace:
    """An arrival rate over [0, duration_s), in requests per second; `peak` bounds it (for thinning). `mix` is
    the request mix its arrivals draw from; `rise_s` is when its load first rises (where a metrics-dropout fault
    starts)."""

    name: str
    duration_s: float
    rate: Callable[[float], float]
    peak: float
    mix: RequestMix = field(default_factory=RequestMix)
    rise_s: float = 0.0


TRACE_NAMES = ("step", "ramp", "burst", "wave", "spike", "sine-noise", "lognormal-bursts", "diurnal", "long-prompt")
SEEDED = ("sine-noise", "lognormal-bursts", "diurnal")  # their shape (noise, burst times) depends on the seed
LONG_PROMPT_MIX = RequestMix(long_share=0.10)  # 10% of prompts ~3.5k tokens (clipped at 4096)


def _noise(rng: random.Random, minutes: int, sigma: float) -> list[float]:
    """Per-minute multiplicative noise, log-normal with mean 1."""
    return [rng.lognormvariate(-sigma * sigma / 2, sigma) for _ in range(minutes)]


def _smooth(knots: Sequence[tuple[float, float]]) -> Callable[[float], float]:
    """Cosine interpolation through (t, level) knots: flat at each knot, no kinks."""

    def f(t: float) -> float:
        for (t0, y0), (t1, y1) in itertools.pairwise(knots):
            if t < t1:
                x = max(0.0, (t - t0) / (t1 - t0))
                return y0 + (y1 - y0) * (1 - math.cos(math.pi * x)) / 2
        return knots[-1][1]

    return f


def _bursts(rng: random.Random, duration: float, mean_gap: float, cap: float) -> list[tuple[float, float, float]]:
    """(start, end, multiplier): Poisson start times, 2-5 min each, log-normal multipliers (median 2, sigma 0.6)
    clipped to [1, cap]."""
    out = []
    t = rng.expovariate(1 / mean_gap)
    while t < duration:
        length = rng.uniform(120.0, 300.0)
        mult = min(max(rng.lognormvariate(math.log(2.0), 0.6), 1.0), cap)
        out.append((t, t + length, mult))
        t += rng.expovariate(1 / mean_gap)
    return out


def traces(unit: float, scale: float = 1.0, seed: int = 1, max_units: float = 20.0) -> dict[str, Trace]:
    """Every trace, with `unit` requests/s = one replica's worth of load; `scale` shortens them (tests). `seed`
    draws the noise and burst times of the seeded traces (so each seed differs, and every policy run on one seed
    sees the same curve); `max_units` caps a burst's peak at the max replicas' worth of load."""

    def clamp_t(f: Callable[[float], float]) -> Callable[[float], float]:
        return lambda t: f(t / scale)

    step = clamp_t(lambda t: unit * (6.0 if 900 <= t < 3600 else 2.0))  # ×3 at 15 min, back at 60 min
    ramp = clamp_t(lambda t: unit * (1.0 + 7.0 * (1 - abs(t - 3600) / 3600)))  # 1 → 8 → 1 over 2 h
    # Base 3, and 3-minute bursts to 9 every 20 minutes (first at 10 min).
    burst = clamp_t(lambda t: unit * (9.0 if t >= 600 and (t - 600) % 1200 < 180 else 3.0))
    # A day compressed into 3 h: trough 1, peak 8, plus a faster ripple of ±10% (traffic is never smooth).
    wave = clamp_t(lambda t: unit * (1.0 + 3.5 * (1 - math.cos(2 * math.pi * t / 10800)))
                   * (1 + 0.1 * math.sin(2 * math.pi * t / 600)))
    out = {
        "step": Trace("step", 5400 * scale, step, 6.0 * unit, rise_s=900 * scale),
        "ramp": Trace("ramp", 7200 * scale, ramp, 8.0 * unit, rise_s=900 * scale),
        "burst": Trace("burst", 7200 * scale, burst, 9.0 * unit, rise_s=600 * scale),
        "wave": Trace("wave", 10800 * scale, wave, 8.8 * unit, rise_s=1800 * scale),
    }

    # spike: base 1, ×10 for 10 minutes at 15 min and again at 55 min, over 90 min.
    spike = clamp_t(lambda t: unit * (10.0 if 900 <= t < 1500 or 3300 <= t < 3900 else 1.0))
    out["spike"] = Trace("spike", 5400 * scale, spike, 10.0 * unit, rise_s=900 * scale)

    # sine-noise: 1 → 6 → 1 every 40 minutes, times per-minute log-normal noise (sigma 0.15), over 2 h.
    rng = random.Random(seed * 1_000_003 + 11)
    sine_noise = _noise(rng, 120, 0.15)
    sine = clamp_t(lambda t: unit * (3.5 - 2.5 * math.cos(2 * math.pi * t / 2400))
                   * sine_noise[min(int(t // 60), 119)])
    out["sine-noise"] = Trace("sine-noise", 7200 * scale, sine, 6.0 * unit * max(sine_noise), rise_s=600 * scale)

    # lognormal-bursts: base 3; bursts at Poisson times (every 15 min on average) lasting 2-5 min, heavy-tailed
    # multipliers (median 2, sigma 0.6) capped so that the peak stays within max replicas' worth; overlapping
    # bursts take the larger multiplier. Over 2 h.
    rng = random.Random(seed * 1_000_003 + 12)
    spans = _bursts(rng, 7200.0, 900.0, max_units / 3.0)

    def lognormal_bursts(t: float) -> float:
        return unit * 3.0 * max((m for a, b, m in spans if a <= t < b), default=1.0)

    first = spans[0][0] if spans else 900.0
    out["lognormal-bursts"] = Trace("lognormal-bursts", 7200 * scale, clamp_t(lognormal_bursts),
                                    unit * 3.0 * max((m for _, _, m in spans), default=1.0), rise_s=first * scale)

    # diurnal: a day in 2 h (one hour = 300 s): night at 1 until 06:00, a steep morning rise to 7 by 10:00, the
    # peak of 8 at 13:30, 7.5 at 17:00, then a slow evening fall to 1 by 23:00; per-minute noise (sigma 0.05).
    rng = random.Random(seed * 1_000_003 + 13)
    day_noise = _noise(rng, 120, 0.05)
    day = _smooth([(h * 300.0, y) for h, y in ((0, 1), (6, 1), (10, 7), (13.5, 8), (17, 7.5), (23, 1), (24, 1))])
    diurnal = clamp_t(lambda t: unit * day(t) * day_noise[min(int(t // 60), 119)])
    out["diurnal"] = Trace("diurnal", 7200 * scale, diurnal, 8.0 * unit * max(day_noise), rise_s=1800 * scale)

    # long-prompt: 2 → 5 at 15 min → 2 at 60 min, over 90 min; 10% of the requests have ~3.5k-token prompts.
    long_prompt = clamp_t(lambda t: unit * (5.0 if 900 <= t < 3600 else 2.0))
    out["long-prompt"] = Trace("long-prompt", 5400 * scale, long_prompt, 5.0 * unit, LONG_PROMPT_MIX,
                               rise_s=900 * scale)
    assert tuple(out) == TRACE_NAMES
    return out


def arrivals(trace: Trace, mix: RequestMix | None, seed: int) -> Iterator[Request]:
    """Non-homogeneous Poisson arrivals by thinning; the same seed gives every policy the same requests. `mix`
    None: the trace's own."""
    mix = trace.mix if mix is None else mix
    rng = random.Random(seed)
    peak, duration, rate = trace.peak, trace.duration_s, trace.rate
    mu_prompt, mu_long, mu_output = math.log(mix.prompt_median), math.log(mix.long_median), math.log(mix.output_median)
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration:
            return
        if rng.random() * peak > rate(t):
            continue
        if mix.long_share > 0 and rng.random() < mix.long_share:  # no draw without long prompts: old streams kept
            prompt = min(max(int(rng.lognormvariate(mu_long, mix.long_sigma)), 16), mix.prompt_max)
        else:
            prompt = min(max(int(rng.lognormvariate(mu_prompt, mix.prompt_sigma)), 16), mix.prompt_max)
        output = min(max(int(rng.lognormvariate(mu_output, mix.output_sigma)), 4), mix.output_max)
        yield Request(t, prompt, output)
