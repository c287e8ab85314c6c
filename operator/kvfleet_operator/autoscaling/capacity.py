"""Per-replica service capacity, learned online from the agents' own counters, and the demand it is compared with."""

# The model. A replica batching continuously holds q requests (waiting + running) while it serves s tokens/s
# (prompt + output). Each step takes a + b × batch, so a request's time in system is W0 / (1 - s/M): M is the
# replica's saturation throughput and W0 the time it takes alone. Little's law (q = x × W, x = s / τ requests/s,
# τ tokens per request, W0 = w × τ) turns that into a line in s in which τ cancels:
#
#     s / q = 1/w - s / (w × M)        w: seconds in system per token alone; M: tokens/s at saturation
#
# so one fit serves every prompt/output mix, and long prompts weigh what they cost. Recency-weighted least squares
# over the samples of the last SAMPLE_WINDOW_S fit the line once the load has varied enough to tell its slope
# from noise; until then the line keeps its last fit, or, with none yet, goes through the newest point with a
# replica at the queue target running at a third of its saturation (where the depth ∝ load^1.5 rule this model
# replaces put it). Only steady windows give samples: Little's law needs arrivals ≈ completions. The queue
# target q* (waiting + running per replica, which the user chose as comfortable) then gives the tokens/s one
# replica serves at it:
#
#     s* = q* / (w + q* / M)
#
# The latency targets correct the model rather than drive it: where a queueing-bound latency percentile was over
# its target at s tokens/s per replica, capacity at the SLO is below s (`ceiling`), until the SLO holds at a higher
# load or the ceiling ages out. A TTFT over target whose requests hardly waited is prefill-bound (long prompts):
# more replicas do not shorten a prefill, so it neither lowers the ceiling nor adds replicas.

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvfleet_operator.autoscaling.decision import Capacity, Flow, Line, Observation

SAMPLE_WINDOW_S = 1800.0  # samples kept for the fit: half an hour, across several load levels
MIN_SAMPLES = 8  # two minutes of 15 s rounds
MIN_SPREAD = 0.15  # the samples' load must vary by this share of its mean (std/mean) to fit a slope
HALF_LIFE_S = 600.0  # a sample ten minutes old weighs half a new one
ASSUMED_UTILISATION = 1 / 3  # without a fit: the current load is a third of saturation (local exponent 1.5)
CEILING_TTL_S = 1800.0  # a latency ceiling is forgotten after half an hour without a new breach
# A TTFT over target is prefill-bound when its requests' queue wait (p95) is under this share of the target.
PREFILL_BOUND_SHARE = 0.25
LATENCY_ONLY_UTILISATION = 0.5  # no queue target: size for half of saturation (time in system twice W0)
STEADY = 0.1  # arrivals within this share of completions: the window is in steady state
# Requests per replica below which a queue is float noise, not a load: a point (s, q) with q near zero puts s / q and
# the line through it out of float range (M overflows to inf, w to 0), and Little's law says nothing there.
MIN_QUEUE = 1e-6


@dataclass(frozen=True)
class Demand:
    """The fleet's demand in tokens/s: arrivals (not the served rate, which flattens at capacity) at the window's
    tokens per request, requests held at routers cleared within a round, and the panic window's, if higher."""

    tokens_per_s: float
    requests_per_s: float
    tokens_per_request: float
    served_per_replica: float  # tokens/s each reporting replica served over the window


def demand(obs: Observation, interval: float) -> Demand | None:
    """The demand this round, or None when the flow is unknown or partial (a silent pod's load is unknown)."""
    f = obs.flow
    if f is None or f.pods == 0 or obs.reporting_replicas < obs.ready_replicas:
        return None
    rate = max(f.arrived, _arrived(obs.flow_last))
    rate += obs.held_requests / max(interval, 1.0)
    tau = f.tokens_per_request
    if rate == 0:
        return Demand(0.0, 0.0, tau or 0.0, 0.0)  # nothing arrived: no demand, whatever a request weighs
    if tau is None or tau <= 0:
        return None  # requests arrived but none finished: their weight is unknown yet
    return Demand(rate * tau, rate, tau, (f.prompt_tokens + f.output_tokens) / f.pods)


def _arrived(f: Flow | None) -> float:
    return f.arrived if f is not None else 0.0


