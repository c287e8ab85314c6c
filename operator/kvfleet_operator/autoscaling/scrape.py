"""Reads agents' /metrics into per-pod snapshots; histogram increases over a window → PromQL-exact quantiles."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvfleet_contract import metrics as contract
from kvfleet_operator.autoscaling.decision import Flow

# Short names (used by autoscaling targets) → the agent's histogram families.
HISTOGRAMS: Mapping[str, str] = contract.LATENCY_TARGETS
# Every histogram a snapshot keeps: the targets', plus the time waiting before prefill (which tells queueing TTFT
# from prefill-bound TTFT).
PARSED: Mapping[str, str] = {**HISTOGRAMS, "queue": contract.QUEUE_TIME}
WAITING, RUNNING = contract.REQUESTS_WAITING, contract.REQUESTS_RUNNING
# Counters a snapshot keeps (kvfleet_requests_total is `requests`): the tokens behind the capacity model.
COUNTERS: Mapping[str, str] = {contract.PROMPT_TOKENS: "prompt_tokens", contract.GENERATION_TOKENS: "generation_tokens"}


class ParseError(ValueError):
    """The body is not a Prometheus exposition carrying the agent's queue gauges."""


@dataclass(frozen=True)
class Histogram:
    """A classic histogram: ascending upper bounds ending at +Inf, cumulative counts, plus _count and _sum."""

    bounds: tuple[float, ...]
    buckets: tuple[float, ...]
    count: float
    sum: float


@dataclass(frozen=True)
class Snapshot:
    """One scrape of one pod: the queue gauges and the latency histograms, at `time` (Unix seconds)."""

    pod: str
    time: float
    waiting: float
    running: float
    histograms: Mapping[str, Histogram] = field(default_factory=dict)  # keyed by PARSED's short names
    requests: float | None = None  # kvfleet_requests_total over every outcome (None: an agent without it)
    prompt_tokens: float | None = None  # kvfleet_prompt_tokens_total (None: absent)
    generation_tokens: float | None = None  # kvfleet_generation_tokens_total (None: absent)
    kv_usage: float | None = None  # kvfleet_kv_cache_usage_ratio (None: absent)

    @property
    def queue_depth(self) -> float:
        """Requests the pod holds: waiting plus running (the queue-depth signal)."""
        return self.waiting + self.running


@dataclass(frozen=True)
class ScrapeResult:
    """Per-pod snapshots of the pods that answered, and an error line for each one that did not."""

    snapshots: Mapping[str, Snapshot]
    errors: Mapping[str, str]


def parse_exposition(text: str, pod: str, at: float, model: str | None = None) -> Snapshot:
    """Parse an agent's text exposition; label sets are summed (one agent serves one model) unless `model` picks one."""
    gauges: dict[str, float] = {}
    counters: dict[str, float] = {}
    parts: dict[str, dict[str, float]] = {short: {} for short in PARSED}
    by_family = {family: short for short, family in PARSED.items()}
    try:
        for fam in text_string_to_metric_families(text):
            short = by_family.get(fam.name)
            if fam.name == contract.REQUESTS or fam.name in COUNTERS:
                counters[fam.name] = sum(s.value for s in fam.samples if s.name.endswith("_total") and (
                    model is None or s.labels.get(contract.MODEL_LABEL) == model))
                continue
            if fam.name not in (WAITING, RUNNING, contract.KV_CACHE_USAGE) and short is None:
                continue
            for s in fam.samples:
                if model is not None and s.labels.get(contract.MODEL_LABEL) != model:
                    continue
                if short is None:
                    gauges[fam.name] = gauges.get(fam.name, 0.0) + s.value
                    continue
                key = s.labels["le"] if s.name.endswith("_bucket") else s.name.rsplit("_", 1)[1]
                if s.name.endswith(("_bucket", "_count", "_sum")):
                    parts[short][key] = parts[short].get(key, 0.0) + s.value
    except (ValueError, KeyError, IndexError) as e:  # the parser raises ValueError on any malformed line
        raise ParseError(f"not a Prometheus exposition: {e}") from e
    missing = [name for name in (WAITING, RUNNING) if name not in gauges]
    if missing:
        raise ParseError(f"missing {', '.join(missing)}")
    hists = {short: h for short, p in parts.items() if (h := _histogram(p)) is not None}
    return Snapshot(pod, at, gauges[WAITING], gauges[RUNNING], hists, counters.get(contract.REQUESTS),
                    **{field_: counters[fam] for fam, field_ in COUNTERS.items() if fam in counters},
                    kv_usage=gauges.get(contract.KV_CACHE_USAGE))


