"""The operator's entry point and its health/metrics endpoint."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import kopf
import pytest

from kvfleet_operator import __main__, metrics
from kvfleet_operator.config import OperatorConfig
from kvfleet_operator.state import OperatorState

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={"PATH": "/usr/bin:/bin", **(env or {})})


def test_help_lists_the_environment() -> None:
    p = run("-m", "kvfleet_operator", "--help")
    assert p.returncode == 0 and "KVFLEET_WATCH_NAMESPACE" in p.stdout and "KVFLEET_AGENT_IMAGE" in p.stdout


def test_bad_environment_exits_2_with_the_variable() -> None:
    p = run("-m", "kvfleet_operator", env={"KVFLEET_OPERATOR_PORT": "eighty"})
    assert p.returncode == 2 and "KVFLEET_OPERATOR_PORT" in p.stderr


def test_operator_imports_neither_torch_nor_the_agent() -> None:
    # The operator image installs none of the agent's dependencies (docker/operator.Dockerfile).
    p = run("-c", "import sys, kvfleet_operator.__main__, kvfleet_operator.crd\n"
                  "print(sorted(m for m in ('torch', 'kvfleet_agent', 'numpy') if m in sys.modules))")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_health_and_metrics_endpoint_on_a_free_port() -> None:
    async def main() -> tuple[int, int, str]:
        healthy = {"ok": False}
        runner, port = await metrics.serve(0, lambda: healthy["ok"])
        try:
            metrics.RECONCILES.labels(trigger="create", result="ok").inc()
            async with aiohttp.ClientSession() as s:
                async with s.get(f"http://127.0.0.1:{port}/healthz") as r1:
                    before = r1.status
                healthy["ok"] = True
                async with s.get(f"http://127.0.0.1:{port}/healthz") as r2:
                    after = r2.status
                async with s.get(f"http://127.0.0.1:{port}/metrics") as r3:
                    text = await r3.text()
            return before, after, text
        finally:
            await runner.cleanup()

    before, after, text = asyncio.run(main())
    assert (before, after) == (503, 200)
    assert 'kvfleet_operator_reconciles_total{result="ok",trigger="create"}' in text


def test_kopf_gets_the_state_and_its_peer_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    # The loops beside kopf tell their own entry in the peering object by the identity kopf writes it under.
    seen: dict[str, Any] = {}

    async def operator(**kwargs: Any) -> None:
        seen.update(kwargs)

    monkeypatch.setattr(kopf, "operator", operator)
    cfg = OperatorConfig(port=0, peering="kvfleet", peering_priority=7)
    asyncio.run(__main__.run(cfg))
    state = OperatorState.of(seen["memo"])
    assert state.cfg == cfg and seen["identity"] == state.identity == state.leadership.identity
    assert (seen["peering_name"], seen["priority"], seen["standalone"]) == ("kvfleet", 7, False)
