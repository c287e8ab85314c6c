"""Load generator for OpenAI-compatible streaming completion servers (`kvfleet-agent bench serve`)."""

from __future__ import annotations

import argparse
import asyncio
import codecs
import collections
import contextlib
import datetime as dt
import email.utils
import importlib.util
import itertools
import json
import math
import re
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import numpy as np

from kvfleet_agent.bench.report import RequestRecord, Slo, format_table, summarize, write_plot

__all__ = [
    "WORDS",
    "BenchConfig",
    "BenchResult",
    "HttpSender",
    "LengthDist",
    "RequestRecord",
    "RequestSpec",
    "RunOutcome",
    "SSEEvent",
    "SSEParser",
    "Slo",
    "StreamState",
    "add_arguments",
    "arrival_schedule",
    "config_from_args",
    "file_requests",
    "load_prompt_file",
    "main",
    "parse_retry_after",
    "poisson_arrivals",
    "run_benchmark",
    "run_load",
    "synthetic_requests",
]

# Common short English words: almost all are a single token (with their leading space) in the usual BPE
# vocabularies, so a prompt of N words is about N tokens whatever model the server runs.
_WORD_TEXT = """
the of and to in is it you that he was for on are with as his they be at one have this from or had by word but what
some we can out other were all there when up use your how said an each she which do their time if will way about many
then them write would like so these her long make thing see him two has look more day could go come did number sound no
most people my over know water than call first who may down side been now find any new work part take get place made
live where after back little only round man year came show every good me give our under name very through just form
great think say help low line turn cause much mean before move right boy old too same tell does set three want air well
also play small end put home read hand port large add even land here must big high such follow act why ask men change
went light kind off need house picture try us again animal point mother world near build self earth father head stand
own page should country found answer school grow study still learn plant cover food sun four between state keep eye
never last let thought city tree cross farm hard start might story saw far sea draw left late run while press close
night real life few north open seem together next white children begin got walk example paper group always music those
both mark often letter until mile river car feet care second book carry took science eat room friend began idea fish
mountain stop once base hear horse cut sure watch color face wood main enough plain girl usual young ready above ever
red list though feel talk bird soon body dog family direct leave song measure door product black short class wind
question happen complete ship area half rock order fire south problem piece told knew pass since top whole king space
heard best hour better true during hundred five remember step early hold west ground interest reach fast sing listen
six table travel less morning ten simple several toward war lay against pattern slow center love person money serve
appear road map rain rule pull cold notice voice unit power town fine certain fly fall lead cry dark machine note wait
plan figure star box field rest correct able pound done drive stood front teach week final gave green quick develop
ocean warm free minute strong special mind behind clear tail produce fact street inch nothing course stay wheel full
force blue object decide surface deep moon island foot system busy test record boat common gold possible plane dry
wonder laugh thousand ago ran check game shape hot miss brought heat snow tire bring yes distant fill east paint
language among"""
WORDS: tuple[str, ...] = tuple(dict.fromkeys(_WORD_TEXT.split()))

# Independent random streams per purpose, so that e.g. changing the request rate leaves the prompts unchanged.
_PROMPT_STREAM = 1
_ARRIVAL_STREAM = 2


# ----------------------------------------------------------------------------------------------------------------
# Requests and arrivals (pure)


