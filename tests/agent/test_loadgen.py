"""Tests of the load generator: its pure parts, its runner with fake senders, and whole runs over real HTTP.

Whole runs go to servers on 127.0.0.1 port 0: a scripted aiohttp server defined here (exact chunks, 429s,
hangs, errors; synchronised by asyncio events) and, when it imports and starts, kvfleet's own HTTP front
end on a tiny random checkpoint. Every event loop is bounded by a timeout so a lost wake-up fails a test
instead of hanging it; timing assertions are orderings or generous lower bounds only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import itertools
import json
import math
import random
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet_agent.bench import loadgen
from kvfleet_agent.bench.loadgen import (
    WORDS,
    BenchConfig,
    LengthDist,
    RequestSpec,
    SSEEvent,
    SSEParser,
    StreamState,
    arrival_schedule,
    file_requests,
    load_prompt_file,
    parse_retry_after,
    poisson_arrivals,
    run_benchmark,
    run_load,
    synthetic_requests,
)
from kvfleet_agent.bench.report import RequestRecord, Slo, count_good, distribution, percentile, summarize

LOOP_TIMEOUT_S = 20.0  # guards every event loop; no test comes near it when the code works
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, LOOP_TIMEOUT_S)

    return asyncio.run(bounded())


# --- arrivals and requests -------------------------------------------------------------------------


def test_poisson_schedule_has_the_mean_rate_and_is_deterministic() -> None:
    rate, n = 8.0, 20000
    times = arrival_schedule(n, rate, seed=7)
    assert times == arrival_schedule(n, rate, seed=7)
    assert times != arrival_schedule(n, rate, seed=8)
    gaps = np.diff([0.0, *times])
    assert (gaps > 0).all()
    assert n / times[-1] == pytest.approx(rate, rel=0.03)
    # Exponential gaps: the standard deviation equals the mean.
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)
    # The lazy generator and the list agree, across its internal blocks of draws.
    assert list(itertools.islice(poisson_arrivals(rate, 7), 3000)) == times[:3000]


def test_infinite_rate_sends_everything_at_zero_and_bad_rates_are_refused() -> None:
    assert arrival_schedule(5, math.inf, seed=0) == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_schedule(1, 0.0, seed=0)


def test_length_distribution_mean_and_bounds() -> None:
    rng = np.random.default_rng(0)
    for mean, lo, hi in ((50, 10, 90), (20, 10, 90), (85, 10, 90)):
        d = LengthDist(mean, lo, hi)
        xs = [d.sample(rng) for _ in range(20000)]
        assert min(xs) >= lo and max(xs) <= hi
        assert np.mean(xs) == pytest.approx(mean, rel=0.02)
    assert {LengthDist(7, 7, 7).sample(rng) for _ in range(10)} == {7}
    assert LengthDist.build(None, [4, 8], 128) == LengthDist(6, 4, 8)
    assert LengthDist.build(None, None, 128) == LengthDist(128, 128, 128)
    with pytest.raises(ValueError):
        LengthDist(3, 4, 8)


def test_synthetic_prompts_are_deterministic_words_of_the_drawn_length() -> None:
    def first(seed: int) -> list[RequestSpec]:
        return list(itertools.islice(synthetic_requests(seed, LengthDist(20, 5, 35), LengthDist(16, 8, 24)), 50))

    a = first(3)
    assert a == first(3)
    assert a != first(4)
    assert [r.index for r in a] == list(range(50))
    for r in a:
        words = r.prompt.split(" ")
        assert len(words) == r.prompt_words and 5 <= len(words) <= 35
        assert set(words) <= set(WORDS)
        assert 8 <= r.max_tokens <= 24
    assert len(set(WORDS)) == len(WORDS) > 200


def test_prompt_file_is_cycled_and_validated(tmp_path: Path) -> None:
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "a b", "max_tokens": 3}\n\n{"prompt": "c"}\n', encoding="utf-8")
    entries = load_prompt_file(str(good))
    assert entries == [("a b", 3), ("c", None)]
    specs = list(itertools.islice(file_requests(entries, 0, LengthDist(9, 9, 9)), 5))
    assert [(s.prompt, s.max_tokens) for s in specs] == [("a b", 3), ("c", 9), ("a b", 3), ("c", 9), ("a b", 3)]
    for text in ('{"prompt": 1}\n', 'not json\n', '{"prompt": "x", "max_tokens": 0}\n', "\n"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text, encoding="utf-8")
        with pytest.raises(ValueError):
            load_prompt_file(str(bad))


# --- statistics and goodput ------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False), min_size=1, max_size=60),
       st.floats(min_value=0.0, max_value=100.0))
def test_percentile_equals_numpy(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12, abs=1e-9)


def test_percentile_fixed_cases_and_distribution() -> None:
    xs = [15.0, 1.0, 7.0, 3.0]
    for q in (0, 25, 50, 90, 95, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    d = distribution(xs, scale=1e3)
    assert d["mean"] == pytest.approx(6.5e3)
    assert d["p50"] == pytest.approx(5e3)
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p95": None, "p99": None}
    with pytest.raises(ValueError):
        percentile([], 50)


def _rec(i: int, status: str = "ok", ttft: float | None = 0.1, itl: list[float] | None = None,
         tokens: int = 4) -> RequestRecord:
    r = RequestRecord(i, 0.0, start=10.0, end=11.0, ttft_s=ttft, itl_s=itl if itl is not None else [0.02] * 3,
                      output_tokens=tokens, prompt_tokens=10)
    r.status = status  # type: ignore[assignment]
    return r


def test_goodput_counts_requests_within_every_given_slo() -> None:
    records = [
        _rec(0),  # good on both
        _rec(1, ttft=0.5),  # TTFT too slow
        _rec(2, itl=[0.01, 0.09]),  # mean ITL 50 ms: too slow
        _rec(3, itl=[0.001, 0.059]),  # mean ITL 30 ms: good, although one gap exceeds the SLO
        _rec(4, itl=[]),  # one chunk: no gap to miss the ITL SLO
        _rec(5, ttft=None, itl=[]),  # no text at all: misses a TTFT SLO
        _rec(6, status="failed"),
        _rec(7, status="rejected"),
    ]
    both = Slo(ttft_s=0.2, itl_s=0.04)
    assert count_good(records, both) == 3
    assert count_good(records, Slo(ttft_s=0.2)) == 4
    assert count_good(records, Slo(itl_s=0.04)) == 5
    s = summarize(records, duration_s=2.0, slo=both, stop_reason="num_requests")
    assert s["good_requests"] == 3 and s["goodput"] == pytest.approx(1.5)
    assert (s["completed"], s["failed"], s["rejected"], s["cancelled"]) == (6, 1, 1, 0)
    assert s["request_throughput"] == pytest.approx(3.0)
    assert s["total_output_tokens"] == 24 and s["output_token_throughput"] == pytest.approx(12.0)
    assert s["total_token_throughput"] == pytest.approx((24 + 60) / 2.0)
    assert summarize(records, 2.0, Slo(), "num_requests")["goodput"] is None


# --- SSE parsing and stream accounting -----------------------------------------------------------------


def _events(parser: SSEParser, *chunks: bytes) -> list[SSEEvent]:
    out: list[SSEEvent] = []
    for c in chunks:
        out += parser.feed(c)
    return out + parser.close()


def test_sse_comments_multiline_done_and_line_endings() -> None:
    stream = (b": keep-alive\n\n"
              b"data: {\"a\": 1}\n\n"
              b":ping\r\n"
              b"data: line one\r\ndata:line two\r\n\r\n"
              b"event: usage\rdata: x\r\r"
              b"id: 7\nretry: 10\nunknown: field\ndata\n\n"
              b"data: [DONE]\n\n")
    want = [SSEEvent('{"a": 1}'), SSEEvent("line one\nline two"), SSEEvent("x", "usage"), SSEEvent(""),
            SSEEvent("[DONE]")]
    assert _events(SSEParser(), stream) == want


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_sse_events_do_not_depend_on_how_the_bytes_are_split(cuts: list[int]) -> None:
    stream = ("data: {\"text\": \"café 🙂\"}\r\n\r\n: keep-alive\r\n\r\ndata: a\r\ndata: b\r\n\r\n"
              "data: [DONE]\r\n\r\n").encode()
    bounds = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    pieces = [stream[a:b] for a, b in itertools.pairwise(bounds)]
    assert _events(SSEParser(), *pieces) == [SSEEvent('{"text": "café 🙂"}'), SSEEvent("a\nb"), SSEEvent("[DONE]")]


def test_sse_close_keeps_a_last_event_without_its_blank_line() -> None:
    p = SSEParser()
    assert p.feed(b"data: tail") == []
    assert p.close() == [SSEEvent("tail")]
    p = SSEParser()
    assert p.feed(b"data: cr\r") == []  # the CR may be half of a CRLF: not a line end yet
    assert p.close() == [SSEEvent("cr")]


def _chunk(text: str, finish: str | None = None, usage: dict[str, int] | None = None) -> str:
    obj: dict[str, Any] = {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    if usage is not None:
        obj["usage"] = usage
    return json.dumps(obj)


def test_stream_state_ttft_itl_and_counted_tokens() -> None:
    s = StreamState(start=100.0)
    s.on_data(_chunk(""), 100.5)  # empty text (e.g. a role chunk): not the first token
    s.on_data(_chunk("a"), 101.0)
    s.on_data(_chunk("b"), 102.0)
    s.on_data(_chunk("c", "length"), 104.0)
    assert s.ttft_s == 1.0 and s.itl_s == [1.0, 2.0]
    assert s.output_tokens == 3 and s.usage_tokens is None and s.complete and not s.done
    s.on_data(json.dumps({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}), 104.1)
    s.on_data("[DONE]", 104.2)
    assert s.output_tokens == 4 and s.prompt_tokens == 9 and s.done  # the server's count wins
    assert s.itl_s == [1.0, 2.0]


def test_stream_state_spreads_multi_token_chunks_as_the_server_reports() -> None:
    s = StreamState(start=0.0)

    def u(n: int) -> dict[str, int]:
        return {"prompt_tokens": 5, "completion_tokens": n}

    s.on_data(_chunk("a", usage=u(2)), 1.0)  # two tokens in the first chunk: TTFT, no gap
    s.on_data(_chunk("bcd", usage=u(5)), 1.3)  # three tokens over 0.3 s
    s.on_data(_chunk("", usage=u(6)), 1.4)  # a held-back token (no text yet)...
    s.on_data(_chunk("ef", "stop", usage=u(7)), 1.5)  # ...arrives with the next: two tokens over 0.2 s
    assert s.ttft_s == 1.0
    assert s.itl_s == pytest.approx([0.1] * 3 + [0.1] * 2)
    assert s.output_tokens == 7 and s.counted_tokens == 7


def test_stream_state_usage_only_at_the_end_is_not_taken_as_per_chunk() -> None:
    s = StreamState(start=0.0)
    s.on_data(_chunk("a"), 1.0)
    s.on_data(_chunk("b", "length", usage={"prompt_tokens": 1, "completion_tokens": 2}), 2.0)
    assert s.itl_s == [1.0] and s.output_tokens == 2


def test_stream_state_errors() -> None:
    s = StreamState(start=0.0)
    s.on_data(json.dumps({"error": {"message": "engine failed", "type": "server_error"}}), 1.0)
    assert s.error == "engine failed"
    s = StreamState(start=0.0)
    s.on_data("{not json", 1.0)
    assert s.error is not None and "bad SSE data" in s.error


def test_retry_after_seconds_and_dates() -> None:
    now = dt.datetime(2025, 1, 1, 12, 0, 0, tzinfo=dt.UTC)
    assert parse_retry_after("3", now) == 3.0
    assert parse_retry_after(" 0 ", now) == 0.0
    assert parse_retry_after("Wed, 01 Jan 2025 12:00:05 GMT", now) == 5.0
    assert parse_retry_after("Wed, 01 Jan 2025 11:00:00 GMT", now) == 0.0  # in the past: no wait
    assert parse_retry_after("soon", now) is None
    assert parse_retry_after(None, now) is None


# --- the runner, with fake senders -----------------------------------------------------------------


def _specs() -> Iterator[RequestSpec]:
    return (RequestSpec(i, f"p{i}", 4) for i in itertools.count())


def test_closed_loop_never_exceeds_its_concurrency() -> None:
    concurrency, n = 3, 25
    waiting: list[asyncio.Event] = []
    changed = asyncio.Condition()
    in_flight = 0
    peak = 0

    async def send(spec: RequestSpec, rec: RequestRecord) -> None:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        ev = asyncio.Event()
        async with changed:
            waiting.append(ev)
            changed.notify_all()
        await ev.wait()
        in_flight -= 1
        rec.status = "ok"

    async def body() -> None:
        task = asyncio.create_task(run_load(_specs(), send, concurrency=concurrency, num_requests=n))
        rng = random.Random(0)
        released = 0
        while released < n:
            want = min(concurrency, n - released)  # every slot it may fill (the rest of the run may be smaller)
            async with changed:
                await changed.wait_for(lambda: len(waiting) == want)  # noqa: B023 (awaited right here)
            assert in_flight == len(waiting) <= concurrency
            waiting.pop(rng.randrange(len(waiting))).set()  # finish one at random: a slot opens
            released += 1
            await asyncio.sleep(0)
        out = await task
        assert [r.status for r in out.records] == ["ok"] * n
        assert out.stop_reason == "num_requests"

    run(body())
    assert peak == concurrency


def test_closed_loop_honours_retry_after_and_open_loop_does_not() -> None:
    async def body(closed: bool) -> list[RequestRecord]:
        async def send(spec: RequestSpec, rec: RequestRecord) -> None:
            if spec.index == 0:
                rec.status, rec.retry_after_s = "rejected", 0.3
            else:
                rec.status = "ok"

        kw: dict[str, Any] = {"concurrency": 1} if closed else {"request_rate": math.inf}
        out = await run_load(_specs(), send, num_requests=3, **kw)
        return out.records

    closed = run(body(True))
    assert [r.status for r in closed] == ["rejected", "ok", "ok"]
    assert closed[1].start is not None and closed[0].end is not None
    assert closed[1].start - closed[0].end >= 0.29  # the slot stayed closed for Retry-After
    opened = run(body(False))
    assert opened[1].start is not None and opened[0].end is not None
    assert opened[1].start - opened[0].end < 0.29


def test_duration_bound_cancels_what_is_in_flight() -> None:
    never = asyncio.Event()

    async def send(spec: RequestSpec, rec: RequestRecord) -> None:
        assert rec.start is not None
        rec.ttft_s = 0.0  # it got its first token, then the server went quiet
        await never.wait()

    async def body() -> None:
        out = await run_load(_specs(), send, concurrency=2, duration_s=0.3)
        assert out.stop_reason == "duration"
        assert [r.status for r in out.records] == ["cancelled", "cancelled"]
        assert all(r.ttft_s == 0.0 and r.end is not None for r in out.records)
        assert 0.29 <= out.duration_s < 5.0

    run(body())


def test_open_loop_stops_issuing_at_the_duration() -> None:
    async def send(spec: RequestSpec, rec: RequestRecord) -> None:
        rec.status = "ok"

    async def body() -> None:
        out = await run_load(_specs(), send, request_rate=40.0, seed=1, duration_s=0.5)
        due = [t for t in arrival_schedule(200, 40.0, seed=1) if t < 0.5]
        assert out.stop_reason == "duration"
        assert [r.scheduled_s for r in out.records] == due
        assert all(r.status == "ok" for r in out.records)

    run(body())


def test_runner_rejects_unbounded_and_ambiguous_runs() -> None:
    async def send(spec: RequestSpec, rec: RequestRecord) -> None:
        rec.status = "ok"

    for kw in ({"request_rate": math.inf, "duration_s": 1.0}, {"concurrency": 1},
               {"concurrency": 1, "request_rate": 1.0, "num_requests": 1}, {"concurrency": 0, "num_requests": 1}):
        with pytest.raises(ValueError):
            run(run_load(_specs(), send, **kw))


# --- a scripted server over real HTTP -------------------------------------------------------------


@dataclass
class Scripted:
    """An OpenAI-style /v1/completions that streams `chunks` pieces, as configured.

    The first `reject_first` requests get 429 + Retry-After. When `hold_for` is set, every accepted
    stream waits until that many are in flight at once, so the test knows they were concurrent.
    """

    chunks: int = 5
    usage: bool = True
    reject_first: int = 0
    retry_after: str = "3"
    hold_for: int | None = None
    delay_s: float = 0.002  # small fixed gaps so TTFT and ITL are measurable; nothing waits on them
    mode: str = "ok"  # ok | hang_after_first | no_response | http_500 | stream_error
    arrived: int = 0
    in_flight: int = 0
    peak: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    all_in: asyncio.Event = field(default_factory=asyncio.Event)
    never: asyncio.Event = field(default_factory=asyncio.Event)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "scripted-1"}, {"id": "other"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.arrived += 1
        if self.arrived <= self.reject_first:
            return web.json_response({"error": {"message": "queue full"}}, status=429,
                                     headers={"Retry-After": self.retry_after})
        if self.mode == "http_500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            if self.hold_for is not None:
                if self.in_flight >= self.hold_for:
                    self.all_in.set()
                await self.all_in.wait()
            if self.mode == "no_response":
                await self.never.wait()
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b": keep-alive\r\n\r\n")
            if self.mode == "stream_error":
                await resp.write(b'data: {"error": {"message": "engine died"}}\n\n')
                return resp
            n = self.chunks
            for i in range(n):
                await asyncio.sleep(self.delay_s)
                data = _chunk(f" t{i}", "length" if i == n - 1 else None).encode()
                await resp.write(b"data: " + data[:7])  # one event in two writes: the parser must join them
                await resp.write(data[7:] + b"\n\n")
                if self.mode == "hang_after_first":
                    await self.never.wait()
            if self.usage and body.get("stream_options", {}).get("include_usage"):
                usage = {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": n}
                await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self.in_flight -= 1


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def _cfg(url: str, **kw: Any) -> BenchConfig:
    base: dict[str, Any] = {"url": url, "num_requests": 6, "prompt_len": LengthDist(12, 6, 18),
                            "max_tokens": LengthDist(5, 5, 5), "request_timeout_s": 10.0}
    return BenchConfig(**(base | kw))


def _check_times(records: list[RequestRecord]) -> None:
    for r in records:
        assert r.ttft_s is not None and r.e2e_s is not None
        assert 0 < r.ttft_s <= r.e2e_s


def test_open_loop_run_over_http_counts_tokens_and_rejections() -> None:
    server = Scripted(reject_first=2, hold_for=4)

    async def body() -> None:
        async with serving(server.app()) as url:
            res = await run_benchmark(_cfg(url, ignore_eos=True, temperature=0.5))
        recs = res.outcome.records
        assert server.peak == 4  # with an infinite rate, all accepted requests were in flight at once
        assert sorted(r.status for r in recs) == ["ok"] * 4 + ["rejected"] * 2
        rejected = [r for r in recs if r.status == "rejected"]
        assert all(r.http_status == 429 and r.retry_after_s == 3.0 for r in rejected)
        ok = [r for r in recs if r.status == "ok"]
        assert all(r.output_tokens == 5 and len(r.itl_s) == 4 and r.finish_reason == "length" for r in ok)
        assert all(r.prompt_tokens == r.prompt_words for r in ok)
        _check_times(ok)
        assert res.config.model == "scripted-1"  # the first id of /v1/models
        b = server.bodies[0]
        assert b["model"] == "scripted-1" and b["stream"] is True and b["stream_options"] == {"include_usage": True}
        assert b["ignore_eos"] is True and b["temperature"] == 0.5 and b["max_tokens"] == 5
        s = res.summary
        assert (s["completed"], s["rejected"], s["failed"], s["cancelled"]) == (4, 2, 0, 0)
        assert s["total_output_tokens"] == 20 and s["stop_reason"] == "num_requests"

    run(body())


def test_closed_loop_run_over_http_without_usage_counts_chunks() -> None:
    server = Scripted(chunks=7, usage=False)

    async def body() -> None:
        async with serving(server.app()) as url:
            res = await run_benchmark(_cfg(url, model="m", concurrency=2, request_rate=None, num_requests=8))
        assert server.peak <= 2
        assert [r.status for r in res.outcome.records] == ["ok"] * 8
        assert all(r.output_tokens == 7 and r.prompt_tokens is None for r in res.outcome.records)
        _check_times(res.outcome.records)
        assert "ignore_eos" not in server.bodies[0]

    run(body())


@pytest.mark.parametrize(("mode", "status", "error"), [
    ("http_500", "failed", "HTTP 500"),
    ("stream_error", "failed", "engine died"),
    ("no_response", "failed", "timed out"),
    ("hang_after_first", "cancelled", None),
])
def test_failures_timeouts_and_cancellation_over_http(mode: str, status: str, error: str | None) -> None:
    server = Scripted(mode=mode)

    async def body() -> None:
        async with serving(server.app()) as url:
            hang = mode == "hang_after_first"  # cut off by the run's duration, not by the request timeout
            cfg = _cfg(url, model="m", num_requests=3, request_timeout_s=10.0 if hang else 0.3,
                       duration_s=0.4 if hang else None)
            res = await run_benchmark(cfg)
        recs = res.outcome.records
        assert [r.status for r in recs] == [status] * 3
        if error is not None:
            assert all(r.error is not None and error in r.error for r in recs)
        if mode == "hang_after_first":  # cut off at the duration, keeping the first token's timing
            assert res.summary["stop_reason"] == "duration" and res.summary["cancelled"] == 3
            assert all(r.ttft_s is not None and r.output_tokens == 1 for r in recs)
        assert res.summary["completed"] == 0

    run(body())


# --- the command line, against the scripted server and against kvfleet's own server ---------------------


class ThreadedServer:
    """Serves an app built by `make` on its own event loop thread, so main()'s asyncio.run can be the client."""

    def __init__(self, make: Callable[[], Awaitable[tuple[web.Application, Callable[[], None]]]]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.url, self._runner, self._after = asyncio.run_coroutine_threadsafe(self._start(make), self.loop).result(60)

    async def _start(self, make: Callable[[], Awaitable[tuple[web.Application, Callable[[], None]]]]
                     ) -> tuple[str, web.AppRunner, Callable[[], None]]:
        app, after = await make()
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{runner.addresses[0][1]}", runner, after

    def call(self, fn: Callable[[], T]) -> T:
        """Run fn on the server's loop (its objects are not thread-safe)."""
        async def wrapped() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(wrapped(), self.loop).result(30)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(30)
        self._after()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


@dataclass
class Target:
    server: ThreadedServer
    model: str
    set_queue_limit: Callable[[int], None] | None = None  # kvfleet only: its admission control's queue length


def _scripted_target() -> Iterator[Target]:
    async def make() -> tuple[web.Application, Callable[[], None]]:
        return Scripted(chunks=6).app(), lambda: None

    srv = ThreadedServer(make)
    try:
        yield Target(srv, "scripted-1")
    finally:
        srv.close()


@pytest.fixture(scope="module")
def kvfleet(tiny_checkpoint: Callable[..., str]) -> Iterator[Target]:
    """kvfleet's own HTTP front end, in process, on a tiny random checkpoint."""
    try:
        from kvfleet_agent.engine.async_llm import AsyncLLM
        from kvfleet_agent.server.admission import Admission
        from kvfleet_agent.server.http import HTTPFrontend
        from kvfleet_agent.server.metrics import AgentMetrics
    except ImportError as e:
        pytest.skip(f"kvfleet's HTTP server is not importable: {e}")
    llm = AsyncLLM.from_options(tiny_checkpoint("llama"), kv_cache_memory_bytes=8 << 20, max_num_seqs=8,
                                max_num_batched_tokens=256)
    admission = Admission(llm, max_queue_length=64)

    async def make() -> tuple[web.Application, Callable[[], None]]:
        frontend = HTTPFrontend(llm, admission, AgentMetrics(llm, admission, "tiny"), "tiny")
        return frontend.app(), llm.shutdown

    srv = ThreadedServer(make)

    def set_limit(n: int) -> None:
        admission.max_queue_length = n

    try:
        yield Target(srv, "tiny", set_limit)
    finally:
        srv.close()


@pytest.fixture(scope="module", params=["scripted", "kvfleet"])
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    if request.param == "scripted":
        yield from _scripted_target()
    else:
        yield request.getfixturevalue("kvfleet")


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    loadgen.add_arguments(p)
    return p.parse_args(list(argv))


def test_cli_writes_table_json_and_png(target: Target, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_png = tmp_path / "r.json", tmp_path / "p.png"
    n = 10
    args = _parse("--url", target.server.url + "/v1/", "--num-requests", str(n), "--concurrency", "3",
                  "--prompt-len", "12", "--prompt-len-range", "6", "18", "--max-tokens", "6", "--ignore-eos",
                  "--seed", "5", "--slo-ttft-ms", "60000", "--slo-itl-ms", "60000",
                  "--result-json", str(out_json), "--plot", str(out_png), "--no-progress")
    assert loadgen.main(args) == 0
    table = capsys.readouterr().out
    for label in ("Request throughput", "Output token throughput", "Total token throughput", "Goodput",
                  "Successful:", "Failed:", "Rejected (429):", "TTFT", "ITL", "E2E", "p99"):
        assert label in table

    doc = json.loads(out_json.read_text(encoding="utf-8"))
    assert doc["schema_version"] == 1
    cfg = doc["config"]
    assert cfg["model"] == target.model and cfg["mode"] == "closed" and cfg["concurrency"] == 3
    assert cfg["num_requests"] == n and cfg["seed"] == 5 and cfg["prompt_len"] == {"mean": 12, "lo": 6, "hi": 18}
    reqs = doc["requests"]
    assert [r["index"] for r in reqs] == list(range(n))
    assert all(r["status"] == "ok" and r["output_tokens"] == 6 and r["good"] is True for r in reqs)
    assert all(0 < r["ttft_ms"] <= r["e2e_ms"] for r in reqs)
    # One gap per token after the first, unless a chunk's text came out empty (a token decoding to nothing).
    assert all(len(r["itl_ms"]) == 5 if target.set_queue_limit is None else len(r["itl_ms"]) <= 5 for r in reqs)
    assert all(isinstance(r["prompt_tokens"], int) for r in reqs)
    s = doc["summary"]
    assert s["completed"] == s["good_requests"] == n and s["total_output_tokens"] == 6 * n
    assert s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"] and s["e2e_ms"]["mean"] > 0
    assert out_png.read_bytes()[:8] == PNG_MAGIC


def test_cli_counts_kvfleets_429s_as_rejected(kvfleet: Target, tmp_path: Path) -> None:
    set_limit = kvfleet.set_queue_limit
    assert set_limit is not None
    # A queue length of 0 makes kvfleet's admission refuse every request, deterministically.
    kvfleet.server.call(lambda: set_limit(0))
    try:
        out_json = tmp_path / "r.json"
        args = _parse("--url", kvfleet.server.url, "--model", "tiny", "--num-requests", "5", "--max-tokens", "4",
                      "--prompt-len", "8", "--result-json", str(out_json), "--no-progress")
        assert loadgen.main(args) == 1  # nothing succeeded
    finally:
        kvfleet.server.call(lambda: set_limit(64))
    doc = json.loads(out_json.read_text(encoding="utf-8"))
    assert doc["summary"]["rejected"] == 5 and doc["summary"]["completed"] == 0
    assert all(r["http_status"] == 429 and r["retry_after_s"] is not None for r in doc["requests"])


def test_cli_option_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n', encoding="utf-8")
    for argv in (("--duration", "5"),  # infinite rate with only a duration: endless
                 ("--prompt-file", str(prompts), "--prompt-len", "8"),
                 ("--concurrency", "0"),
                 ("--prompt-len", "4", "--prompt-len-range", "5", "9")):
        assert loadgen.main(_parse("--url", "http://127.0.0.1:9", *argv)) == 2
        assert "error" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse("--url", "u", "--request-rate", "1", "--concurrency", "2")
    cfg = loadgen.config_from_args(_parse("--url", "u", "--prompt-file", str(prompts)))
    assert cfg.num_requests == 1  # the file, once
    assert loadgen.config_from_args(_parse("--url", "u")).num_requests == 100
