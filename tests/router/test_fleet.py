"""The router's view of a replica: scraped gauges, corrected for what finished since, and readiness releasing holds."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web
from router_helpers import stand_in

from kvfleet_contract import metrics as contract
from kvfleet_router.fleet import TIMEOUTS_BEFORE_UNREADY, Fleet, Replica, parse_gauges

Handler = Callable[[web.Request], Awaitable[web.Response]]


async def replica(ready: Handler, metrics: Handler) -> tuple[web.AppRunner, str]:
    """A stand-in agent serving /ready and /metrics: its runner and URL."""
    return await stand_in([web.get("/ready", ready), web.get("/metrics", metrics)])


def test_requests_that_finished_since_the_scrape_no_longer_count() -> None:
    r = Replica("a", "http://a", waiting=2.0, running=3.0, in_flight=5)
    assert r.load().load == 5
    for _ in range(4):  # four of ours finished after the scrape counted them
        r.finished()
    assert r.in_flight == 1 and r.load().load == 1  # 5 scraped - 4 gone, and our own 1 in flight
    for _ in range(3):
        r.finished()
    assert r.load().waiting == 0 and r.load().running == 0  # never below zero


def test_gauges_are_read_by_the_contract_names() -> None:
    text = (f"# TYPE {contract.REQUESTS_WAITING} gauge\n{contract.REQUESTS_WAITING}{{model=\"m\"}} 4.0\n"
            f"# TYPE {contract.REQUESTS_RUNNING} gauge\n{contract.REQUESTS_RUNNING}{{model=\"m\"}} 2.0\n"
            f"# TYPE {contract.KV_CACHE_USAGE} gauge\n{contract.KV_CACHE_USAGE}{{model=\"m\"}} 0.5\n"
            "# TYPE other gauge\nother 9.0\n")
    assert parse_gauges(text) == {contract.REQUESTS_WAITING: 4.0, contract.REQUESTS_RUNNING: 2.0,
                                  contract.KV_CACHE_USAGE: 0.5}


def test_the_first_ready_replica_of_a_model_releases_its_held_requests() -> None:
    woken: list[str] = []
    fleet = Fleet(on_ready=woken.append)
    fleet.set_endpoints("m", {"a": "http://a", "b": "http://b"})
    a, b = fleet.models["m"]["a"], fleet.models["m"]["b"]
    fleet.mark("m", a, True)
    fleet.mark("m", b, True)  # not the first: nothing more to release
    assert woken == ["m"] and [r.name for r in fleet.ready("m")] == ["a", "b"]
    fleet.set_endpoints("m", {"a": "http://a", "c": "http://c"})  # a keeps its state, b goes, c starts unready
    assert [r.name for r in fleet.ready("m")] == ["a"] and fleet.models["m"]["a"] is a


def test_a_replica_that_times_out_stays_ready_until_it_misses_three_scrapes_and_a_refusal_acts_at_once() -> None:
    async def body() -> None:
        release = asyncio.Event()
        stalled = [False]

        async def ready(_: web.Request) -> web.Response:
            if stalled[0]:
                await release.wait()  # busy: answers only once released, long after the scrape's timeout
            return web.Response(text="ok")

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text=f"# TYPE {contract.REQUESTS_WAITING} gauge\n{contract.REQUESTS_WAITING} 7.0\n")

        runner, url = await replica(ready, metrics)
        fleet = Fleet(on_ready=lambda model: None)
        fleet.set_endpoints("m", {"a": url})
        a = fleet.models["m"]["a"]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.2)) as session:
            await fleet.scrape(session)
            assert a.ready and a.waiting == 7.0
            stalled[0] = True
            seen = []
            for _ in range(TIMEOUTS_BEFORE_UNREADY):
                await fleet.scrape(session)
                seen.append(a.ready)
            assert seen == [True] * (TIMEOUTS_BEFORE_UNREADY - 1) + [False] and a.waiting == 7.0
            stalled[0] = False
            release.set()
            await fleet.scrape(session)
            assert a.ready and a.timeouts == 0  # answering again: ready, and the count starts over
            await runner.cleanup()  # now nothing listens on the port: refused, unready on the first scrape
            await fleet.scrape(session)
            assert not a.ready

    asyncio.run(asyncio.wait_for(body(), 30))


def test_a_request_that_finishes_while_the_gauges_are_read_is_not_counted_twice() -> None:
    async def body() -> None:
        fleet = Fleet(on_ready=lambda model: None)

        async def ready(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def metrics(_: web.Request) -> web.Response:
            # The agent reads its gauges with 3 of ours running; one of them ends before the answer lands.
            text = f"# TYPE {contract.REQUESTS_RUNNING} gauge\n{contract.REQUESTS_RUNNING} 3.0\n"
            fleet.models["m"]["a"].finished()
            return web.Response(text=text)

        runner, url = await replica(ready, metrics)
        fleet.set_endpoints("m", {"a": url})
        a = fleet.models["m"]["a"]
        a.in_flight = 3
        a.finished()  # one ended before the scrape began: the gauges no longer count it
        a.in_flight += 1  # and another was sent
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
                await fleet.scrape(session)
        finally:
            await runner.cleanup()
        # 2 of ours are in flight: the scraped 3 less the one that ended during the read, never the stale 3.
        assert a.in_flight == 2 and a.load().running == 2 and a.load().load == 2

    asyncio.run(asyncio.wait_for(body(), 30))
