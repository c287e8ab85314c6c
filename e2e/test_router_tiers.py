"""Complexity tiers on the local control plane: two InferenceDeployments behind one model name of an InferenceRouter,
a mixed workload split by the classifier as configured, a degraded cheap tier caught by the quality monitor and its
class promoted (header, status, event, metrics), and the class demoted again once the tier is repaired."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster import LocalCluster
from kube_util import wait_for
from operator_proc import Operator, apply_cr, inference_deployment, wait_ready
from router_fleet import ROUTER_PORT, ROUTER_SELECTOR, metrics, router_cr, total

RESYNC_S = 4  # the operator's resync here: the router's status follows its pods' metrics this often
SHARE_TOLERANCE = 0.05
QUALITY = {"sampleRate": 1.0, "windowSeconds": 4, "minSamples": 4, "threshold": 0.5, "hysteresis": 0.1,
           "maxConcurrentReplays": 4, "maxReplaysPerMinute": 1000}
TIERED = [{"name": "chat", "tiers": [{"model": "chat-small", "cost": 1}, {"model": "chat-large", "cost": 4}],
           "classifier": {"classes": [{"name": "simple", "tier": 0, "maxPromptTokens": 64, "maxOutputTokens": 64,
                                       "markers": False}]},
           "quality": QUALITY}]
SIMPLE = {"model": "chat", "prompt": "hello there", "max_tokens": 12, "temperature": 0}
COMPLEX = {"model": "chat", "prompt": "explain step by step: ```x = 1```", "max_tokens": 12, "temperature": 0}
# Posts bodies (argv[2], a JSON list) to the router (argv[1]) one by one. With argv[3] (a tier), it cycles through
# them until a response's tier header names that tier or argv[4] seconds have passed. Prints each response's
# x-kvfleet-tier fields as a JSON list.
UNTIL_S = 120
CLIENT = r"""
import itertools, json, sys, time, urllib.request
url, bodies, until = sys.argv[1], json.loads(sys.argv[2]), (sys.argv[3] if len(sys.argv) > 3 else None)
deadline = time.monotonic() + float(sys.argv[4]) if until else None
seen = []
for body in (itertools.cycle(bodies) if until else bodies):
    if deadline is not None and time.monotonic() > deadline:
        break
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        resp.read()
        header = resp.headers["x-kvfleet-tier"]
    seen.append(dict(p.split("=", 1) for p in header.split("; ") if "=" in p))
    if until and seen[-1]["tier"] == until:
        break
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def quick_operator(operator: Operator) -> Iterator[Operator]:
    """The session's operator, restarted with a short resync (routers' status is refreshed on resync)."""
    operator.stop()
    operator.extra_env = {"KVFLEET_RESYNC_SECONDS": str(RESYNC_S)}
    operator.start()
    try:
        yield operator
    finally:
        operator.stop()
        operator.extra_env = {}
        operator.start()


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another random checkpoint: a cheap tier serving it disagrees with the top tier."""
    path = tmp_path_factory.mktemp("models") / "other"
    agent = Path(sys.executable).parent / "kvfleet-agent"
    subprocess.run([str(agent), "model", "init-tiny", "--seed", "7", str(path)], check=True, capture_output=True)
    return path


class Tiers:
    """chat-small and chat-large InferenceDeployments behind router `router`'s tiered name `chat`."""

    def __init__(self, cluster: LocalCluster, namespace: str) -> None:
        self.cluster, self.namespace = cluster, namespace

    def deploy(self, name: str, served: str, checkpoint: Path) -> None:
        spec = inference_deployment(name, self.namespace, checkpoint)
        spec["spec"]["model"] = {"name": served, "source": {"hostPath": {"path": str(checkpoint)}}}
        apply_cr(self.cluster, spec)
        wait_ready(self.cluster, self.namespace, name, 1)
        # Ready counts the old pod while the new one starts: wait for the rollout to replace it.
        self.cluster.kubectl("rollout", "status", f"deployment/{name}", "-n", self.namespace, "--timeout=180s")

    def router_ip(self) -> str:
        pods = self.cluster.kubectl_json("get", "pods", "-n", self.namespace, "-l", ROUTER_SELECTOR)["items"]
        return str(next(p["status"]["podIP"] for p in pods if p.get("status", {}).get("podIP")
                        and not p["metadata"].get("deletionTimestamp")))

    def send(self, bodies: list[dict[str, Any]], until: str | None = None) -> list[dict[str, str]]:
        url = f"http://{self.router_ip()}:{ROUTER_PORT}/v1/completions"
        proc = self.cluster.exec_in_pod_network(sys.executable, "-c", CLIENT, url, json.dumps(bodies),
                                                *([until, str(UNTIL_S)] if until else []), timeout=UNTIL_S + 60)
        assert proc.returncode == 0, proc.stderr[-2000:]
        seen: list[dict[str, str]] = json.loads(proc.stdout)
        return seen

    def status(self) -> dict[str, Any]:
        cr = self.cluster.kubectl_json("get", "inferencerouter", "router", "-n", self.namespace)
        models = cr.get("status", {}).get("tieredModels") or [{}]
        return dict(models[0])

    def events(self, reason: str) -> list[str]:
        found = self.cluster.kubectl_json("get", "events", "-n", self.namespace, "--field-selector",
                                          f"involvedObject.kind=InferenceRouter,reason={reason}")["items"]
        return [e["message"] for e in found]

    def router_metric(self, name: str, **labels: str) -> float:
        return total(metrics(self.cluster, self.router_ip(), ROUTER_PORT), name, **labels)


