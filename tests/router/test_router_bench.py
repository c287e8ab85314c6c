"""The router's added-latency benchmark on real processes: it runs, pairs its rounds, and reports sane figures."""

from __future__ import annotations

import json
import subprocess
import sys

from router_helpers import MODEL, RouterProcess, agents_fixture, router_fixture  # noqa: F401 (fixtures, found by name)
from server_process import AgentProcess

from kvfleet_router.bench import percentile


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0 and percentile(values, 100) == 100.0
    assert percentile([3.0], 99) == 3.0


def test_the_benchmark_reports_direct_and_added_latency(router: RouterProcess, agents: list[AgentProcess]) -> None:
    out = subprocess.run([sys.executable, "-m", "kvfleet_router.bench", "--agent", agents[0].url, "--router",
                          router.url, "--model", MODEL, "--requests", "20", "--warmup", "2"],
                         capture_output=True, text=True, timeout=300, check=True)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["requests"] == 20
    assert 0 < figures["direct_p50_ms"] < figures["routed_p50_ms"] + 50  # both measured, same order of size
    assert figures["added_p99_ms"] >= figures["added_p50_ms"]
