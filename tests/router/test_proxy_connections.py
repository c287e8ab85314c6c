"""What an upstream connection's failure does to its replica: a dropped connection moves only its request, a refused
one takes the replica out until a scrape finds it answering."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web
from router_helpers import stand_in

from kvfleet_router.fleet import Fleet
from kvfleet_router.hold_queue import HoldQueue
from kvfleet_router.proxy import serve, wire


class StandIn:
    """An agent stand-in on a free loopback port: ready, no load, answers completions (dropping the first `drop`
    connections unanswered) and counts what it answered."""

    def __init__(self, drop: int = 0) -> None:
        self.drop, self.answered = drop, 0
        self.runner: web.AppRunner | None = None

    async def start(self) -> str:
        self.runner, url = await stand_in([web.get("/ready", self._empty), web.get("/metrics", self._empty),
                                           web.post("/v1/completions", self._complete)])
        return url

    async def _empty(self, _: web.Request) -> web.Response:
        return web.Response(text="")

    async def _complete(self, request: web.Request) -> web.Response:
        await request.read()
        if self.drop > 0:
            self.drop -= 1
            assert request.transport is not None
            request.transport.close()  # gone without a byte of answer, as a connection closed under a reuse
        else:
            self.answered += 1
        return web.json_response({"choices": [{"text": "ok"}]})


def test_a_dropped_connection_moves_its_request_and_a_refused_one_takes_the_replica_out() -> None:
    async def main() -> None:
        flaky, steady = StandIn(drop=1), StandIn()
        fleet = Fleet()
        fleet.set_endpoints("m", {"flaky": await flaky.start(), "steady": await steady.start()}, ready=True)
        runner, port, scraper = await serve(wire(fleet, HoldQueue(8, 60.0)), "127.0.0.1", 0, 3600.0)
        try:
            async with aiohttp.ClientSession() as session:
                async def post(i: int) -> int:
                    body = {"model": "m", "prompt": f"request {i} on its own topic {i * 7}", "max_tokens": 4}
                    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                        await resp.read()
                        return resp.status

                statuses = [await post(i) for i in range(40)]
                assert statuses == [200] * 40
                # The drop moved one request; the replica stayed in and took its share of the rest.
                assert flaky.drop == 0 and flaky.answered >= 8 and flaky.answered + steady.answered == 40
                assert {r.name for r in fleet.ready("m")} == {"flaky", "steady"}
                assert flaky.runner is not None
                await flaky.runner.cleanup()  # nothing listens there now: connections are refused
                statuses = [await post(i) for i in range(40, 60)]
                assert statuses == [200] * 20 and [r.name for r in fleet.ready("m")] == ["steady"]
        finally:
            scraper.cancel()
            await runner.cleanup()
            assert steady.runner is not None
            await steady.runner.cleanup()

    asyncio.run(asyncio.wait_for(main(), 30))
