"""Shared by the router tests: a real kvfleet-router process, its fixtures, plain HTTP calls, counters from /metrics.

Not a conftest.py: tests/agent imports `conftest` by name, and a second conftest module would shadow it. Test
modules import the fixtures they use from here.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))  # the agents' process helper
from server_process import AgentProcess, start_agent

READY = re.compile(r"kvfleet-router ready: (http://\S+)")
MODEL = "tiny"


@dataclass
class RouterProcess:
    """A running kvfleet-router and its output."""

    proc: subprocess.Popen[str]
    url: str
    lines: list[str] = field(default_factory=list)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)


def start_router(*endpoints: str, hold_timeout: float = 120.0, flags: Sequence[str] = ()) -> RouterProcess:
    """`kvfleet-router --port 0` over the given MODEL=URL endpoints (and more flags), once it prints its ready line."""
    cmd = [sys.executable, "-m", "kvfleet_router.cli", "--port", "0", "--log-level", "WARNING",
           "--scrape-interval", "0.1", "--hold-timeout", str(hold_timeout),
           *[x for e in endpoints for x in ("--endpoint", e)], *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if m := READY.search(line):
            threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True).start()
            return RouterProcess(proc, m.group(1), lines)
    raise RuntimeError(f"router exited with {proc.wait()}:\n{''.join(lines)}")


def counters(url: str, family: str) -> dict[tuple[tuple[str, str], ...], float]:
    """A counter family's samples from a /metrics page, by label set."""
    text = OpenAIless.get(f"{url}/metrics")
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == family:
            for s in fam.samples:
                if s.name.endswith("_total") or s.name == family:
                    out[tuple(sorted(s.labels.items()))] = s.value
    return out


class OpenAIless:
    """Plain HTTP calls the openai client does not make (metrics, raw bodies)."""

    @staticmethod
    def get(url: str) -> str:
        async def go() -> str:
            async with aiohttp.ClientSession() as s, s.get(url) as r:
                return await r.text()
        return asyncio.run(go())

    @staticmethod
    def post(url: str, body: bytes, content_type: str = "application/json") -> tuple[int, dict[str, str], str]:
        async def go() -> tuple[int, dict[str, str], str]:
            async with aiohttp.ClientSession() as s, s.post(url, data=body,
                                                            headers={"Content-Type": content_type}) as r:
                return r.status, dict(r.headers), await r.text()
        return asyncio.run(go())


def served(agent: AgentProcess) -> float:
    """Requests an agent finished, by its own counter."""
    return sum(counters(agent.url, "kvfleet_requests").values())


def wait_for(check: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll check() until it holds (the router's scrape makes replicas ready within a fraction of a second)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{check} did not hold within {timeout:g}s")
        time.sleep(0.05)


@pytest.fixture(scope="module", name="agents")
def agents_fixture(tiny_checkpoint: Callable[..., str]) -> Iterator[list[AgentProcess]]:
    started = [start_agent(tiny_checkpoint("llama"), "--served-model-name", MODEL, "--max-queue-length", "64",
                           "--max-num-seqs", "8") for _ in range(2)]
    yield started
    for a in started:
        a.stop()


@pytest.fixture(scope="module", name="router")
def router_fixture(agents: list[AgentProcess]) -> Iterator[RouterProcess]:
    r = start_router(f"{MODEL}={agents[0].url},{agents[1].url}")
    wait_for(lambda: '"ready_replicas": 2' in json.dumps(json.loads(OpenAIless.get(f"{r.url}/v1/models"))))
    yield r
    r.stop()


async def stand_in(routes: Sequence[web.RouteDef]) -> tuple[web.AppRunner, str]:
    """A stand-in agent serving `routes` on a free loopback port: its runner (clean it up) and its URL."""
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"
