"""A real agent's start-up phases (gauges and log lines) and --metrics-compat: set, from the environment, refused."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import start_agent

from kvfleet_agent import cli
from kvfleet_contract import metrics as contract


def _startup_gauges(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    assert "vllm:num_requests_running" in text  # --metrics-compat vllm took effect
    return {s.labels[contract.PHASE_LABEL]: s.value for family in text_string_to_metric_families(text)
            if family.name == contract.STARTUP_PHASE_SECONDS for s in family.samples}


def test_every_phase_is_exported_logged_and_within_the_whole_start(ckpt: Path) -> None:
    began = time.monotonic()
    agent = start_agent(str(ckpt), "--metrics-compat", "vllm", log_level="INFO")
    within = time.monotonic() - began  # the test's own measure of the start, from before the process existed
    try:
        with urllib.request.urlopen(agent.url + "/ready", timeout=10) as r:
            assert r.status == 200
        phases = _startup_gauges(agent.url)
    finally:
        assert agent.stop() == 0
    # On CPU decode runs eagerly: graph capture has no sample (not a fake 0) and its log line says why.
    assert set(phases) == set(contract.STARTUP_PHASES) - {"graph_capture"}
    assert all(v >= 0 for v in phases.values()), phases
    total = phases.pop(contract.FIRST_READY_PHASE)
    # /proc gives the process's start in clock ticks, rounded down: its age may read up to one tick long.
    assert sum(phases.values()) <= total <= within + 1 / os.sysconf("SC_CLK_TCK")
    assert phases["weights_read"] > 0 and phases["warmup"] > 0  # real work was timed, not a placeholder
    log = "".join(agent.lines)
    for phase, seconds in phases.items():
        assert f"start-up phase {phase}: {seconds:.3f} s" in log
    assert re.search(r"start-up phase graph_capture: skipped \(decode runs eagerly on cpu: CUDA graphs need a GPU\)",
                     log)
    assert f"start-up: first_ready after {total:.3f} s (" in log and "other " in log


def test_an_unknown_metrics_compat_flag_is_refused_by_name(capsys: pytest.CaptureFixture[str], ckpt: Path) -> None:
    assert cli.main(["serve", str(ckpt), "--metrics-compat", "prometheus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvfleet-agent: error: --metrics-compat 'prometheus'") and "kvfleet, vllm" in err


def test_an_unknown_metrics_compat_from_the_environment_stops_the_start_with_no_traceback(ckpt: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLEET_")} | {"KVFLEET_METRICS_COMPAT": "vLLM"}
    p = subprocess.run([sys.executable, "-m", "kvfleet_agent.cli", "serve", str(ckpt), "--port", "0",
                        "--grpc-port", "-1"], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "--metrics-compat 'vLLM' (or KVFLEET_METRICS_COMPAT) must be one of kvfleet, vllm" in p.stderr
    assert "Traceback" not in p.stderr + p.stdout and "start-up phase" not in p.stderr  # refused before loading
