"""scrape.py: parsing the agent's exposition, scraping real HTTP servers, PromQL-exact quantiles over a window."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator, Awaitable, Callable

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from kvfleet_operator.autoscaling.scrape import Histogram as Hist
from kvfleet_operator.autoscaling.scrape import (
    MetricsWindow,
    ParseError,
    Snapshot,
    bucket_quantile,
    parse_exposition,
    scrape_pods,
)

INF = math.inf


def exposition(waiting: float = 3, running: float = 5, ttft: tuple[float, ...] = (0.007, 0.3, 2.0),
               model: str = "m") -> str:
    """The agent's families, made the way agent/kvfleet_agent/server/metrics.py makes them."""
    reg = CollectorRegistry()
    g_wait = Gauge("kvfleet_requests_waiting", "w", ["model"], registry=reg)
    g_run = Gauge("kvfleet_requests_running", "r", ["model"], registry=reg)
    g_wait.labels(model=model).set(waiting)
    g_run.labels(model=model).set(running)
    h = Histogram("kvfleet_time_to_first_token_seconds", "t", ["model"], buckets=(0.005, 0.01, 0.5, 1.0),
                  registry=reg)
    for v in ttft:
        h.labels(model=model).observe(v)
    Histogram("kvfleet_e2e_request_latency_seconds", "e", ["model"], buckets=(1.0,), registry=reg).labels(model=model)
    return generate_latest(reg).decode()


def test_parse_reads_gauges_and_cumulative_histograms() -> None:
    snap = parse_exposition(exposition(), "pod-a", 100.0)
    assert (snap.pod, snap.time, snap.waiting, snap.running, snap.queue_depth) == ("pod-a", 100.0, 3, 5, 8)
    ttft = snap.histograms["ttft"]
    # 0.007 falls in le=0.01, 0.3 in le=0.5, 2.0 only in +Inf: cumulative 0, 1, 2, 2, 3.
    assert ttft.bounds == (0.005, 0.01, 0.5, 1.0, INF)
    assert ttft.buckets == (0, 1, 2, 2, 3)
    assert ttft.count == 3 and ttft.sum == pytest.approx(2.307)
    assert snap.histograms["e2e"].count == 0  # present with no observations
    assert "itl" not in snap.histograms  # absent family: nothing to report


def test_parse_filters_by_model_and_rejects_garbage() -> None:
    assert parse_exposition(exposition(model="a"), "p", 0.0, model="a").waiting == 3
    with pytest.raises(ParseError, match="missing"):
        parse_exposition(exposition(model="a"), "p", 0.0, model="other")
    for bad in ("<html>oops</html>", "kvfleet_requests_waiting{model=\"m\"} nan-ish\n", "garbage here\n"):
        with pytest.raises(ParseError):
            parse_exposition(bad, "p", 0.0)
    with pytest.raises(ParseError, match="kvfleet_requests_running"):
        parse_exposition('kvfleet_requests_waiting{model="m"} 1\n', "p", 0.0)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _serve(handlers: dict[str, Handler]) -> AsyncGenerator[dict[str, str], None]:
    """One aiohttp server per name on 127.0.0.1, port 0; yields name → /metrics URL."""
    runners = []
    urls = {}
    try:
        for name, handler in handlers.items():
            app = web.Application()
            app.router.add_get("/metrics", handler)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = runner.addresses[0][1]
            runners.append(runner)
            urls[name] = f"http://127.0.0.1:{port}/metrics"
        yield urls
    finally:
        for runner in runners:
            await runner.cleanup()