@pytest.fixture(scope="module")
def tiers(cluster: LocalCluster, quick_operator: Operator, tiny_model: Path) -> Iterator[Tiers]:
    namespace = f"e2e-tiers-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    t = Tiers(cluster, namespace)
    try:
        t.deploy("large", "chat-large", tiny_model)
        t.deploy("small", "chat-small", tiny_model)  # healthy: the top tier's own checkpoint
        apply_cr(cluster, router_cr("router", namespace, tieredModels=TIERED))
        wait_for("the router serving chat", lambda: _serves(t), timeout=120)
        yield t
    finally:
        cluster.kubectl("delete", "inferencedeployments,inferencerouters", "--all", "-n", namespace, "--wait=false",
                        check=False)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def _serves(t: Tiers) -> bool:
    """Whether a router pod answers with both tiers of `chat` ready."""
    try:
        ip = t.router_ip()
    except StopIteration:  # no router pod with an IP yet
        return False
    code = ("import json, urllib.request; print(json.dumps(json.load(urllib.request.urlopen("
            f"'http://{ip}:{ROUTER_PORT}/v1/models', timeout=5))))")
    proc = t.cluster.exec_in_pod_network(sys.executable, "-c", code)
    if proc.returncode != 0:
        return False
    cards = {m["id"]: m for m in json.loads(proc.stdout)["data"]}
    return int(cards.get("chat", {}).get("ready_replicas", 0)) >= 2


def test_tiers_split_traffic_promote_a_degraded_tier_and_demote_it_when_repaired(tiers: Tiers,
                                                                                   other_model: Path,
                                                                                   tiny_model: Path) -> None:
    # 1. A mixed workload, 3 simple to 1 complex: split by the classifier as configured.
    mix = [COMPLEX if i % 4 == 3 else SIMPLE for i in range(40)]
    seen = tiers.send(mix)
    on_small = sum(s["tier"] == "chat-small" for s in seen) / len(seen)
    print(f"share on chat-small: {on_small:.3f} (configured 0.75)")
    assert abs(on_small - 0.75) <= SHARE_TOLERANCE
    assert all(s["class"] == ("simple" if s["tier"] == "chat-small" else "unmatched") for s in seen)

    def shares() -> dict[str, float] | None:
        st = tiers.status()
        got = {t["model"]: t.get("share") for t in st.get("tiers", [])}
        return got if None not in got.values() and sum(t.get("requests", 0) for t in st["tiers"]) >= 40 else None

    got = wait_for("the status reporting the shares", shares, timeout=60)
    print(f"status shares: {got}, quality: {[t.get('quality') for t in tiers.status()['tiers']]}")
    assert abs(got["chat-small"] - 0.75) <= SHARE_TOLERANCE
    assert not tiers.status().get("promotions")

    # 2. The cheap tier degraded (another checkpoint): the monitor promotes `simple` to the top tier.
    tiers.deploy("small", "chat-small", other_model)
    seen = tiers.send([SIMPLE], until="chat-large")
    assert seen[-1]["tier"] == "chat-large" and seen[-1]["promoted-from"] == "chat-small", seen[-3:]
    print(f"promoted after {len(seen)} simple requests")
    assert tiers.router_metric("kvfleet_router_tier_promotions_total", **{"class": "simple"}) == 1
    promoted = wait_for("the promotion in status", lambda: tiers.status().get("promotions"), timeout=60)
    assert promoted == [{"class": "simple", "from": "chat-small", "to": "chat-large", "routerPods": 1}], promoted
    events = wait_for("a TierPromoted event", lambda: tiers.events("TierPromoted"), timeout=60)
    assert any("simple" in m and "chat-large" in m for m in events), events
    small = next(t for t in tiers.status()["tiers"] if t["model"] == "chat-small")
    assert small["quality"] < QUALITY["threshold"], small

    # 3. Repaired: the probes of the tier below score well again, and the class is demoted after the hysteresis.
    tiers.deploy("small", "chat-small", tiny_model)
    seen = tiers.send([SIMPLE], until="chat-small")
    assert seen[-1]["tier"] == "chat-small", seen[-3:]
    print(f"demoted after {len(seen)} simple requests")
    assert tiers.router_metric("kvfleet_router_tier_demotions_total", **{"class": "simple"}) == 1
    wait_for("the promotion gone from status", lambda: not tiers.status().get("promotions"), timeout=60)
    events = wait_for("a TierDemoted event", lambda: tiers.events("TierDemoted"), timeout=60)
    assert any("simple" in m for m in events), events
