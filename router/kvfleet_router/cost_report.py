"""The cost report of complexity tiers: the seed's request mix through a tiered router, then on its top tier alone."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from kvfleet_router.agreement import answer_text
from kvfleet_router.cost_figures import Samples, figures, table, total
from kvfleet_router.cost_workload import LARGE, SMALL, TIERED, Request, parameters, tiers_config, workload
from kvfleet_router.metrics import QUALITY_BUCKETS
from kvfleet_router.tier_config import parse_tiers

USAGE = """\
  python -m kvfleet_router.cost_report [--small DIR --large DIR] [--requests 400] [--json PATH]

Starts two agents (code-small, code-large; default: the pair `kvfleet-agent model train-tiny` makes) and a router
whose tiered model `code` serves simple and medium requests on code-small, complex and expert ones on code-large;
sends the workload through it, then the same requests to code-large alone. Replica-seconds are each agent's busy
time: the wall time its kvfleet_requests_running gauge, polled, was above 0."""
AGENT_READY = re.compile(r"kvfleet-agent ready: (http://[\d.]+:\d+)")
ROUTER_READY = re.compile(r"kvfleet-router ready: (http://\S+)")
RUNNING = re.compile(r"^kvfleet_requests_running\{[^}]*\} (\S+)$", re.M)
QUIET_S = 1.0  # agents idle and the monitor's counters still this long: its replays are done (it exports no in-flight)


class Proc:
    """A process the report started; a thread drains its output (the last lines kept for errors)."""

    def __init__(self, cmd: list[str], ready: re.Pattern[str]) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLEET_")}  # no stray KVFLEET_MODEL
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: collections.deque[str] = collections.deque(maxlen=100)
        self.found: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._drain, args=(ready,), daemon=True).start()

    def _drain(self, ready: re.Pattern[str]) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if m := ready.search(line):
                self.found.put(m.group(1))
        self.found.put(None)  # it exited

    def url(self, timeout: float) -> str:
        """Its URL, once it printed its ready line."""
        with contextlib.suppress(queue.Empty):
            if (got := self.found.get(timeout=timeout)) is not None:
                return got
        raise RuntimeError(f"{' '.join(self.cmd)} not ready (exit {self.proc.poll()}):\n{''.join(self.lines)}")

    def stop(self) -> None:
        """SIGTERM to this pid, then SIGKILL if it has not exited in 30 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def cpu_seconds(pid: int) -> float | None:
    """A process's CPU time (user + system) from /proc; None where there is no /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Session:
    """The report's HTTP calls: the load, /metrics, and the busy-time pollers."""

    def __init__(self, http: aiohttp.ClientSession, agents: dict[str, str], pids: dict[str, int], router: str,
                 poll_s: float) -> None:
        self.http, self.agents, self.pids, self.router, self.poll_s = http, agents, pids, router, poll_s
        self.busy = dict.fromkeys(agents, 0.0)
        self.last_busy = dict.fromkeys(agents, time.monotonic())

    async def metrics(self, url: str) -> Samples:
        async with self.http.get(f"{url}/metrics") as r:
            text = await r.text()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    async def _poll(self, name: str) -> None:
        """Busy time as a left Riemann sum of the running gauge: an interval counts when it began busy (unbiased,
        since polls fall at random phases of the requests)."""
        prev: tuple[float, bool] | None = None
        while True:
            async with self.http.get(f"{self.agents[name]}/metrics") as r:
                m = RUNNING.search(await r.text())
            now, busy = time.monotonic(), m is not None and float(m.group(1)) > 0
            if prev is not None and prev[1]:
                self.busy[name] += now - prev[0]
            if busy:
                self.last_busy[name] = now
            prev = (now, busy)
            await asyncio.sleep(self.poll_s)  # the poll period, not a wait for anything

    async def send(self, model: str, reqs: list[Request], concurrency: int, desc: str) -> list[dict[str, Any]]:
        """Every request, `concurrency` at a time, in order: status, answer text, the tier header's fields."""
        out: list[dict[str, Any]] = [{} for _ in reqs]
        todo = iter(enumerate(reqs))
        with tqdm(total=len(reqs), desc=desc, unit="req", file=sys.stderr) as bar:
            async def worker() -> None:
                for i, r in todo:  # one iterator shared by the workers: each request is sent once
                    body = {"model": model, "prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": 0}
                    async with self.http.post(f"{self.router}/v1/completions", json=body) as resp:
                        data, header = await resp.read(), resp.headers.get("x-kvfleet-tier", "")
                        out[i] = {"status": resp.status, "text": answer_text(data, resp.content_type) or "",
                                  **dict(p.split("=", 1) for p in header.split("; ") if "=" in p)}
                    bar.update()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        return out

    async def phase(self, model: str, reqs: list[Request], concurrency: int) -> dict[str, Any]:
        """Send the workload as `model`, wait for the monitor's replays, and measure each agent meanwhile."""
        before = {n: await self.metrics(u) for n, u in self.agents.items()}
        self.busy = dict.fromkeys(self.agents, 0.0)
        cpu = {n: cpu_seconds(pid) for n, pid in self.pids.items()}
        pollers = [asyncio.create_task(self._poll(n), name=f"{n} /metrics") for n in self.agents]
        start = time.monotonic()
        answers = await self.send(model, reqs, concurrency, model)
        seen, since = None, time.monotonic()
        while time.monotonic() - max(since, *self.last_busy.values()) < QUIET_S:
            r = await self.metrics(self.router)
            counts = tuple(total(r, f"kvfleet_router_tier_{x}_total") for x in ("verifications", "replays"))
            seen, since = counts, (since if counts == seen else time.monotonic())
            await asyncio.sleep(self.poll_s)
        wall = time.monotonic() - start
        for t in pollers:
            if t.done() and (e := t.exception()) is not None:  # an agent stopped answering: its figure is void
                raise RuntimeError(f"polling {t.get_name()} failed: {e!r}") from e
            t.cancel()
        await asyncio.gather(*pollers, return_exceptions=True)
        after = {n: await self.metrics(u) for n, u in self.agents.items()}
        cpu_s = {n: None if (x := cpu_seconds(pid)) is None or (y := cpu[n]) is None else x - y
                 for n, pid in self.pids.items()}

        def delta(name: str) -> dict[str, float]:
            return {n: total(after[n], name) - total(before[n], name) for n in self.agents}
        return {"answers": answers, "wall_s": wall, "busy_s": dict(self.busy), "cpu_s": cpu_s,
                "router": await self.metrics(self.router), "agent_requests": delta("kvfleet_requests_total"),
                "agent_generation_tokens": delta("kvfleet_generation_tokens_total")}


