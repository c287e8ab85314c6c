"""A simulated kvfleet agent: continuous batching with chunked prefill, advanced as a fluid between events."""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass

from kvfleet_contract import metrics as contract
from kvfleet_operator.autoscaling.scrape import PARSED, Histogram, Snapshot

EPS = 1e-6  # tokens: far above float error at simulated times of hours, far below one token


@dataclass(frozen=True)
class ReplicaModel:
    """One replica's speed. A step runs every decoding sequence one token plus a prefill chunk that fills the
    token budget; its time is step_base_s + step_per_decode_s × decodes + step_per_prefill_token_s × chunk."""

    max_num_seqs: int = 128
    token_budget: int = 512
    step_base_s: float = 0.012
    step_per_decode_s: float = 0.0001
    step_per_prefill_token_s: float = 1 / 20000
    startup_min_s: float = 60.0
    startup_max_s: float = 120.0


# gpu-8b: an 8B-class model in bf16 on one H100-class GPU. Step base ~12 ms (16 GB of weights at ~3 TB/s plus
# overheads), ~0.1 ms per decoding sequence (~1k tokens of KV each), prefill ~20k tokens/s (16 GFLOP a token
# at ~40% of ~800 TFLOP/s); startup 60-120 s (weights from a node-local cache, CUDA graphs, warm-up).
# Order-of-magnitude figures from public vLLM-class measurements, not measured here (no GPU was lent).
# cpu-tiny: kvfleet's own CPU figures in BENCHMARKS.md (tiny 40M model, 2 cores): ITL ~12 ms at low load
# (base ~10 ms), ~1000 tok/s offline at 64 sequences (~0.85 ms each), TTFT ~110 ms for ~130-token prompts.
PRESETS = {
    "gpu-8b": ReplicaModel(),
    "cpu-tiny": ReplicaModel(max_num_seqs=128, token_budget=1024, step_base_s=0.010, step_per_decode_s=0.00085,
                             step_per_prefill_token_s=1 / 1500, startup_min_s=5.0, startup_max_s=15.0),
}


class Request:
    """One request and its timeline (None until it happens)."""

    __slots__ = ("arrival", "decode_start", "finish", "first_token", "output", "prefill_left", "prefill_start",
                 "prompt")

    def __init__(self, arrival: float, prompt: int, output: int) -> None:
        self.arrival, self.prompt, self.output = arrival, prompt, output
        self.prefill_left = float(prompt)
        self.prefill_start: float | None = None  # when it became the head of the prefill FIFO
        self.first_token: float | None = None
        self.decode_start = 0.0
        self.finish: float | None = None


