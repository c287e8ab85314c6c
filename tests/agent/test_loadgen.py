"""Tests of whole load-generator runs over real HTTP, through run_benchmark and the command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from aiohttp import web
from loadgen_helpers import chunk, run

from kvfleet_agent.bench import loadgen
from kvfleet_agent.bench.loadgen import BenchConfig, parse_retry_after, run_benchmark
from kvfleet_agent.bench.report import RequestRecord
from kvfleet_agent.bench.workload import LengthDist

# Whole runs go to servers on 127.0.0.1 port 0: a scripted aiohttp server defined here (exact chunks, 429s,
# hangs, errors; synchronised by asyncio events) and, when it imports and starts, kvfleet's own HTTP front
# end on a tiny random checkpoint. Timing assertions are orderings or generous lower bounds only.

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T = TypeVar("T")


# --- the Retry-After header ------------------------------------------------------------------------


def test_retry_after_seconds_and_dates() -> None:
    now = dt.datetime(2025, 1, 1, 12, 0, 0, tzinfo=dt.UTC)
    assert parse_retry_after("3", now) == 3.0
    assert parse_retry_after(" 0 ", now) == 0.0
    assert parse_retry_after("Wed, 01 Jan 2025 12:00:05 GMT", now) == 5.0
    assert parse_retry_after("Wed, 01 Jan 2025 11:00:00 GMT", now) == 0.0  # in the past: no wait
    assert parse_retry_after("soon", now) is None
    assert parse_retry_after(None, now) is None


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
                data = chunk(f" t{i}", "length" if i == n - 1 else None).encode()
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
            # Only the silent server is meant to time out: the others answer at once, and 10 s keeps a slow moment
            # of a loaded machine from turning their error into "timed out". The hang's duration leaves room for
            # all three first tokens.
            timeout = 0.3 if mode == "no_response" else 10.0
            cfg = _cfg(url, model="m", num_requests=3, request_timeout_s=timeout, duration_s=3.0 if hang else None)
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