async def measure(a: argparse.Namespace, agents: dict[str, str], pids: dict[str, int], router: str,
                  reqs: list[Request]) -> dict[str, Any]:
    """The tiered run, then the top tier alone, on the same agents behind the same router."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        s = Session(http, agents, pids, router, a.poll_interval)
        deadline = time.monotonic() + 60
        while True:
            async with http.get(f"{router}/v1/models") as r:
                if all(m["ready_replicas"] for m in (await r.json())["data"]):
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the router did not see both agents ready in 60 s")
            await asyncio.sleep(0.1)
        for model, url in agents.items():  # warm-up, straight to the agents: outside every figure
            async with http.post(f"{url}/v1/completions", json={"model": model, "prompt": "import os\n",
                                                                "max_tokens": 4, "temperature": 0}) as r:
                await r.read()
        tiered = await s.phase(TIERED, reqs, a.concurrency)
        return {"tiered": tiered, "top_only": await s.phase(LARGE, reqs, a.concurrency)}


def quality(a: argparse.Namespace) -> dict[str, Any]:
    """The monitor's settings; its budget lifted so that every sampled answer is scored (the report measures what
    the sample rate costs, not the budget)."""
    return {"sampleRate": a.sample_rate, "threshold": a.threshold, "windowSeconds": a.window,
            "minSamples": a.min_samples, "maxConcurrentReplays": 64, "maxReplaysPerMinute": 100000}


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line; every error names the flag."""
    p = argparse.ArgumentParser(prog="python -m kvfleet_router.cost_report", description=USAGE, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", metavar="DIR", help="the small tier's checkpoint (with --large; same tokenizer)")
    p.add_argument("--large", metavar="DIR", help="the top tier's checkpoint")
    p.add_argument("--large-cost", type=float, help="code-large's cost (default: its parameters / code-small's)")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--seed", type=int, default=0, help="the workload's seed")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--sample-rate", type=float, default=0.05, help="the monitor's share of lower-tier answers")
    p.add_argument("--threshold", type=float, default=0.5, help="agreement threshold (a histogram bucket bound)")
    p.add_argument("--window", type=float, default=300.0, help="the monitor's window, seconds")
    p.add_argument("--min-samples", type=int, default=20, help="scores a window needs to decide")
    p.add_argument("--length-scale", type=float, default=1.0, help="prompt lengths and class limits x this")
    p.add_argument("--poll-interval", type=float, default=0.05, help="seconds between polls of each agent's gauge")
    p.add_argument("--agent-threads", type=int, default=1, help="torch threads of each agent")
    p.add_argument("--json", metavar="PATH", help="write every figure here")
    a = p.parse_args(argv)
    if (a.small is None) != (a.large is None):
        p.error("--small and --large go together (or neither: the train-tiny pair)")
    if a.requests < 1 or a.concurrency < 1 or a.agent_threads < 1 or a.poll_interval <= 0:
        p.error("--requests, --concurrency and --agent-threads must be >= 1, --poll-interval > 0")
    if a.threshold not in QUALITY_BUCKETS:
        p.error(f"--threshold={a.threshold} must be a bound of the quality histogram: {QUALITY_BUCKETS}")
    if not 0 < a.length_scale <= 4:
        p.error(f"--length-scale={a.length_scale} must be in (0, 4]")
    return a


def stop_all(procs: list[Proc]) -> None:
    """Stop every process started, the router first (by pid, one by one)."""
    for p in reversed(procs):
        p.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the report; every process it started is stopped on the way out, whatever happened."""
    a = parse(argv)
    procs: list[Proc] = []
    with contextlib.ExitStack() as stack:
        if a.small is None:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvfleet-cost-report-"))
            subprocess.run([sys.executable, "-m", "kvfleet_agent.cli", "--log-level", "WARNING", "model", "train-tiny",
                            tmp], check=True, stdout=subprocess.DEVNULL)  # from the cache once trained
            a.small, a.large = f"{tmp}/draft", f"{tmp}/target"
        stack.callback(stop_all, procs)
        params = {SMALL: parameters(a.small), LARGE: parameters(a.large)}
        costs = {SMALL: 1.0, LARGE: a.large_cost if a.large_cost is not None else params[LARGE] / params[SMALL]}
        print(f"{LARGE} cost {costs[LARGE]:.3f} ({params[LARGE]:,} / {params[SMALL]:,} parameters)"
              if a.large_cost is None else f"{LARGE} cost {costs[LARGE]:g} (--large-cost)", file=sys.stderr)
        tiers = tiers_config(costs[LARGE], a.length_scale, quality(a))
        reqs = workload(a.requests, a.seed, a.length_scale, parse_tiers(tiers)[TIERED])
        for name, model in ((SMALL, a.small), (LARGE, a.large)):
            procs.append(Proc([sys.executable, "-m", "kvfleet_agent.cli", "--log-level", "WARNING", "serve", "--model",
                               model, "--served-model-name", name, "--host", "127.0.0.1", "--port", "0",
                               "--grpc-port", "-1", "--num-threads", str(a.agent_threads)], AGENT_READY))
        agents = {name: p.url(180) for name, p in zip((SMALL, LARGE), procs, strict=True)}
        procs.append(Proc([sys.executable, "-m", "kvfleet_router.cli", "--port", "0", "--log-level", "WARNING",
                           *[x for n, u in agents.items() for x in ("--endpoint", f"{n}={u}")],
                           "--tiers", json.dumps(tiers)], ROUTER_READY))
        pids = {name: p.proc.pid for name, p in zip((SMALL, LARGE), procs, strict=False)}
        runs = asyncio.run(measure(a, agents, pids, procs[-1].url(60), reqs))
        report = figures(a, reqs, runs, costs, params, tiers)
    print(table(report))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _terminated(signum: int, frame: object) -> NoReturn:
    raise SystemExit(128 + signum)  # unwinds main(), which stops the processes it started


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminated)
    sys.exit(main())
