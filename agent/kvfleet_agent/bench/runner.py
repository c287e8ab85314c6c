"""The load-test runner: arrivals, bounds and cancellation (async, transport-agnostic)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from kvfleet_agent.bench.report import RequestRecord
from kvfleet_agent.bench.workload import RequestSpec, poisson_arrivals

__all__ = ["RunOutcome", "Sender", "StopReason", "run_load"]

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

