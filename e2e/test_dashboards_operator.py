"""The autoscaling dashboard fed for real: a Prometheus in the pod network scrapes the session's operator and the
agent of a builtin-autoscaled InferenceDeployment under a bounded load (plus a frozen agent and a foreign
Deployment, so the error panels have something to show); every panel's query returns data with its legend's labels.

tests/observability/test_dashboards_live.py runs every other panel on real agents and a router, but only parses the
operator's: no operator runs there."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import netns
import pytest
from cluster import LocalCluster
from kube_util import wait_for
from operator_proc import NAMESPACE, SELECTOR, Operator, apply_cr, condition, get_cr, inference_deployment, wait_ready
from procs import Proc, tail, terminate_all

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "dashboards" / "kvfleet-autoscaling.json"
NAME, FOREIGN = "auto", "foreign"
INTERVAL_S = 5  # the autoscaler's round (the CRD's minimum)
LOAD_S = 15  # three autoscaler rounds
RATE_INTERVAL = "2m"  # $__rate_interval, as test_dashboards_live.py substitutes it
PANELS_S = 90.0  # the operator resyncs every 60 s: a reconcile lands in every 2m window by then


def dashboard_targets(path: Path) -> list[tuple[str, str, str]]:
    """(panel title, expr, legend) of every target of a dashboard, as test_dashboards_live.py reads them."""
    return [(panel["title"], t["expr"], t["legendFormat"])
            for panel in json.loads(path.read_text())["panels"] for t in panel["targets"]]


def substitute(expr: str, namespace: str) -> str:
    values = {"$__rate_interval": RATE_INTERVAL, "$inference_deployment": NAME, "$namespace": namespace}
    for var in sorted(values, key=len, reverse=True):
        expr = expr.replace(var, values[var])
    return expr


def prometheus_binary() -> str:
    """e2e/prometheus.sh's cached prometheus (it prints the bin dir last; it downloads only when the cache is empty)."""
    out = subprocess.run(["bash", str(REPO / "e2e" / "prometheus.sh")], capture_output=True, text=True, timeout=300,
                         check=False)
    lines = out.stdout.strip().splitlines()
    binary = Path(lines[-1]) / "prometheus" if lines else None
    if binary is None or not binary.exists():
        pytest.fail(f"no prometheus from e2e/prometheus.sh ({out.returncode}): {out.stderr[-2000:]}")
    return str(binary)


def free_port_in_pod_network(cluster: LocalCluster) -> int:
    """A port free on 127.0.0.1 inside the pod network (only the cluster's own processes bind there)."""
    code = "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"
    out = cluster.exec_in_pod_network(sys.executable, "-c", code)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


class Prom:
    """Prometheus' HTTP API through a host port forwarded into the pod network."""

    def __init__(self, url: str) -> None:
        self.url = url

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{path} {params}: HTTP {e.code}: {e.read().decode()}") from e
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def scalar(self, expr: str) -> float:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else float("nan")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as r:
                return bool(r.status == 200)
        except OSError:
            return False


def scrape_config(operator_port: int, agents_file: Path) -> dict[str, Any]:
    """What the chart's ServiceMonitor and PodMonitor make of it (charts/kvfleet/templates/monitoring.yaml): the
    operator's series keep their own `namespace` (honorLabels); agents get namespace, pod and inference_deployment.
    The agents come from a file written once the pod exists (file_sd: no reload needed)."""
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {"job_name": "kvfleet-operator", "honor_labels": True,
             "static_configs": [{"targets": [f"127.0.0.1:{operator_port}"],
                                 "labels": {"namespace": NAMESPACE, "pod": "kvfleet-operator"}}]},
            {"job_name": "kvfleet-agent",
             "file_sd_configs": [{"files": [str(agents_file)], "refresh_interval": "1s"}]},
        ]}


