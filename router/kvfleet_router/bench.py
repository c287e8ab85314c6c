"""The router's added latency: the same request straight to an agent and through the router, alternated, paired.

  python -m kvfleet_router.bench --agent http://127.0.0.1:8000 --router http://127.0.0.1:8080 [--requests 400]

Each round sends one short request (one generated token) directly, then through the router, one
at a time, so the agent is never the bottleneck; the figure is the per-round difference (router
minus direct), whose median and 99th percentile are printed with the direct latency beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Sequence

import aiohttp
from tqdm import tqdm


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by the nearest-rank method."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


async def timed(session: aiohttp.ClientSession, url: str, body: bytes) -> float:
    """Seconds from sending the request to reading the whole answer."""
    start = time.perf_counter()
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url} answered {r.status}")
    return time.perf_counter() - start


async def run(agent: str, router: str, model: str, requests: int, warmup: int) -> dict[str, float]:
    """Alternate direct and routed requests; the figures of the paired differences."""
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0.0}).encode()
    direct, routed = [], []
    async with aiohttp.ClientSession() as s:
        for i in tqdm(range(warmup + requests), desc="rounds", unit="round", file=sys.stderr):
            d = await timed(s, f"{agent}/v1/completions", body)
            r = await timed(s, f"{router}/v1/completions", body)
            if i >= warmup:
                direct.append(d)
                routed.append(r)
    added = [r - d for d, r in zip(direct, routed, strict=True)]
    return {"requests": float(requests), "direct_p50_ms": 1e3 * statistics.median(direct),
            "routed_p50_ms": 1e3 * statistics.median(routed), "added_p50_ms": 1e3 * statistics.median(added),
            "added_p99_ms": 1e3 * percentile(added, 99)}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, run, print one JSON line."""
    p = argparse.ArgumentParser(prog="python -m kvfleet_router.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agent", required=True, help="an agent's base URL (one the router routes to)")
    p.add_argument("--router", required=True, help="the router's base URL")
    p.add_argument("--model", default="tiny")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--warmup", type=int, default=20)
    a = p.parse_args(argv)
    if a.requests < 1 or a.warmup < 0:
        p.error("--requests must be >= 1 and --warmup >= 0")
    print(json.dumps(asyncio.run(run(a.agent.rstrip("/"), a.router.rstrip("/"), a.model, a.requests, a.warmup))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