def _histogram(parts: Mapping[str, float]) -> Histogram | None:
    """Assemble bucket/_count/_sum samples; None when the family was absent (nothing to report yet)."""
    les = {k: v for k, v in parts.items() if k not in ("count", "sum")}
    if not les:
        return None
    try:
        ordered = sorted((float(le), v) for le, v in les.items())
    except ValueError as e:
        raise ParseError(f"bad le label: {e}") from e
    if not math.isinf(ordered[-1][0]):
        raise ParseError("histogram without a +Inf bucket")
    return Histogram(tuple(b for b, _ in ordered), tuple(v for _, v in ordered),
                     parts.get("count", ordered[-1][1]), parts.get("sum", 0.0))


async def scrape_pods(pods: Sequence[tuple[str, str]], timeout: float = 2.0, model: str | None = None,
                      clock: Callable[[], float] = time.time) -> ScrapeResult:
    """GET every (name, url) concurrently; a slow, failing or garbled pod becomes an error entry, never an exception."""
    snapshots: dict[str, Snapshot] = {}
    errors: dict[str, str] = {}
    budget = aiohttp.ClientTimeout(total=timeout)

    async def one(session: aiohttp.ClientSession, name: str, url: str) -> None:
        try:
            async with session.get(url) as resp:
                if resp.status != 200:
                    errors[name] = f"HTTP {resp.status}"
                    return
                body = await resp.text(errors="replace")
            snapshots[name] = parse_exposition(body, name, clock(), model)
        except TimeoutError:  # asyncio.TimeoutError is TimeoutError from 3.11
            errors[name] = f"timeout after {timeout:g}s"
        except ParseError as e:
            errors[name] = f"parse: {e}"
        except aiohttp.ClientError as e:
            errors[name] = f"{type(e).__name__}: {e}"

    async with aiohttp.ClientSession(timeout=budget) as session:
        await asyncio.gather(*(one(session, name, url) for name, url in pods))
    return ScrapeResult(snapshots, errors)


def bucket_quantile(q: float, bounds: Sequence[float], buckets: Sequence[float]) -> float:
    """PromQL's histogram_quantile over cumulative buckets (promql/quantile.go BucketQuantile), NaN when undefined."""
    if math.isnan(q):
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    if len(bounds) < 2 or not math.isinf(bounds[-1]):
        return math.nan
    counts = list(buckets)
    for i in range(1, len(counts)):  # PromQL forces monotonicity (buckets summed across resets can dip)
        counts[i] = max(counts[i], counts[i - 1])
    observations = counts[-1]
    if observations == 0:
        return math.nan
    rank = q * observations
    b = next((i for i in range(len(counts) - 1) if counts[i] >= rank), len(counts) - 1)
    if b == len(counts) - 1:  # in the +Inf bucket: the highest finite bound is the best we know
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start, end, count = 0.0, bounds[b], counts[b]
    if b > 0:
        start, count, rank = bounds[b - 1], count - counts[b - 1], rank - counts[b - 1]
    if count == 0:  # only for q == 0 over an empty lowest bucket; Go's 0/0 gives NaN too
        return math.nan
    return start + (end - start) * (rank / count)