def observe(cap: Capacity, obs: Observation, d: Demand | None, now: float, queue_target: float | None) -> Capacity:
    """Add this round's sample (served tokens/s and requests held, per replica) and refit the line."""
    samples = tuple(x for x in cap.samples if x[0] > now - SAMPLE_WINDOW_S)
    point = None
    # Little's law relates averages over one span: the window's served rate goes with the window's mean depth. The
    # newest depth after a burst drained, paired with the burst's service, put points far above the line and
    # flattened its fit (capacity read 1.8x too high, and scale-downs went too deep).
    depth = obs.queue_depth_mean if obs.queue_depth_mean is not None else obs.queue_depth
    if d is not None and depth is not None and obs.reporting_replicas > 0 and steady(obs):
        q = depth / obs.reporting_replicas
        if d.served_per_replica > 0 and q >= MIN_QUEUE:
            point = (d.served_per_replica, q)
            samples = (*samples, (now, *point))
    line = fit(samples, now)
    if line is None:
        line = cap.line if cap.line is not None and cap.line.fitted else (
            assumed(*point, queue_target) if point is not None else cap.line)
    return Capacity(samples, line, cap.ceiling)


def steady(obs: Observation) -> bool:
    """Whether the pods are in steady state over the window, where Little's law holds: the same replicas all
    through it, and arrivals within STEADY of completions (a backlog building up or draining is neither the load
    nor the capacity)."""
    f = obs.flow
    # A replica that joined within the window took arrivals its first scrape never saw, and the load moved between
    # pods: the balance reads steady while a backlog drains (in the suite's step, a window with 3,168 requests
    # queued read 33 arrivals/s against 31 completions, and its point took the capacity to 57%).
    return (f is not None and f.pods >= obs.reporting_replicas - 1e-9 and f.completed > 0
            and abs(f.arrived - f.completed) <= STEADY * f.completed)


def fit(samples: Sequence[tuple[float, float, float]], now: float) -> Line | None:
    """Weighted least squares of s/q on s; None with too few samples, too little spread in s, or a line that is
    not a saturating one (slope >= 0)."""
    if len(samples) < MIN_SAMPLES:
        return None
    ws = [0.5 ** ((now - t) / HALF_LIFE_S) for t, _, _ in samples]
    total = sum(ws)
    sm = sum(w * s for w, (_, s, _) in zip(ws, samples, strict=True)) / total
    ym = sum(w * s / q for w, (_, s, q) in zip(ws, samples, strict=True)) / total
    sxx = sum(w * (s - sm) ** 2 for w, (_, s, _) in zip(ws, samples, strict=True)) / total
    if sm <= 0 or math.sqrt(sxx) < MIN_SPREAD * sm:
        return None
    slope = sum(w * (s - sm) * (s / q - ym) for w, (_, s, q) in zip(ws, samples, strict=True)) / total / sxx
    intercept = ym - slope * sm
    if slope >= 0 or intercept <= 0:
        return None
    # Saturation is never below what a replica was seen serving.
    m = max(-intercept / slope, 1.05 * max(s for _, s, _ in samples))
    return Line(1 / intercept, m, True)


def assumed(s: float, q: float, queue_target: float | None) -> Line:
    """The line through one point (s, q) on which a replica holding the queue target runs at ASSUMED_UTILISATION
    of saturation (the point itself, without a queue target): w·M = q*·(1-u)/u fixes the second unknown."""
    u = ASSUMED_UTILISATION
    if queue_target is None:
        return Line((1 - u) * q / s, s / u, False)
    k = queue_target * (1 - u) / u  # = w × M
    m = s * (k + q) / q  # from q = s·w / (1 - s/M) with w = k / M
    return Line(k / m, m, False)


def prefill_bound(obs: Observation, target_s: float) -> bool:
    """Whether a TTFT over `target_s` comes from prefill rather than waiting: the wait's p95 is small."""
    return obs.queue_time_p95 is not None and obs.queue_time_p95 < PREFILL_BOUND_SHARE * target_s


def correct(cap: Capacity, served: float | None, breached: bool, met: bool, now: float) -> Capacity:
    """Lower the ceiling to `served` (tokens/s per replica) on a queueing-bound breach; lift it when the targets
    held at a higher load; forget it after CEILING_TTL_S."""
    ceiling = cap.ceiling if cap.ceiling is not None and cap.ceiling[0] > now - CEILING_TTL_S else None
    if served is not None and served > 0:
        if breached:
            ceiling = (now, min(served, ceiling[1]) if ceiling is not None else served)
        elif met and ceiling is not None and served > ceiling[1]:
            ceiling = None
    return Capacity(cap.samples, cap.line, ceiling)


def per_replica(cap: Capacity, queue_target: float | None, margin: float) -> float | None:
    """Tokens/s one replica serves within the targets: the queue target on the line, under the latency ceiling
    less `margin`; None without a line."""
    line = cap.line
    if line is None:
        return None
    at_target = line.at_depth(queue_target) if queue_target is not None else LATENCY_ONLY_UTILISATION * line.m
    if cap.ceiling is not None:
        # Capacity is below the load the breach happened at (one margin), and the margin again as headroom: so a
        # breach at a steady load always asks for more than the replicas that breached.
        at_target = min(at_target, cap.ceiling[1] * (1 - margin) ** 2)
    return at_target