@dataclass(frozen=True)
class LengthDist:
    """Integer lengths in [lo, hi] with mean `mean`: a Beta(2p, 2(1-p)) scaled onto the range.

    That is the uniform distribution when the mean is the range's midpoint and skews towards the mean
    otherwise, so --x MEAN --x-range LO HI means what it says for any MEAN inside the range.
    """

    mean: float
    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not 1 <= self.lo <= self.mean <= self.hi:
            raise ValueError(f"need 1 <= LO <= MEAN <= HI, got LO={self.lo} MEAN={self.mean} HI={self.hi}")

    @classmethod
    def build(cls, mean: float | None, bounds: list[int] | None, default: int) -> LengthDist:
        if bounds is None:
            m = int(default if mean is None else mean)
            return cls(m, m, m)
        lo, hi = bounds
        return cls((lo + hi) / 2 if mean is None else mean, lo, hi)

    def sample(self, rng: np.random.Generator) -> int:
        span = self.hi - self.lo
        p = (self.mean - self.lo) / span if span else 0.0
        if p <= 0.0:
            return self.lo
        if p >= 1.0:
            return self.hi
        return self.lo + round(float(rng.beta(2 * p, 2 * (1 - p))) * span)

    def to_json(self) -> dict[str, float]:
        return {"mean": self.mean, "lo": self.lo, "hi": self.hi}


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: the prompt and its max_tokens."""

    index: int
    prompt: str
    max_tokens: int
    prompt_words: int | None = None  # synthetic prompts only


def synthetic_requests(seed: int, prompt_len: LengthDist, max_tokens: LengthDist) -> Iterator[RequestSpec]:
    """Endless random-word prompts, the same for the same seed and lengths."""
    rng = np.random.default_rng([seed, _PROMPT_STREAM])
    for i in itertools.count():
        n = prompt_len.sample(rng)
        m = max_tokens.sample(rng)
        words = rng.integers(0, len(WORDS), size=n)
        yield RequestSpec(i, " ".join(WORDS[int(w)] for w in words), m, n)


def load_prompt_file(path: str) -> list[tuple[str, int | None]]:
    """(prompt, max_tokens or None) from a JSONL file of {"prompt": str, "max_tokens": int (optional)}."""
    entries: list[tuple[str, int | None]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ValueError(f"{path}:{lineno}: expected an object with a string \"prompt\"")
            mt = obj.get("max_tokens")
            if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt < 1):
                raise ValueError(f"{path}:{lineno}: \"max_tokens\" must be a positive integer")
            entries.append((obj["prompt"], mt))
    if not entries:
        raise ValueError(f"{path}: no prompts")
    return entries


def file_requests(entries: list[tuple[str, int | None]], seed: int, max_tokens: LengthDist) -> Iterator[RequestSpec]:
    """The file's prompts in order, cycled; entries without max_tokens draw it from max_tokens."""
    rng = np.random.default_rng([seed, _PROMPT_STREAM])
    for i, (prompt, mt) in zip(itertools.count(), itertools.cycle(entries), strict=False):
        yield RequestSpec(i, prompt, mt if mt is not None else max_tokens.sample(rng))


def poisson_arrivals(rate: float, seed: int) -> Iterator[float]:
    """Endless arrival times (seconds from the start) of a Poisson process of `rate` per second; inf: all at 0."""
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if math.isinf(rate):
        yield from itertools.repeat(0.0)
        return
    rng = np.random.default_rng([seed, _ARRIVAL_STREAM])
    t = 0.0
    while True:
        for gap in rng.exponential(1.0 / rate, size=1024):  # drawn in blocks: one numpy call per 1024 arrivals
            t += float(gap)
            yield t


def arrival_schedule(n: int, rate: float, seed: int) -> list[float]:
    """The first n arrival times of poisson_arrivals."""
    return list(itertools.islice(poisson_arrivals(rate, seed), n))


# ----------------------------------------------------------------------------------------------------------------
# Server-Sent Events and the completion stream (pure)


@dataclass(frozen=True)
class SSEEvent:
    data: str
    event: str = "message"


_EOL = re.compile(r"\r\n|\r|\n")