class _Hist:
    """Non-cumulative bucket counts (last one is +Inf), as the agent's prometheus_client histograms keep them."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.count, self.sum = 0, 0.0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += n  # le semantics: value <= bound
        self.count += n
        self.sum += value * n

    def cumulative(self) -> Histogram:
        acc, out = 0, []
        for c in self.counts:
            acc += c
            out.append(float(acc))
        return Histogram((*self.bounds, float("inf")), tuple(out), float(self.count), self.sum)


class Replica:
    """A pod: starting until ready_at, then serving; draining (no new requests) once deleted while ready.

    Between events every rate is constant: decoding sequences share a virtual clock `v` (tokens generated each)
    that advances one token per step, and the prefill FIFO drains at chunk/step tokens per second.
    """

    def __init__(self, name: str, model: ReplicaModel, created: float, ready_at: float) -> None:
        self.name, self.model, self.created, self.ready_at = name, model, created, ready_at
        self.ready = self.draining = False
        self.pending_until = created  # later than created: Pending (unschedulable) until then, holding no GPU
        self.waiting: deque[Request] = deque()
        self.prefill: deque[Request] = deque()
        self.backlog = 0.0  # prompt tokens left in the prefill FIFO
        self.decoding: list[tuple[float, int, Request]] = []  # (v at which it finishes, tiebreak, request)
        self.v = self.last = 0.0
        self.decode_rate = self.prefill_rate = 0.0
        self.version = 0  # bumps on every reschedule; events carrying an older version are stale
        self._seq = 0
        # The agent's histograms: ttft, itl, e2e, and queue (kvfleet_request_queue_time_seconds: arrival → prefill
        # start, observed when the request becomes the head of the prefill FIFO).
        self.hists = {short: _Hist(contract.BUCKETS[family]) for short, family in PARSED.items()}
        # The agent's counters: kvfleet_requests_total (finished requests; nothing is refused here), prompt tokens
        # (counted when a request's prefill completes) and generation tokens (its output length, at its finish).
        self.completed = self.prompt_tokens = self.generation_tokens = 0

    @property
    def load(self) -> int:
        """Requests held: waiting plus running (the queue-depth gauge pair)."""
        return len(self.waiting) + len(self.prefill) + len(self.decoding)

    @property
    def running(self) -> int:
        """Sequences holding a slot: in the prefill FIFO or decoding."""
        return len(self.prefill) + len(self.decoding)

    @property
    def kv_usage(self) -> float:
        """A proxy for kvfleet_kv_cache_usage_ratio: slots held / max_num_seqs. KV blocks are not modelled (a real
        cache fills with context length too, so long prompts would read higher than this)."""
        return self.running / self.model.max_num_seqs

    def snapshot(self, now: float) -> Snapshot:
        """What a scrape of this pod's /metrics would parse to."""
        hists = {short: h.cumulative() for short, h in self.hists.items() if short in PARSED}
        return Snapshot(self.name, now, float(len(self.waiting)), float(self.running), hists,
                        requests=float(self.completed), prompt_tokens=float(self.prompt_tokens),
                        generation_tokens=float(self.generation_tokens), kv_usage=self.kv_usage)

    def add(self, req: Request, now: float) -> float | None:
        """Accept a request; returns the time of this replica's next internal event."""
        self._advance(now)
        self.waiting.append(req)
        return self._settle(now, [])

    def step_events(self, now: float, done: list[Request]) -> float | None:
        """Process what completes at `now`, appending finished requests to `done`; returns the next event time."""
        self._advance(now)
        return self._settle(now, done)

    def _advance(self, now: float) -> None:
        dt = now - self.last
        self.last = now
        if dt <= 0:
            return
        self.v += dt * self.decode_rate
        budget = dt * self.prefill_rate
        for req in self.prefill:  # FIFO: the head takes the whole chunk rate until it is done
            if budget <= EPS:
                break
            used = min(req.prefill_left, budget)
            req.prefill_left -= used
            self.backlog -= used
            budget -= used

    def _settle(self, now: float, done: list[Request]) -> float | None:
        m = self.model
        while self.prefill and self.prefill[0].prefill_left <= EPS:
            req = self.prefill.popleft()
            req.first_token = now
            self.prompt_tokens += req.prompt
            self.hists["ttft"].observe(now - req.arrival)
            if req.output <= 1:
                self._finish(req, now, done)
            else:
                req.decode_start = now
                self._seq += 1
                heapq.heappush(self.decoding, (self.v + req.output - 1, self._seq, req))
        if not self.prefill:
            self.backlog = 0.0
        elif self.backlog <= EPS:  # float drift of the running total must not stall a non-empty FIFO
            self.backlog = sum(r.prefill_left for r in self.prefill)
        while self.decoding and self.decoding[0][0] <= self.v + EPS:
            self._finish(heapq.heappop(self.decoding)[2], now, done)
        while self.waiting and len(self.prefill) + len(self.decoding) < m.max_num_seqs:
            req = self.waiting.popleft()
            self.prefill.append(req)
            self.backlog += req.prefill_left
        if self.prefill and self.prefill[0].prefill_start is None:  # a new head: its prefill starts now
            head = self.prefill[0]
            head.prefill_start = now
            self.hists["queue"].observe(now - head.arrival)
        n_dec = len(self.decoding)
        chunk = min(max(m.token_budget - n_dec, 0), self.backlog)
        step = m.step_base_s + m.step_per_decode_s * n_dec + m.step_per_prefill_token_s * chunk
        self.decode_rate = 1.0 / step
        self.prefill_rate = chunk / step
        self.version += 1
        nxt = None
        if self.prefill and self.prefill_rate > 0:
            nxt = now + self.prefill[0].prefill_left / self.prefill_rate
        if self.decoding:
            t = now + (self.decoding[0][0] - self.v) / self.decode_rate
            nxt = t if nxt is None else min(nxt, t)
        return nxt

    def _finish(self, req: Request, now: float, done: list[Request]) -> None:
        req.finish = now
        self.completed += 1
        self.generation_tokens += req.output
        if req.output > 1:  # the fluid gives each request its mean gap; observed once per gap like the agent
            self.hists["itl"].observe((now - req.decode_start) / (req.output - 1), req.output - 1)
        self.hists["e2e"].observe(now - req.arrival)
        done.append(req)