def test_scrape_pods_reports_each_failure_without_raising() -> None:
    release = asyncio.Event()

    async def good(_: web.Request) -> web.Response:
        return web.Response(text=exposition())

    async def hang(_: web.Request) -> web.Response:
        await release.wait()  # answers only after the scrape gave up (released at cleanup)
        return web.Response(text="")

    async def garbage(_: web.Request) -> web.Response:
        return web.Response(text="<html>not metrics</html>")

    async def broken(_: web.Request) -> web.Response:
        return web.Response(status=500, text="boom")

    async def main() -> None:
        gen = _serve({"good": good, "hang": hang, "garbage": garbage, "broken": broken})
        urls = await gen.__anext__()
        closed = _serve({"gone": good})  # a server that is stopped before the scrape: connection refused
        gone = (await closed.__anext__())["gone"]
        await closed.aclose()
        pods = [*urls.items(), ("gone", gone)]
        result = await scrape_pods(pods, timeout=5.0, clock=lambda: 42.0)
        release.set()  # lets the hanging handler end, so the server's graceful shutdown does not wait for it
        await gen.aclose()
        assert set(result.snapshots) == {"good"}
        assert result.snapshots["good"].time == 42.0 and result.snapshots["good"].queue_depth == 8
        assert result.errors["hang"] == "timeout after 5s"
        assert result.errors["broken"] == "HTTP 500"
        assert result.errors["garbage"].startswith("parse: ")
        assert result.errors["gone"].startswith("ClientConnectorError")

    asyncio.run(main())


def test_bucket_quantile_matches_promql_by_hand() -> None:
    bounds = (0.1, 0.5, 1.0, INF)
    cum = (10.0, 60.0, 90.0, 100.0)
    # q=0.5: rank 50 lands in (0.1, 0.5] holding 50; 40 into it: 0.1 + 0.4 × 40/50 = 0.42.
    assert bucket_quantile(0.5, bounds, cum) == pytest.approx(0.42)
    # q=0.05: rank 5 in the lowest bucket, lower bound 0: 0 + 0.1 × 5/10 = 0.05.
    assert bucket_quantile(0.05, bounds, cum) == pytest.approx(0.05)
    # q=0.9: rank 90 is exactly the le=1.0 count: first bucket with count >= 90 is (0.5, 1.0]: 0.5 + 0.5 × 30/30.
    assert bucket_quantile(0.9, bounds, cum) == pytest.approx(1.0)
    # q=0.95: rank 95 only in +Inf: the highest finite bound, 1.0.
    assert bucket_quantile(0.95, bounds, cum) == 1.0
    # A lowest bucket with upper bound <= 0 returns that bound.
    assert bucket_quantile(0.01, (-1.0, 0.0, INF), (5.0, 8.0, 10.0)) == -1.0
    # Non-monotonic buckets (sums across resets) are forced monotonic: (10, 8→10, 20) gives rank 15 in
    # (0.5, 1.0]: 0.5 + 0.5 × 5/10 = 0.75.
    assert bucket_quantile(0.75, (0.1, 0.5, 1.0, INF), (10.0, 8.0, 20.0, 20.0)) == pytest.approx(0.75)
    assert math.isnan(bucket_quantile(0.5, bounds, (0.0, 0.0, 0.0, 0.0)))
    assert math.isnan(bucket_quantile(0.5, (0.1, 0.5), (1.0, 2.0)))  # no +Inf bucket
    assert bucket_quantile(-0.1, bounds, cum) == -INF and bucket_quantile(1.1, bounds, cum) == INF


BOUNDS = (0.1, 0.5, 1.0, INF)


def snap(pod: str, t: float, cum: tuple[float, ...], queue: float = 0.0) -> Snapshot:
    return Snapshot(pod, t, queue, 0.0, {"ttft": Hist(BOUNDS, cum, cum[-1], cum[-1] * 0.2)})


def test_window_sums_increases_handles_resets_and_pods_coming_and_going() -> None:
    w = MetricsWindow(60.0)
    w.update([snap("a", 0, (0, 0, 0, 0)), snap("b", 0, (5, 5, 5, 5))], now=0)
    w.update([snap("a", 15, (4, 8, 8, 8)), snap("b", 15, (9, 9, 10, 10))], now=15)
    # b restarts: its counts drop, so its new value (1, 2, 2, 2) is the increase since the restart.
    # c is new: it counts from its first sample only.
    w.update([snap("a", 30, (4, 10, 10, 10)), snap("b", 30, (1, 2, 2, 2)), snap("c", 30, (50, 50, 50, 50))],
             now=30)
    w.update([snap("c", 45, (51, 53, 53, 53))], now=45)
    inc = w.increase("ttft")
    assert inc is not None
    # a: (4, 10, 10, 10) - 0. b: (4, 4, 5, 5) before the reset + (1, 2, 2, 2) after = (5, 6, 7, 7).
    # c: (51, 53, 53, 53) - (50, 50, 50, 50) = (1, 3, 3, 3). Sum: (10, 19, 20, 20).
    assert inc.buckets == (10, 19, 20, 20)
    assert inc.count == 20
    # p50: rank 10 is exactly le=0.1's count, in (0, 0.1]: 0.1 × 10/10 = 0.1. p90: rank 18 in (0.1, 0.5]
    # holding 9, 8 into it: 0.1 + 0.4 × 8/9 = 0.4556.
    assert w.quantile("ttft", 0.5) == pytest.approx(0.1)
    assert w.quantile("ttft", 0.9) == pytest.approx(0.1 + 0.4 * 8 / 9)
    # b vanishes from the pod list: its samples go, and with them its increase.
    w.update([], live={"a", "c"}, now=45)
    inc = w.increase("ttft")
    assert inc is not None and inc.buckets == (5, 13, 13, 13)
    assert w.pods() == {"a", "c"}