class SSEParser:
    """Incremental Server-Sent Events parser: feed it bytes as they arrive, get the complete events.

    Follows the WHATWG rules a completion stream needs: CR, LF and CRLF line ends (even split across
    reads), comment lines (keep-alives), multi-line data joined with newlines, events ending at a blank
    line. The id and retry fields are ignored: a completion stream is never resumed.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""
        self._data: list[str] = []
        self._event = ""

    def feed(self, chunk: bytes | str) -> list[SSEEvent]:
        self._buf += self._decoder.decode(chunk) if isinstance(chunk, bytes) else chunk
        events: list[SSEEvent] = []
        pos = 0
        while (m := _EOL.search(self._buf, pos)) is not None:
            if m.group() == "\r" and m.end() == len(self._buf):
                break  # may be the first half of a CRLF whose LF is in the next read
            ev = self._line(self._buf[pos:m.start()])
            pos = m.end()
            if ev is not None:
                events.append(ev)
        self._buf = self._buf[pos:]
        return events

    def close(self) -> list[SSEEvent]:
        """End of stream: what is left, including a last event without its blank line (a lenient reading)."""
        events = self.feed(self._decoder.decode(b"", final=True))
        if self._buf.endswith("\r"):
            self._buf = self._buf[:-1] + "\n"
            events += self.feed("")
        if self._buf:
            ev = self._line(self._buf)
            self._buf = ""
            if ev is not None:
                events.append(ev)
        if (ev := self._line("")) is not None:
            events.append(ev)
        return events

    def _line(self, line: str) -> SSEEvent | None:
        if not line:
            ev = SSEEvent("\n".join(self._data), self._event or "message") if self._data else None
            self._data, self._event = [], ""
            return ev
        if line.startswith(":"):
            return None
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        return None


@dataclass
class StreamState:
    """Timing and token accounting of one streamed completion, fed the data of each SSE event.

    Content chunks are those with non-empty text: the first one's arrival is the TTFT, and the gaps
    between successive ones are the inter-token latencies. When the server reports usage on every chunk
    (vLLM's continuous usage stats), a chunk that carries k tokens contributes k gaps of gap/k each, and
    tokens of chunks without text (held back by a detokenizer) are added to the next content chunk.
    """

    start: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    counted_tokens: int = 0
    usage_tokens: int | None = None
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    done: bool = False
    error: str | None = None
    last_time: float | None = None
    _continuous: bool | None = None  # usage on every chunk? decided by the first chunk that tells
    _cum_tokens: int = 0
    _pending_tokens: int = 0
    _last_content: float | None = None

    @property
    def output_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.counted_tokens

    @property
    def complete(self) -> bool:
        return self.done or self.finish_reason is not None

    def on_data(self, data: str, now: float) -> None:
        self.last_time = now
        if data.strip() == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            self.error = f"bad SSE data: {data[:200]!r}"
            return
        if not isinstance(obj, dict):
            self.error = f"bad SSE data: {data[:200]!r}"
            return
        if "error" in obj or obj.get("object") == "error":
            err = obj.get("error", obj)
            self.error = str(err.get("message", err) if isinstance(err, dict) else err)[:500]
            return
        choices = [c for c in obj.get("choices") or [] if isinstance(c, dict)]
        text = "".join(c["text"] for c in choices if isinstance(c.get("text"), str))
        for c in choices:
            if c.get("finish_reason") is not None:
                self.finish_reason = str(c["finish_reason"])
        delta = 0
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage_tokens = usage["completion_tokens"]
            if isinstance(usage.get("prompt_tokens"), int):
                self.prompt_tokens = usage["prompt_tokens"]
            if choices and self._continuous is not False:
                self._continuous = True
                delta = self.usage_tokens - self._cum_tokens
                self._cum_tokens = self.usage_tokens
        if not text:
            if self._continuous:
                self._pending_tokens += delta
            return
        if self._continuous is None:
            # A content chunk without usage: the server reports usage at the end only, if at all.
            self._continuous = False
        k = max(self._pending_tokens + delta, 1) if self._continuous else 1
        self._pending_tokens = 0
        self.counted_tokens += k
        if self.ttft_s is None:
            self.ttft_s = now - self.start  # tokens beyond the first that came with it add no gap
        else:
            assert self._last_content is not None
            gap = (now - self._last_content) / k
            self.itl_s.extend([gap] * k)
        self._last_content = now


def parse_retry_after(value: str | None, now: dt.datetime | None = None) -> float | None:
    """Seconds to wait from a Retry-After header (delay-seconds or an HTTP date); None if absent or unreadable."""
    if value is None:
        return None
    v = value.strip()
    try:
        seconds = float(v)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(v)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=dt.UTC)
        seconds = (when - (now or dt.datetime.now(dt.UTC))).total_seconds()
    return max(seconds, 0.0) if math.isfinite(seconds) else None


# ----------------------------------------------------------------------------------------------------------------
# The run: arrivals, bounds, cancellation (async, transport-agnostic)

Sender = Callable[[RequestSpec, RequestRecord], Awaitable[None]]
StopReason = Literal["num_requests", "duration", "timeout"]


@dataclass
class RunOutcome:
    records: list[RequestRecord]
    t0: float
    duration_s: float
    stop_reason: StopReason


async def run_load(
    requests: Iterable[RequestSpec],
    send: Sender,
    *,
    request_rate: float | None = None,
    concurrency: int | None = None,
    seed: int = 0,
    num_requests: int | None = None,
    duration_s: float | None = None,
    timeout_s: float | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> RunOutcome:
    """Issue requests open loop (Poisson at request_rate) or closed loop (concurrency in flight) until a bound.

    Issuing stops after num_requests or at duration_s, whichever comes first; at duration_s (or the
    hard timeout_s) requests still in flight are cancelled and recorded as cancelled. send fills in each
    record; the runner sets its start, end and, when it is cancelled or raises, its status.
    In closed loop a 429's Retry-After keeps its slot closed for that long; in open loop the arrival
    process is the experiment, so it is not bent by the server's advice.
    """
    if (request_rate is None) == (concurrency is None):
        raise ValueError("give exactly one of request_rate (open loop) and concurrency (closed loop)")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    if request_rate is not None and math.isinf(request_rate) and num_requests is None:
        raise ValueError("an infinite request rate needs a number of requests")
    if num_requests is None and duration_s is None and timeout_s is None:
        raise ValueError("unbounded run: give num_requests, duration_s or timeout_s")

    specs: Iterable[RequestSpec] = requests if num_requests is None else itertools.islice(requests, num_requests)
    records: list[RequestRecord] = []
    inflight: set[asyncio.Task[None]] = set()
    bounds = [b for b in (duration_s, timeout_s) if b is not None]
    bound = min(bounds) if bounds else math.inf
    bound_reason: StopReason = "duration" if duration_s is not None and duration_s == bound else "timeout"
    loop = asyncio.get_running_loop()
    sem = asyncio.Semaphore(concurrency) if concurrency is not None else None
    reopen: list[asyncio.TimerHandle] = []
    t0 = time.perf_counter()

    async def one(spec: RequestSpec, rec: RequestRecord) -> None:
        rec.start = time.perf_counter()
        try:
            await send(spec, rec)
            if rec.status == "pending":
                rec.status, rec.error = "failed", "sender set no status"
        except asyncio.CancelledError:
            rec.status = "cancelled"
            raise
        except Exception as e:  # a sender bug must not stop the run; it shows as a failed request
            rec.status, rec.error = "failed", f"{type(e).__name__}: {e}"
        finally:
            if rec.end is None:
                rec.end = time.perf_counter()
            if sem is not None:
                wait = rec.retry_after_s if rec.status == "rejected" else None
                if wait:
                    reopen.append(loop.call_later(wait, sem.release))
                else:
                    sem.release()
            if on_done is not None:
                on_done(rec)

    def issue(spec: RequestSpec, scheduled_s: float) -> None:
        rec = RequestRecord(spec.index, scheduled_s, prompt_words=spec.prompt_words, max_tokens=spec.max_tokens)
        records.append(rec)
        task = asyncio.create_task(one(spec, rec))
        inflight.add(task)
        task.add_done_callback(inflight.discard)

    exhausted = True  # issuing stopped because the requests ran out (num_requests), not at a time bound

    async def dispatch() -> None:
        nonlocal exhausted
        if sem is not None:
            for spec in specs:
                await sem.acquire()
                issue(spec, time.perf_counter() - t0)
            return
        assert request_rate is not None
        for spec, at in zip(specs, poisson_arrivals(request_rate, seed), strict=False):
            if at >= bound:
                exhausted = False  # the next arrival falls after the time bound: it is never issued
                return
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            issue(spec, at)

    dispatcher = asyncio.create_task(dispatch())
    try:
        done, _ = await asyncio.wait({dispatcher}, timeout=max(0.0, t0 + bound - time.perf_counter())
                                     if math.isfinite(bound) else None)
        if dispatcher in done:
            dispatcher.result()  # re-raise a failure of the dispatcher itself
        else:
            exhausted = False
            dispatcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await dispatcher
        if inflight:
            remaining = max(0.0, t0 + bound - time.perf_counter()) if math.isfinite(bound) else None
            _, pending = await asyncio.wait(set(inflight), timeout=remaining)
            if pending:
                exhausted = False
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
    finally:
        # After a normal end nothing is left here; after our own failure or a cancellation from outside
        # (Ctrl-C), this leaves no request running behind us.
        if not dispatcher.done():
            dispatcher.cancel()
        for task in list(inflight):
            task.cancel()
        if inflight:
            await asyncio.gather(*inflight, return_exceptions=True)
        for h in reopen:
            h.cancel()
    ends = [r.end for r in records if r.end is not None]
    t_end = max(ends) if ends else time.perf_counter()
    return RunOutcome(records, t0, max(t_end - t0, 0.0), "num_requests" if exhausted else bound_reason)


# ----------------------------------------------------------------------------------------------------------------
# HTTP


class HttpSender:
    """Sends one streamed /v1/completions request over a shared session and fills in its record."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str, *, temperature: float,
                 ignore_eos: bool, request_timeout_s: float) -> None:
        self.session = session
        self.url = f"{base_url}/v1/completions"
        self.model = model
        self.temperature = temperature
        self.ignore_eos = ignore_eos
        self.request_timeout_s = request_timeout_s

    def payload(self, spec: RequestSpec) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": spec.prompt,
            "max_tokens": spec.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True  # not OpenAI's; vLLM-style servers accept it, so send it only when asked
        return body

    async def __call__(self, spec: RequestSpec, rec: RequestRecord) -> None:
        assert rec.start is not None
        state = StreamState(rec.start)
        try:
            async with asyncio.timeout(self.request_timeout_s):
                await self._stream(spec, rec, state)
        except TimeoutError:
            rec.status, rec.error = "failed", f"request timed out after {self.request_timeout_s:g} s"
        except aiohttp.ClientError as e:
            rec.status, rec.error = "failed", f"{type(e).__name__}: {e}"
        finally:
            # Also on cancellation: a request cut off at the time bound keeps what it had received.
            rec.ttft_s, rec.itl_s = state.ttft_s, state.itl_s
            rec.output_tokens, rec.prompt_tokens = state.output_tokens, state.prompt_tokens
            rec.finish_reason = state.finish_reason

    async def _stream(self, spec: RequestSpec, rec: RequestRecord, state: StreamState) -> None:
        async with self.session.post(self.url, json=self.payload(spec)) as resp:
            rec.http_status = resp.status
            if resp.status != 200:
                body = (await resp.text(errors="replace"))[:300]
                rec.status, rec.error = ("rejected" if resp.status == 429 else "failed"), f"HTTP {resp.status}: {body}"
                rec.retry_after_s = parse_retry_after(resp.headers.get("Retry-After"))
                rec.end = time.perf_counter()
                return
            parser = SSEParser()
            async for chunk in resp.content.iter_any():
                now = time.perf_counter()  # every event in this read arrived now
                for ev in parser.feed(chunk):
                    state.on_data(ev.data, now)
                    if state.error is not None or state.done:
                        break
                if state.error is not None or state.done:
                    break
            else:
                for ev in parser.close():
                    state.on_data(ev.data, time.perf_counter())
            rec.end = state.last_time if state.done and state.last_time is not None else time.perf_counter()
        if state.error is not None:
            rec.status, rec.error = "failed", state.error
        elif not state.complete:
            ctype = resp.headers.get("Content-Type", "?")
            rec.status, rec.error = "failed", f"stream ended without [DONE] or a finish_reason (Content-Type {ctype})"
        else:
            rec.status = "ok"


