"""The process kubelet: agent pods on kwok's GPU nodes run as real processes on pod IPs, probed and reaped."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from cluster import GPU_RESOURCE, GPU_TOLERATION, LocalCluster
from kube_util import apply, is_running_ready, pods, wait_for, wait_running
from procs import pid_alive

AGENT_START_S = 120.0  # a tiny model loads in seconds; two agents share 2 cores with the control plane


def agent_deployment(name: str, namespace: str, model: Path, replicas: int) -> dict[str, Any]:
    """A Deployment of kvfleet agents serving the tiny model from a hostPath, with the probes of a real pod."""
    labels = {"app": name}
    probe = {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1, "failureThreshold": 1,
             "timeoutSeconds": 1}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "tolerations": [GPU_TOLERATION],
                    "terminationGracePeriodSeconds": 10,
                    "volumes": [{"name": "model", "hostPath": {"path": str(model), "type": "Directory"}},
                                {"name": "tmp", "emptyDir": {}}],
                    "containers": [{
                        "name": "agent",
                        "image": "registry.invalid/kvfleet/agent:dev",
                        "command": ["kvfleet-agent"],
                        "args": ["serve", "--model", "/models/tiny", "--served-model-name", "$(MODEL_NAME)",
                                 "--port", "8000", "--grpc-port", "-1", "--max-num-seqs", "8"],
                        "env": [{"name": "KVFLEET_HOST", "value": "0.0.0.0"},
                                {"name": "MODEL_NAME", "value": "tiny"},
                                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                        "ports": [{"name": "http", "containerPort": 8000}],
                        "volumeMounts": [{"name": "model", "mountPath": "/models/tiny", "readOnly": True},
                                         {"name": "tmp", "mountPath": "/tmp"}],
                        "readinessProbe": probe,
                        "livenessProbe": {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 1,
                                          "failureThreshold": 30},
                        "resources": {"limits": {GPU_RESOURCE: "1"}},
                    }],
                },
            },
        },
    }


def complete_inside(cluster: LocalCluster, ip: str) -> dict[str, Any]:
    """POST a completion to ip:8000 from inside the pod network (curl there)."""
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0})
    proc = cluster.exec_in_pod_network("curl", "-sS", "--fail-with-body", "-m", "30", "-H",
                                       "Content-Type: application/json", "-d", body,
                                       f"http://{ip}:8000/v1/completions")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def listening_ips(proc_net_tcp: str) -> set[str]:
    """IPv4 addresses with a listening socket, from a /proc/net/tcp table (little-endian hex, state 0A)."""
    ips = set()
    for line in proc_net_tcp.splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A":
            ips.add(str(ipaddress.IPv4Address(int(local.split(":")[0], 16).to_bytes(4, "little"))))
    return ips


def agent_pid(cluster: LocalCluster, pod: dict[str, Any]) -> int:
    entry = cluster.agent_processes()[pod["metadata"]["uid"]]
    assert entry["ip"] == pod["status"]["podIP"]
    return int(entry["pid"])


@pytest.fixture
def agents(cluster: LocalCluster, namespace: str, tiny_model: Path) -> list[dict[str, Any]]:
    apply(cluster, agent_deployment("agents", namespace, tiny_model, replicas=2))
    return wait_running(cluster, namespace, "app=agents", 2, timeout=AGENT_START_S)


def test_agent_pods_serve_on_their_pod_ips(cluster: LocalCluster, agents: list[dict[str, Any]]) -> None:
    ips = [p["status"]["podIP"] for p in agents]
    assert len(set(ips)) == 2 and all(ip.startswith("10.250.") and int(ip.split(".")[2]) >= 128 for ip in ips), ips
    for pod in agents:
        assert pid_alive(agent_pid(cluster, pod))
        out = complete_inside(cluster, pod["status"]["podIP"])
        assert out["model"] == "tiny" and out["usage"]["completion_tokens"] == 4, out

    # The agents listen in the pod network only; from the host they are reached through a forward.
    # (Checked from the socket tables: a connect from the host would leave through its default route.)
    ip = ips[0]
    inside = cluster.exec_in_pod_network("cat", "/proc/net/tcp").stdout
    assert set(ips) <= listening_ips(inside)
    assert not set(ips) & listening_ips(Path("/proc/net/tcp").read_text())
    with cluster.port_forward(ip, 8000) as port, \
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert "kvfleet_requests_waiting" in text and 'model="tiny"' in text


def test_ready_condition_follows_the_agents_probe(cluster: LocalCluster, namespace: str,
                                                  agents: list[dict[str, Any]]) -> None:
    pod = agents[0]
    name, pid = pod["metadata"]["name"], agent_pid(cluster, pod)

    def current() -> dict[str, Any]:
        return dict(cluster.kubectl_json("get", "pod", name, "-n", namespace))

    os.kill(pid, signal.SIGSTOP)  # a frozen agent answers nothing: /ready times out
    try:
        wait_for("Ready=False while the agent is stopped", lambda: not is_running_ready(current()), timeout=30)
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for("Ready=True again", lambda: is_running_ready(current()), timeout=30)
    assert current()["status"]["containerStatuses"][0]["restartCount"] == 0


def test_a_crashed_agent_is_restarted(cluster: LocalCluster, namespace: str, agents: list[dict[str, Any]]) -> None:
    pod = agents[1]
    name, pid = pod["metadata"]["name"], agent_pid(cluster, pod)
    os.kill(pid, signal.SIGKILL)

    def restarted() -> dict[str, Any] | None:
        p = cluster.kubectl_json("get", "pod", name, "-n", namespace)
        cs = p["status"]["containerStatuses"][0]
        return p if cs["restartCount"] == 1 and is_running_ready(p) else None

    p = wait_for("the agent restarted and Ready", restarted, timeout=AGENT_START_S)
    assert p["status"]["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] == 128 + signal.SIGKILL
    assert not pid_alive(pid) and pid_alive(agent_pid(cluster, p))
    assert complete_inside(cluster, p["status"]["podIP"])["usage"]["completion_tokens"] == 4


def test_deleting_the_deployment_stops_the_agents(cluster: LocalCluster, namespace: str,
                                                  agents: list[dict[str, Any]]) -> None:
    pids = [agent_pid(cluster, p) for p in agents]
    cluster.kubectl("delete", "deployment", "agents", "-n", namespace, "--wait=false")
    wait_for("agent pods gone", lambda: not pods(cluster, namespace, "app=agents"), timeout=60)
    assert not any(pid_alive(pid) for pid in pids)
    assert not any(uid in cluster.agent_processes() for uid in (p["metadata"]["uid"] for p in agents))