@contextlib.contextmanager
def prometheus(cluster: LocalCluster, operator: Operator, work: Path) -> Iterator[tuple[Prom, Path, Proc]]:
    """A Prometheus in the pod network scraping the operator (and agents listed in the yielded file); stopped by pid."""
    agents_file = work / "agents.json"
    agents_file.write_text("[]")
    config = work / "prometheus.json"  # JSON is YAML
    config.write_text(json.dumps(scrape_config(operator.metrics_port(), agents_file)))
    port = free_port_in_pod_network(cluster)
    proc = cluster.spawn_in_pod_network("prometheus", [
        prometheus_binary(), f"--config.file={config}", f"--storage.tsdb.path={work / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h", "--log.level=warn"])
    try:
        with cluster.port_forward("127.0.0.1", port) as local:
            prom = Prom(f"http://127.0.0.1:{local}")

            def ready() -> bool:
                assert proc.alive(), tail(proc.log)
                return prom.ready()

            wait_for("prometheus ready", ready, timeout=60)
            # Scraped up twice before anything happens: the reconcile histogram's rate() sees its increase.
            wait_for("the operator scraped up twice", lambda: prom.scalar(
                'count(count_over_time(up{job="kvfleet-operator"}[1m]) >= 2 and up{job="kvfleet-operator"} == 1)') == 1,
                timeout=30)
            yield prom, agents_file, proc
    finally:
        terminate_all([proc], grace=10.0)


def foreign_deployment(namespace: str) -> dict[str, Any]:
    """A Deployment of someone else's (no pods) under the name an InferenceDeployment will want."""
    labels = {"app": FOREIGN}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": FOREIGN, "namespace": namespace},
            "spec": {"replicas": 0, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"containers": [{"name": "c", "image": "example.invalid/none"}]}}}}


def start_load(cluster: LocalCluster, ip: str, log: Path) -> subprocess.Popen[bytes]:
    """A bounded closed-loop load (16 clients, LOAD_S seconds) from inside the pod network: a queue above the
    target of one replica."""
    agent = str(Path(sys.executable).parent / "kvfleet-agent")
    argv = [agent, "bench", "serve", "--url", f"http://{ip}:8000", "--concurrency", "16", "--duration", str(LOAD_S),
            "--timeout", str(LOAD_S + 30), "--max-tokens", "32", "--ignore-eos", "--prompt-len", "64", "--no-progress"]
    with log.open("wb") as out:
        return subprocess.Popen(netns.nsenter_argv(cluster.netns_pid or 0, argv), stdout=out,
                                stderr=subprocess.STDOUT)


def has_data(result: list[dict[str, Any]]) -> bool:
    """Some series with a finite value (a quantile over no observations is NaN: nothing on a graph)."""
    return any(math.isfinite(float(s["value"][1])) for s in result)


def legend_of(legend: str, labels: dict[str, str]) -> str:
    """The legend Grafana draws for a series."""
    return re.sub(r"\{\{(\w+)\}\}", lambda m: labels.get(m[1], ""), legend)


def panel_failures(prom: Prom, namespace: str) -> list[str]:
    failures = []
    for title, expr, legend in dashboard_targets(DASHBOARD):
        result = prom.query(substitute(expr, namespace))
        wanted = set(re.findall(r"\{\{(\w+)\}\}", legend))
        if not has_data(result):
            failures.append(f"{title}: no data for {expr}")
        elif missing := [s["metric"] for s in result if not wanted <= {k for k, v in s["metric"].items() if v}]:
            failures.append(f"{title}: series without {wanted}: {missing}")
    return failures