async def discover_model(session: aiohttp.ClientSession, base_url: str, timeout_s: float) -> str:
    """The first model id that GET /v1/models lists."""
    async with asyncio.timeout(timeout_s), session.get(f"{base_url}/v1/models") as resp:
        if resp.status != 200:
            raise RuntimeError(f"GET {base_url}/v1/models: HTTP {resp.status}")
        body = await resp.json(content_type=None)
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict) or "id" not in data[0]:
        raise RuntimeError(f"GET {base_url}/v1/models lists no model; pass --model")
    return str(data[0]["id"])


def normalize_url(url: str) -> str:
    """Base URL without a trailing slash or /v1, so both http://h:8000 and http://h:8000/v1/ work."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


# ----------------------------------------------------------------------------------------------------------------
# Configuration, the whole benchmark, and the command line


@dataclass
class BenchConfig:
    url: str
    model: str | None = None
    num_requests: int | None = None
    duration_s: float | None = None
    timeout_s: float | None = 3600.0
    request_timeout_s: float = 600.0
    request_rate: float | None = math.inf
    concurrency: int | None = None
    seed: int = 0
    prompt_len: LengthDist = field(default_factory=lambda: LengthDist(128, 128, 128))
    prompt_file: str | None = None
    max_tokens: LengthDist = field(default_factory=lambda: LengthDist(128, 128, 128))
    ignore_eos: bool = False
    temperature: float = 0.0
    slo: Slo = field(default_factory=Slo)
    progress: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "model": self.model,
            "num_requests": self.num_requests,
            "duration_s": self.duration_s,
            "timeout_s": self.timeout_s,
            "request_timeout_s": self.request_timeout_s,
            "mode": "closed" if self.concurrency is not None else "open",
            # JSON has no Infinity; the string keeps the file strict JSON.
            "request_rate": "inf" if self.request_rate is not None and math.isinf(self.request_rate)
            else self.request_rate,
            "concurrency": self.concurrency,
            "seed": self.seed,
            "prompt_source": "file" if self.prompt_file else "synthetic",
            "prompt_file": self.prompt_file,
            "prompt_len": None if self.prompt_file else self.prompt_len.to_json(),
            "max_tokens": self.max_tokens.to_json(),
            "ignore_eos": self.ignore_eos,
            "temperature": self.temperature,
            "slo_ttft_ms": None if self.slo.ttft_s is None else self.slo.ttft_s * 1e3,
            "slo_itl_ms": None if self.slo.itl_s is None else self.slo.itl_s * 1e3,
        }


@dataclass
class BenchResult:
    config: BenchConfig  # with model resolved and num_requests defaulted
    outcome: RunOutcome
    summary: dict[str, Any]
    started_at: str

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": 1,
            "tool": "kvfleet-agent bench serve",
            "started_at": self.started_at,
            "config": self.config.to_json(),
            "summary": self.summary,
            "requests": [r.to_json(self.outcome.t0, self.config.slo) for r in self.outcome.records],
        }


def _requests_for(cfg: BenchConfig) -> Iterator[RequestSpec]:
    if cfg.prompt_file is not None:
        return file_requests(load_prompt_file(cfg.prompt_file), cfg.seed, cfg.max_tokens)
    return synthetic_requests(cfg.seed, cfg.prompt_len, cfg.max_tokens)


async def run_benchmark(cfg: BenchConfig) -> BenchResult:
    """Resolve the model, run the load against cfg.url over one session, and summarize."""
    from tqdm import tqdm

    base = normalize_url(cfg.url)
    requests = _requests_for(cfg)
    started_at = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    # The connector's default cap of 100 connections would queue requests inside the client and show up
    # as server latency; the load shape is ours to decide (open loop: the schedule, closed: the semaphore).
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        if cfg.model is None:
            cfg.model = await discover_model(session, base, min(cfg.request_timeout_s, 60.0))
        send = HttpSender(session, base, cfg.model, temperature=cfg.temperature, ignore_eos=cfg.ignore_eos,
                          request_timeout_s=cfg.request_timeout_s)
        with tqdm(total=cfg.num_requests, disable=not cfg.progress, file=sys.stderr, unit="req",
                  dynamic_ncols=True) as bar:
            outcome = await run_load(
                requests, send, request_rate=None if cfg.concurrency is not None else cfg.request_rate,
                concurrency=cfg.concurrency, seed=cfg.seed, num_requests=cfg.num_requests,
                duration_s=cfg.duration_s, timeout_s=cfg.timeout_s, on_done=lambda _r: bar.update(1))
    summary = summarize(outcome.records, outcome.duration_s, cfg.slo, outcome.stop_reason)
    return BenchResult(cfg, outcome, summary, started_at)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `kvfleet-agent bench serve`."""
    g = parser.add_argument_group("target")
    g.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000 (requests go to "
                   "{url}/v1/completions)")
    g.add_argument("--model", default=None, help="model name to send (default: the first id of GET {url}/v1/models)")

    g = parser.add_argument_group("bounds (issuing stops at whichever comes first)")
    g.add_argument("--num-requests", type=int, default=None, metavar="N",
                   help="requests to issue (default: 100, or every line of --prompt-file once, when --duration "
                   "is not given either)")
    g.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                   help="stop issuing after this long and cancel requests still in flight")
    g.add_argument("--timeout", type=float, default=3600.0, metavar="SECONDS",
                   help="hard limit on the whole run; requests in flight are cancelled (default: 3600)")
    g.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="limit on each request, response stream included (default: 600)")

    g = parser.add_argument_group("arrival process")
    m = g.add_mutually_exclusive_group()
    m.add_argument("--request-rate", type=float, default=None, metavar="R",
                   help="open loop: Poisson arrivals at R requests/s; inf sends all at once (the default)")
    m.add_argument("--concurrency", type=int, default=None, metavar="C",
                   help="closed loop: keep C requests in flight, honouring Retry-After of a 429")
    g.add_argument("--seed", type=int, default=0, help="seeds the arrivals and the prompts (default: 0)")

    g = parser.add_argument_group("requests")
    g.add_argument("--prompt-len", type=int, default=None, metavar="MEAN",
                   help="synthetic prompts of random common words, about one token each (default: 128)")
    g.add_argument("--prompt-len-range", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                   help="draw prompt lengths in [LO, HI] with mean MEAN (uniform when MEAN is the midpoint)")
    g.add_argument("--prompt-file", default=None, metavar="FILE",
                   help='JSONL lines {"prompt": ..., "max_tokens": ...} (max_tokens optional), used in order, cycled')
    g.add_argument("--max-tokens", type=int, default=None, metavar="MEAN", help="output length (default: 128)")
    g.add_argument("--max-tokens-range", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                   help="draw max_tokens in [LO, HI] with mean --max-tokens")
    g.add_argument("--ignore-eos", action="store_true", help='send "ignore_eos": true (vLLM-style servers)')
    g.add_argument("--temperature", type=float, default=0.0, help="(default: 0)")

    g = parser.add_argument_group("goodput SLOs (a request is good if within all that are given)")
    g.add_argument("--slo-ttft-ms", type=float, default=None, metavar="MS", help="time to first token")
    g.add_argument("--slo-itl-ms", type=float, default=None, metavar="MS", help="mean inter-token latency of a request")

    g = parser.add_argument_group("output")
    g.add_argument("--result-json", default=None, metavar="PATH", help="config, summary and per-request records")
    g.add_argument("--plot", default=None, metavar="PATH", help="PNG of latencies over time (needs matplotlib)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (it is off anyway when stderr "
                   "is not a terminal)")


