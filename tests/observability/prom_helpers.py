"""A real Prometheus for tests: the binaries of e2e/prometheus.sh, a generated scrape config, a free loopback port."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Each series' labels and value(s), as the HTTP API returns them.
Series = dict[str, Any]


def prometheus_bin(name: str) -> str:
    """prometheus or promtool: e2e/prometheus.sh's cache when it has one (it prints the dir; it only downloads when the
    cache is empty), else PATH. The test tier's setup (make prom-bins) runs the script first."""
    found = shutil.which(name)
    try:
        out = subprocess.run(["bash", str(ROOT / "e2e" / "prometheus.sh")], capture_output=True, text=True,
                             timeout=300, check=True).stdout.strip().splitlines()
        candidate = Path(out[-1]) / name if out else None
        if candidate is not None and candidate.exists():
            return str(candidate)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
        pass
    if found is None:
        pytest.fail(f"{name} not found: run `bash e2e/prometheus.sh` (make prom-bins) first")
    return found


def listening_port(pid: int) -> int | None:
    """The TCP port process pid listens on, from /proc (Prometheus started on port 0 does not log the real one)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed while we looked
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                return int(fields[1].rsplit(":", 1)[1], 16)
    return None


def poll(check: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll check() every 50 ms until it holds (a condition, not a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not hold within {timeout:g}s")
        time.sleep(0.05)


@dataclass
class Prometheus:
    """A running Prometheus: its process, base URL and output log."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; returns data, or raises with Prometheus' error text."""
        query = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{path} {params}: HTTP {e.code}: {e.read().decode()}") from e
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[Series]:
        """An instant query's result vector (or a scalar as one unlabelled series)."""
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def scalar(self, expr: str) -> float:
        """An expression's single value, NaN if it has no series."""
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else float("nan")

    def stop(self) -> None:
        """SIGTERM this pid, then wait; kill only it if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def scrape_config(jobs: dict[str, list[tuple[str, dict[str, str]]]], rule_files: tuple[str, ...]) -> dict[str, Any]:
    """Scrape every second; jobs: name -> [(host:port, labels the cluster's relabeling would add)]."""
    return {"global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": list(rule_files),
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [t], "labels": labels}
                                                                      for t, labels in targets]}
                               for job, targets in jobs.items()]}


def start_prometheus(workdir: Path, jobs: dict[str, list[tuple[str, dict[str, str]]]],
                     rule_files: tuple[str, ...] = (), timeout: float = 60.0) -> Prometheus:
    """Start Prometheus on a free loopback port over a fresh TSDB, wait until it is ready and has scraped every target
    twice (so rate() has two points from the start)."""
    config = workdir / "prometheus.json"  # JSON is YAML: no YAML writer needed
    config.write_text(json.dumps(scrape_config(jobs, rule_files)))
    log = workdir / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([prometheus_bin("prometheus"), f"--config.file={config}",
                                 f"--storage.tsdb.path={workdir / 'tsdb'}", "--web.listen-address=127.0.0.1:0",
                                 "--storage.tsdb.retention.time=1h", "--log.level=warn"],
                                stdout=out, stderr=subprocess.STDOUT)
    port: list[int] = []

    def bound() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {proc.returncode}:\n{log.read_text()}")
        p = listening_port(proc.pid)
        if p is not None:
            port.append(p)
        return bool(port)

    prom = Prometheus(proc, "", log)
    try:
        poll(bound, timeout, "prometheus listening")
        prom.url = f"http://127.0.0.1:{port[0]}"

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=5) as r:
                    return bool(r.status == 200)
            except OSError:
                return False

        poll(ready, timeout, "prometheus ready")
        targets = sum(len(t) for t in jobs.values())
        poll(lambda: prom.scalar("count(count_over_time(up[1m]) >= 2 and up == 1)") == targets, timeout,
             f"{targets} targets scraped up twice")
    except BaseException:
        prom.stop()
        raise
    return prom