class MetricsWindow:
    """Per-pod snapshot history; increases over the last `seconds`, summed across pods, and quantiles of them.

    A pod's increase runs from its oldest sample inside the window (so a pod new to the window counts from
    its first sample) to its newest. A drop in _count or in any bucket means the pod restarted: the counter
    starts again from 0, so the new value is the increase since then (PromQL's increase() rule). There is no
    extrapolation to the window's edges: quantiles depend on the buckets' ratios, not their scale.
    """

    def __init__(self, seconds: float = 60.0) -> None:
        self.seconds = seconds
        self._history: dict[str, deque[Snapshot]] = {}
        self._previous: dict[str, Snapshot] = {}  # the sample before each pod's newest, even out of the window

    def update(self, snapshots: Iterable[Snapshot], live: Collection[str] | None = None,
               now: float | None = None) -> None:
        """Add snapshots; forget pods not in `live` (deleted or replaced); drop samples older than the window."""
        for s in snapshots:
            hist = self._history.setdefault(s.pod, deque())
            if not hist or s.time > hist[-1].time:
                if hist:
                    self._previous[s.pod] = hist[-1]
                hist.append(s)
        if live is not None:
            for pod in [p for p in self._history if p not in live]:
                del self._history[pod]
        latest = max((h[-1].time for h in self._history.values() if h), default=0.0)
        cutoff = (latest if now is None else now) - self.seconds
        for hist in self._history.values():
            while hist and hist[0].time < cutoff:
                hist.popleft()
        for pod in [p for p, h in self._history.items() if not h]:
            del self._history[pod]
        for pod in [p for p in self._previous if p not in self._history]:
            del self._previous[pod]

    def pods(self) -> set[str]:
        """Pods with at least one sample in the window."""
        return set(self._history)

    def queue_depth(self) -> float:
        """Waiting plus running summed over each pod's newest sample."""
        return sum(h[-1].queue_depth for h in self._history.values())

    def mean_queue_depth(self) -> float:
        """Waiting plus running averaged over each pod's samples in the window, summed across pods."""
        return sum(sum(s.queue_depth for s in h) / len(h) for h in self._history.values())

    def queue_signal(self) -> float:
        """The lower of the window's mean and the newest sum. decide() now takes both (Observation.queue_depth
        and queue_depth_mean: up on the lower, down on the higher); passing only this one still works, but then
        scale-down acts on the lower value too."""
        return min(self.mean_queue_depth(), self.queue_depth())

    def increase(self, metric: str, last: bool = False) -> Histogram | None:
        """Bucket, _count and _sum increases over the window (`last`: over each pod's last scrape interval only),
        summed across pods; None when no pod has two samples."""
        total: dict[float, float] = {}
        count = sum_ = 0.0
        seen = False
        for hist in self._history.values():
            samples = [s.histograms[metric] for s in hist if metric in s.histograms][-2 if last else 0:]
            if len(samples) < 2:
                continue
            seen = True
            inc = _increase(samples)
            for bound, v in zip(inc.bounds, inc.buckets, strict=True):
                total[bound] = total.get(bound, 0.0) + v
            count, sum_ = count + inc.count, sum_ + inc.sum
        if not seen:
            return None
        bounds = tuple(sorted(total))
        return Histogram(bounds, tuple(total[b] for b in bounds), count, sum_)

    def request_rate(self, metric: str = "ttft") -> float | None:
        """Observations per second of `metric` over each pod's last scrape interval, summed across pods: for TTFT,
        the requests that got their first token (admitted demand, whatever the replica count). None unless every
        pod in the window has two samples: a pod new to the window would read as a dip."""
        total = 0.0
        for hist in self._history.values():
            samples = [s for s in hist if metric in s.histograms][-2:]
            if len(samples) < 2 or samples[1].time <= samples[0].time:
                return None
            inc = _increase([samples[0].histograms[metric], samples[1].histograms[metric]])
            total += inc.count / (samples[1].time - samples[0].time)
        return total if self._history else None

    def arrivals(self) -> float | None:
        """Requests finished or refused over each pod's last scrape interval (kvfleet_requests_total's increase,
        from 0 after a restart), summed across pods: with waiting + running at 0 now, 0 means none arrived in that
        interval. None unless every pod has two samples with the counter (the older may predate the window)."""
        total = 0.0
        for pod, hist in self._history.items():
            previous = self._previous.get(pod)
            before, after = (previous.requests, hist[-1].requests) if previous is not None else (None, None)
            if before is None or after is None:
                return None
            total += _counter_increase(before, after)
        return total if self._history else None

    def flow(self, last: bool = False) -> Flow | None:
        """Requests and tokens per second through the reporting pods over the window (`last`: each pod's last scrape
        interval): fleet totals over the longest pod's span. A pod with one sample so far (it just became ready) is
        left out; `pods` is the replicas' worth the figures cover (pod-seconds over the span). None when no pod has
        two samples, or one lacks the request counter. Arrivals are completions plus the rise of what the pods hold
        (Little's balance): the demand, not the served rate."""
        spans: list[tuple[float, float, float, float, float]] = []  # span, finished, arrived, prompt, output
        for pod, hist in self._history.items():
            a, b = (self._previous.get(pod), hist[-1]) if last else (hist[0], hist[-1])
            if a is None or b is None or a is b or b.time <= a.time:
                continue
            if a.requests is None or b.requests is None:
                return None
            finished = _counter_increase(a.requests, b.requests)
            prompt = output = 0.0
            if a.prompt_tokens is not None and b.prompt_tokens is not None:
                prompt = _counter_increase(a.prompt_tokens, b.prompt_tokens)
            if a.generation_tokens is not None and b.generation_tokens is not None:
                output = _counter_increase(a.generation_tokens, b.generation_tokens)
            spans.append((b.time - a.time, finished, max(finished + b.queue_depth - a.queue_depth, 0.0), prompt,
                          output))
        if not spans:
            return None
        # One span for the fleet: a pod that became ready within it had no traffic before. Summing each pod's own
        # rate counted a new pod's share of the load over its short span while the old pods' spans still held the
        # load they carried before it came: the router sends a new replica most arrivals, so every scale-up read
        # as a jump in demand (1.4-1.5x the true arrivals in the suite's step) and ordered replicas it did not need.
        span = max(x[0] for x in spans)
        done, arrived, prompt, output = (sum(x[i] for x in spans) / span for i in range(1, 5))
        return Flow(done, arrived, prompt, output, sum(x[0] for x in spans) / span)

    def quantile(self, metric: str, q: float, last: bool = False) -> float | None:
        """histogram_quantile(q, sum by (le) (increase(metric_bucket[window]))); None when nothing was observed.
        With `last`, over the last scrape interval instead of the window."""
        inc = self.increase(metric, last)
        if inc is None:
            return None
        value = bucket_quantile(q, inc.bounds, inc.buckets)
        return None if math.isnan(value) else value

    def latency(self, metric: str, q: float) -> float | None:
        """The signal the autoscaler uses: the lower of the window's quantile and the last interval's. A rise must
        show in both (one noisy interval does not scale up); a recovery shows at once (a spike that has passed
        does not hold replicas for another window)."""
        values = [v for v in (self.quantile(metric, q), self.quantile(metric, q, last=True)) if v is not None]
        return min(values) if values else None


def _counter_increase(before: float, after: float) -> float:
    """A counter's increase, from 0 after a restart (PromQL's increase() rule)."""
    return after - before if after >= before else after


def _increase(samples: Sequence[Histogram]) -> Histogram:
    """One pod's increase across consecutive samples, restarting from 0 wherever the pod's counters went down."""
    bounds = samples[-1].bounds
    buckets = [0.0] * len(bounds)
    count = sum_ = 0.0
    for prev, cur in itertools.pairwise(samples):
        reset = cur.count < prev.count or cur.bounds != prev.bounds or any(
            c < p for c, p in zip(cur.buckets, prev.buckets, strict=True))
        base_b = [0.0] * len(cur.buckets) if reset else prev.buckets
        count += cur.count - (0.0 if reset else prev.count)
        sum_ += cur.sum - (0.0 if reset else prev.sum)
        if cur.bounds == bounds:
            buckets = [acc + c - b for acc, c, b in zip(buckets, cur.buckets, base_b, strict=True)]
    return Histogram(bounds, tuple(buckets), count, sum_)