def config_from_args(a: argparse.Namespace) -> BenchConfig:
    """Validate the parsed options into a BenchConfig; ValueError says what is wrong."""
    def positive(name: str, v: float | None) -> None:
        if v is not None and not v > 0:
            raise ValueError(f"{name} must be positive, got {v}")

    positive("--num-requests", a.num_requests)
    positive("--duration", a.duration)
    positive("--timeout", a.timeout)
    positive("--request-timeout", a.request_timeout)
    positive("--request-rate", a.request_rate)
    positive("--concurrency", a.concurrency)
    if a.prompt_file is not None and (a.prompt_len is not None or a.prompt_len_range is not None):
        raise ValueError("--prompt-file and --prompt-len/--prompt-len-range exclude each other")
    if a.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {a.temperature}")
    num_requests = a.num_requests
    if num_requests is None and a.duration is None:
        num_requests = len(load_prompt_file(a.prompt_file)) if a.prompt_file is not None else 100
    rate = a.request_rate if a.request_rate is not None or a.concurrency is not None else math.inf
    if rate is not None and math.isinf(rate) and num_requests is None:
        raise ValueError("with an infinite --request-rate, --duration alone would issue requests without end: "
                         "give --num-requests, a finite --request-rate, or --concurrency")
    return BenchConfig(
        url=a.url, model=a.model, num_requests=num_requests, duration_s=a.duration, timeout_s=a.timeout,
        request_timeout_s=a.request_timeout, request_rate=None if a.concurrency is not None else rate,
        concurrency=a.concurrency, seed=a.seed,
        prompt_len=LengthDist.build(a.prompt_len, a.prompt_len_range, 128), prompt_file=a.prompt_file,
        max_tokens=LengthDist.build(a.max_tokens, a.max_tokens_range, 128), ignore_eos=a.ignore_eos,
        temperature=a.temperature,
        slo=Slo(None if a.slo_ttft_ms is None else a.slo_ttft_ms / 1e3,
                None if a.slo_itl_ms is None else a.slo_itl_ms / 1e3),
        progress=not a.no_progress and sys.stderr.isatty(),
    )