def test_window_drops_old_samples_and_reports_nothing_without_two_samples() -> None:
    w = MetricsWindow(30.0)
    w.update([snap("a", 0, (0, 0, 0, 0))], now=0)
    assert w.increase("ttft") is None and w.quantile("ttft", 0.5) is None
    w.update([snap("a", 20, (10, 10, 10, 10))], now=20)
    w.update([snap("a", 40, (10, 10, 10, 10))], now=40)  # the t=0 sample is out of the 30 s window
    inc = w.increase("ttft")
    assert inc is not None and inc.buckets == (0, 0, 0, 0)
    assert w.quantile("ttft", 0.5) is None  # no observations: NaN in PromQL, None here
    assert w.quantile("itl", 0.5) is None


def test_window_latency_takes_the_lower_of_window_and_last_interval() -> None:
    w = MetricsWindow(60.0)
    # Window: 10 fast requests then, in the last interval, 10 slow ones.
    w.update([snap("a", 0, (0, 0, 0, 0), queue=10)], now=0)
    w.update([snap("a", 15, (10, 10, 10, 10), queue=30)], now=15)
    w.update([snap("a", 30, (10, 10, 10, 20), queue=20)], now=30)
    # Window p50: rank 10 = le=0.1's count: 0.1. Last interval p50: all 10 in +Inf: 1.0. Lower: 0.1.
    assert w.quantile("ttft", 0.5) == pytest.approx(0.1)
    assert w.quantile("ttft", 0.5, last=True) == 1.0
    assert w.latency("ttft", 0.5) == pytest.approx(0.1)
    # Queue: the newest sum, and the mean over the window: (10 + 30 + 20) / 3 = 20, then with 80: 35.
    assert (w.queue_depth(), w.mean_queue_depth()) == (20, 20)
    w.update([snap("a", 45, (10, 10, 10, 20), queue=80), snap("b", 45, (0, 0, 0, 0), queue=4)], now=45)
    assert (w.queue_depth(), w.mean_queue_depth()) == (84, 39)  # b is new: its one sample is its mean
    assert w.queue_signal() == 39  # the lower of the two


def test_request_rate_sums_each_pods_last_interval_and_handles_restarts() -> None:
    w = MetricsWindow(60.0)
    assert w.request_rate() is None  # nothing scraped
    w.update([snap("a", 0, (0, 0, 0, 0)), snap("b", 0, (5, 5, 5, 5))], now=0)
    assert w.request_rate() is None  # one sample each: no interval yet
    w.update([snap("a", 15, (4, 8, 8, 30)), snap("b", 15, (9, 9, 10, 20))], now=15)
    assert w.request_rate() == pytest.approx(30 / 15 + 15 / 15)
    # b restarts (its count drops to 6): the 6 since the restart are its increase. a's last interval is 30 → 60.
    w.update([snap("a", 30, (4, 10, 10, 60)), snap("b", 30, (1, 2, 2, 6))], now=30)
    assert w.request_rate() == pytest.approx(30 / 15 + 6 / 15)
    # A pod new to the window has one sample: it would read as a dip, so there is no rate this round.
    w.update([snap("a", 45, (4, 10, 10, 75)), snap("b", 45, (1, 2, 2, 9)), snap("c", 45, (0, 0, 0, 3))], now=45)
    assert w.request_rate() is None