def test_every_autoscaling_panel_returns_data_from_a_live_operator(cluster: LocalCluster, operator: Operator,
                                                                  namespace: str, tiny_model: Path,
                                                                  tmp_path: Path) -> None:
    with prometheus(cluster, operator, tmp_path) as (prom, agents_file, _):
        # Failed writes to the API: an InferenceDeployment whose Deployment name is taken by someone else's.
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps(foreign_deployment(namespace)))
        apply_cr(cluster, inference_deployment(FOREIGN, namespace, tiny_model))

        def refused() -> bool:
            ready = condition(get_cr(cluster, namespace, FOREIGN), "Ready")
            return ready is not None and ready["reason"] == "ResourceExists"

        wait_for("the foreign Deployment refused", refused, timeout=30)

        autoscaling = {"mode": "builtin", "minReplicas": 1, "maxReplicas": 1, "intervalSeconds": INTERVAL_S,
                       "windowSeconds": 10, "targets": {"queueDepthPerReplica": 4}}
        apply_cr(cluster, inference_deployment(NAME, namespace, tiny_model, autoscaling=autoscaling))
        wait_ready(cluster, namespace, NAME, 1)
        pod = cluster.kubectl_json("get", "pods", "-n", namespace, "-l", f"{SELECTOR}={NAME}")["items"][0]
        ip, pod_name = pod["status"]["podIP"], pod["metadata"]["name"]
        agents_file.write_text(json.dumps([{"targets": [f"{ip}:8000"], "labels": {
            "namespace": namespace, "pod": pod_name, "inference_deployment": NAME}}]))
        agent_up = f'up{{job="kvfleet-agent", namespace="{namespace}"}}'
        wait_for("the agent scraped", lambda: prom.scalar(agent_up) == 1, timeout=30)

        load = start_load(cluster, ip, tmp_path / "load.log")
        try:
            # A decision under load: the queue asks for more than one replica, spec.autoscaling.maxReplicas holds it.
            held = f'kvfleet_operator_desired_replicas{{namespace="{namespace}", name="{NAME}", reason="maxReplicas"}}'
            wait_for("a round limited by maxReplicas", lambda: prom.query(held), timeout=LOAD_S)
        finally:
            load.wait(timeout=LOAD_S + 60)
        assert load.returncode == 0, (tmp_path / "load.log").read_text()[-2000:]

        # Agent scrape errors: the agent frozen (it stays Ready within its readiness budget) until a failed scrape
        # by the autoscaler shows in Prometheus.
        pids = [e["pid"] for e in cluster.agent_processes().values() if e["pod"] == f"{namespace}/{pod_name}"]
        assert len(pids) == 1, cluster.agent_processes()
        os.kill(pids[0], signal.SIGSTOP)
        try:
            wait_for("a scrape error counted", lambda: prom.query("kvfleet_operator_scrape_errors_total"),
                     timeout=2 * INTERVAL_S + 10)
        finally:
            os.kill(pids[0], signal.SIGCONT)
        wait_for("the agent scraped again", lambda: prom.scalar(agent_up) == 1, timeout=30)

        deadline = time.monotonic() + PANELS_S
        while failures := panel_failures(prom, namespace):
            if time.monotonic() > deadline:
                break
            time.sleep(1.0)  # polling Prometheus until the series are there, bounded by the deadline
        assert not failures, "\n".join(failures) + f"\noperator log:\n{operator.log()}"
        # The dashboard's template variables list the deployment.
        assert namespace in prom.api("label/namespace/values", **{"match[]": "kvfleet_requests_waiting"})
        assert prom.api("label/inference_deployment/values", **{
            "match[]": f'kvfleet_requests_waiting{{namespace="{namespace}"}}'}) == [NAME]
        reasons = {s["metric"]["reason"] for s in prom.query(
            f'last_over_time(kvfleet_operator_desired_replicas{{namespace="{namespace}", name="{NAME}"}}[10m])')}
        rounds = {s["metric"]["result"]: s["value"][1]
                  for s in prom.query("sum by (result) (kvfleet_operator_autoscale_ticks_total)")}
        errors = {s["metric"]["reason"]: s["value"][1]
                  for s in prom.query("sum by (reason) (kvfleet_operator_scrape_errors_total)")}
        print(f"\nautoscaling dashboard: {len(dashboard_targets(DASHBOARD))} targets with data; desired-replicas "
              f"reasons seen {sorted(reasons)}; rounds {rounds}; scrape errors {errors}")
        for title, expr, legend in dashboard_targets(DASHBOARD):
            shown = sorted(legend_of(legend, s["metric"]) for s in prom.query(substitute(expr, namespace)))
            print(f"  {title}: {shown}")