def main(args: argparse.Namespace) -> int:
    """Run `kvfleet-agent bench serve`: 0 if any request succeeded, 1 if none did or the server is unreachable,
    2 for bad options."""
    prog = "kvfleet-agent bench serve"
    try:
        cfg = config_from_args(args)
    except (ValueError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        # Checked before the run so a long benchmark is not lost to a missing optional dependency.
        print(f"{prog}: error: --plot needs matplotlib (pip install 'kvfleet[plot]')", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(run_benchmark(cfg))
    except (aiohttp.ClientError, RuntimeError, TimeoutError, OSError) as e:
        print(f"{prog}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(format_table(result.summary))
    errors = collections.Counter(r.error for r in result.outcome.records if r.status in ("failed", "rejected"))
    for error, count in errors.most_common(3):  # the why of failures, without opening the JSON
        print(f"{prog}: {count} x {error}", file=sys.stderr)
    if args.result_json is not None:
        with open(args.result_json, "w", encoding="utf-8") as f:
            json.dump(result.to_json(), f, indent=1, allow_nan=False)
            f.write("\n")
    if args.plot is not None:
        write_plot(args.plot, result.outcome.records, result.outcome.t0, result.summary)
    return 0 if result.summary["completed"] > 0 else 1


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m kvfleet_agent.bench.loadgen", description=__doc__)
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
