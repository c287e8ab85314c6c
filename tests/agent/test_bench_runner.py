"""Tests of the load generator's runner with fake senders: concurrency, Retry-After, bounds, cancellation."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
from collections.abc import Iterator
from typing import Any

import pytest
from loadgen_helpers import run

from kvfleet_agent.bench.report import RequestRecord
from kvfleet_agent.bench.runner import run_load
from kvfleet_agent.bench.workload import RequestSpec, arrival_schedule


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
