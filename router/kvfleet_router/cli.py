"""`kvfleet-router`: serve one OpenAI endpoint in front of the agents of one or more models.

Agents come from --endpoint flags, or with --kubernetes from the InferenceDeployments of the watched namespaces and
their Ready agent pods (the router's RBAC: get, list and watch pods and inferencedeployments in each).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import signal
import sys
from collections.abc import Sequence

from kvfleet_router.discovery import Discovery
from kvfleet_router.fleet import Fleet
from kvfleet_router.hold_queue import HoldQueue
from kvfleet_router.kube import SA_DIR, KubeClient, KubeConfigError, load_config, own_namespace
from kvfleet_router.proxy import serve, static_endpoints, wire
from kvfleet_router.tier_config import load_tiers

log = logging.getLogger("kvfleet_router")
NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # a DNS-1123 label


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line; every error names the flag."""
    p = argparse.ArgumentParser(prog="kvfleet-router", description=__doc__, allow_abbrev=False)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080, help="0 picks a free port (printed when ready)")
    p.add_argument("--endpoint", action="append", default=[], metavar="MODEL=URL[,URL...]",
                   help="a model and its agents' base URLs (repeatable)")
    p.add_argument("--kubernetes", action="store_true",
                   help="instead of --endpoint: the InferenceDeployments and Ready agent pods of watched namespaces")
    p.add_argument("--kubeconfig", metavar="PATH",
                   help="with --kubernetes: credentials (default: $KUBECONFIG, else the pod's service account)")
    p.add_argument("--watch-namespace", action="append", default=[], metavar="NS",
                   help="with --kubernetes: a namespace to watch (repeatable; default: the router's own)")
    p.add_argument("--epsilon", type=float, default=0.25,
                   help="bounded load: no replica above (1 + epsilon) x the mean load by prefix affinity")
    p.add_argument("--scrape-interval", type=float, default=0.25, help="seconds between scrapes of each agent")
    p.add_argument("--hold-queue-size", type=int, default=256, help="requests held per model with no replica")
    p.add_argument("--hold-timeout", type=float, default=120.0, help="seconds a held request may wait")
    p.add_argument("--tiers", metavar="JSON|@PATH",
                   help="tiered models: a JSON list (an InferenceRouter's spec.tieredModels), or @PATH of a JSON or "
                        "YAML file: one model name for served models cheapest first, a classifier, a quality monitor")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    a = p.parse_args(argv)
    if a.epsilon < 0:
        p.error(f"--epsilon={a.epsilon} must be >= 0")
    if a.scrape_interval <= 0:
        p.error(f"--scrape-interval={a.scrape_interval} must be > 0")
    try:
        a.endpoints = static_endpoints(a.endpoint)
        a.holds = HoldQueue(a.hold_queue_size, a.hold_timeout)
        a.tiered = load_tiers(a.tiers) if a.tiers else {}
    except ValueError as e:
        p.error(str(e))
    if a.kubernetes:
        _kubernetes(p, a)
    elif a.kubeconfig or a.watch_namespace:
        p.error(f"{'--kubeconfig' if a.kubeconfig else '--watch-namespace'} needs --kubernetes")
    elif not a.endpoints:
        p.error("give at least one --endpoint MODEL=URL, or --kubernetes")
    return a


def _kubernetes(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Credentials and namespaces of --kubernetes (read here, before the event loop runs)."""
    if a.endpoints:
        p.error("--endpoint and --kubernetes are two ways to find the agents: give one")
    try:
        a.kube = load_config(a.kubeconfig, os.environ)
    except KubeConfigError as e:
        p.error(f"{'--kubeconfig' if a.kubeconfig else '--kubernetes'}: {e}")
    a.namespaces = list(dict.fromkeys(a.watch_namespace))
    if bad := [ns for ns in a.namespaces if not NAMESPACE.fullmatch(ns)]:
        p.error(f"--watch-namespace {bad[0]!r} is not a namespace name (a DNS-1123 label)")
    if not a.namespaces:
        own = own_namespace(os.environ)
        if own is None:
            p.error(f"--watch-namespace: not given, and the router's own namespace is unknown (no {SA_DIR}/namespace, "
                    "no $POD_NAMESPACE)")
        a.namespaces = [own]


async def run(a: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT (or, with --kubernetes, until discovery fails: exit 1)."""
    fleet = Fleet(synced=not a.kubernetes)
    for model, endpoints in a.endpoints.items():
        fleet.set_endpoints(model, endpoints)
    router = wire(fleet, a.holds, epsilon=a.epsilon, tiered=a.tiered)
    async with contextlib.AsyncExitStack() as stack:
        tasks: list[asyncio.Task[None]] = []
        if a.kubernetes:
            client = await stack.enter_async_context(KubeClient(a.kube))
            log.info("discovering agents in namespace(s) %s through %s (%s)", ", ".join(a.namespaces),
                     a.kube.server, a.kube.source)
            tasks.append(asyncio.create_task(Discovery(fleet, client, a.namespaces).run(), name="discovery"))
        runner, port, scraper = await serve(router, a.host, a.port, a.scrape_interval)
        print(f"kvfleet-router ready: http://{a.host}:{port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        tasks.append(scraper)
        stopped = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
        failed = [t for t in done if t is not stopped]
        for t in failed:  # discovery and the scrape loop retry what can heal and never end: an end is a bug, fatal
            log.error("%s stopped", t.get_name(), exc_info=None if t.cancelled() else t.exception())
        for t in (stopped, *tasks):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await runner.cleanup()
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `kvfleet-router`."""
    a = parse(argv)
    logging.basicConfig(level=a.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(run(a))


if __name__ == "__main__":
    sys.exit(main())
