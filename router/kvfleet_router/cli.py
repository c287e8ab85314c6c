"""`kvfleet-router`: serve one OpenAI endpoint in front of the agents of one or more models."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence

from kvfleet_router.fleet import Fleet
from kvfleet_router.hold_queue import HoldQueue
from kvfleet_router.proxy import serve, static_endpoints, wire

log = logging.getLogger("kvfleet_router")


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line; every error names the flag."""
    p = argparse.ArgumentParser(prog="kvfleet-router", description=__doc__, allow_abbrev=False)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080, help="0 picks a free port (printed when ready)")
    p.add_argument("--endpoint", action="append", default=[], metavar="MODEL=URL[,URL...]",
                   help="a model and its agents' base URLs (repeatable)")
    p.add_argument("--epsilon", type=float, default=0.25,
                   help="bounded load: no replica above (1 + epsilon) x the mean load by prefix affinity")
    p.add_argument("--scrape-interval", type=float, default=0.25, help="seconds between scrapes of each agent")
    p.add_argument("--hold-queue-size", type=int, default=256, help="requests held per model with no replica")
    p.add_argument("--hold-timeout", type=float, default=120.0, help="seconds a held request may wait")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    a = p.parse_args(argv)
    if a.epsilon < 0:
        p.error(f"--epsilon={a.epsilon} must be >= 0")
    if a.scrape_interval <= 0:
        p.error(f"--scrape-interval={a.scrape_interval} must be > 0")
    try:
        a.endpoints = static_endpoints(a.endpoint)
        a.holds = HoldQueue(a.hold_queue_size, a.hold_timeout)
    except ValueError as e:
        p.error(str(e))
    if not a.endpoints:
        p.error("give at least one --endpoint MODEL=URL")
    return a


async def run(a: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT."""
    fleet = Fleet()
    for model, endpoints in a.endpoints.items():
        fleet.set_endpoints(model, endpoints)
    router = wire(fleet, a.holds, epsilon=a.epsilon)
    runner, port = await serve(router, a.host, a.port, a.scrape_interval)
    print(f"kvfleet-router ready: http://{a.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    runner.app["scraper"].cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await runner.app["scraper"]
    await runner.cleanup()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `kvfleet-router`."""
    a = parse(argv)
    logging.basicConfig(level=a.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(run(a))


if __name__ == "__main__":
    sys.exit(main())
