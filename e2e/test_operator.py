"""The operator on the real control plane: CRD validation, reconcile to Deployment/Service/PDB, rollouts, scale,
restart and garbage collection, with real agents behind the pods (process kubelet)."""

from __future__ import annotations

import json
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cluster import LocalCluster
from kube_util import is_running_ready, pods, wait_for
from operator_proc import (
    NAMESPACE,
    READY_S,
    SELECTOR,
    Operator,
    apply_cr,
    inference_deployment,
    owned,
    wait_ready,
)
from pydantic import ValidationError

# e2e/ is type-checked on its own (`cd e2e && mypy --strict *.py`), without the project's mypy_path.
from kvfleet_operator.models import InferenceDeployment  # type: ignore[import-not-found]

RESYNC_S = 3  # the peering test's resync period

INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("two model sources", {"model": {"name": "m", "source": {"hostPath": {"path": "/m"}, "pvc": {"claimName": "c"}}}},
     "exactly one of pvc, hostPath or image"),
    ("no model source", {"model": {"name": "m", "source": {}}}, "exactly one of pvc, hostPath or image"),
    ("min above max", {"autoscaling": {"mode": "external", "minReplicas": 3, "maxReplicas": 2}},
     "minReplicas must be <= maxReplicas"),
    ("gpus not a multiple of TP", {"runtime": {"tensorParallelSize": 2}, "resources": {"gpusPerReplica": 3}},
     "multiple of spec.runtime.tensorParallelSize"),
    ("block size not a power of two", {"runtime": {"blockSize": 24}}, "blockSize must be a power of two"),
    ("latency target zero", {"autoscaling": {"mode": "builtin", "maxReplicas": 2, "targets": {
        "latency": [{"metric": "ttft", "percentile": 95, "seconds": 0}]}}}, "seconds must be > 0"),
    ("builtin without targets", {"autoscaling": {"mode": "builtin", "maxReplicas": 2}},
     "needs queueDepthPerReplica or at least one latency target"),
    ("relative hostPath", {"model": {"name": "m", "source": {"hostPath": {"path": "models/m"}}}},
     "hostPath.path must be an absolute path"),
    ("unknown autoscaling mode", {"autoscaling": {"mode": "sometimes"}}, "Unsupported value: \"sometimes\""),
    ("unknown dtype", {"runtime": {"dtype": "float8"}}, "Unsupported value: \"float8\""),
    ("negative replicas", {"replicas": -1}, "spec.replicas: Invalid value: -1"),
    ("memory utilization above 1", {"runtime": {"gpuMemoryUtilization": 1.5}}, "gpuMemoryUtilization"),
    ("duplicate latency target", {"autoscaling": {"mode": "builtin", "maxReplicas": 2, "targets": {"latency": [
        {"metric": "ttft", "percentile": 95, "seconds": 1}, {"metric": "ttft", "percentile": 95, "seconds": 2}]}}},
     "same metric and percentile twice"),
    ("reserved pod label", {"pod": {"labels": {SELECTOR: "other"}}}, "spec.pod.labels must not set"),
    ("hostPath is the node's root", {"model": {"name": "m", "source": {"hostPath": {"path": "/"}}}},
     "hostPath.path must not be a system directory of the node"),
    ("hostPath under /etc", {"model": {"name": "m", "source": {"hostPath": {"path": "/etc/kubernetes/pki"}}}},
     "hostPath.path must not be a system directory of the node"),
    ("hostPath with a dot segment", {"model": {"name": "m", "source": {"hostPath": {"path": "/data/./m"}}}},
     "without '.', '..' or empty ('//') segments"),
    ("env with value and valueFrom", {"pod": {"env": [{"name": "A", "value": "x", "valueFrom": {
        "secretKeyRef": {"name": "s", "key": "k"}}}]}}, "exactly one of value or valueFrom"),
    ("env valueFrom with two sources", {"pod": {"env": [{"name": "A", "valueFrom": {
        "secretKeyRef": {"name": "s", "key": "k"}, "fieldRef": {"fieldPath": "metadata.name"}}}]}},
     "exactly one of secretKeyRef, configMapKeyRef, fieldRef or resourceFieldRef"),
    ("env fieldRef a container cannot read", {"pod": {"env": [{"name": "A", "valueFrom": {
        "fieldRef": {"fieldPath": "spec.containers"}}}]}}, "fieldPath must be a field a container's env can read"),
    ("API key as a literal env", {"pod": {"env": [{"name": "KVFLEET_API_KEY", "value": "s3cret"}]}},
     "spec.pod.env must not set KVFLEET_API_KEY"),
    ("API key in extraArgs", {"runtime": {"extraArgs": ["--api-key", "s3cret"]}}, "must not pass --api-key"),
    ("NetworkPolicy peer mixing ipBlock and podSelector", {"networkPolicy": {"from": [
        {"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]}}, "ipBlock alone, or podSelector"),
]


@pytest.mark.parametrize(("case", "patch", "expected"), INVALID, ids=[c[0] for c in INVALID])
def test_apiserver_rejects_invalid_specs(cluster: LocalCluster, operator: Operator, namespace: str,
                                         tiny_model: Path, case: str, patch: dict[str, Any], expected: str) -> None:
    body = inference_deployment("bad", namespace, tiny_model)
    for key, value in patch.items():  # merge one level down, so a patch can change one runtime knob
        if isinstance(value, dict) and isinstance(body["spec"].get(key), dict) and key != "model":
            body["spec"][key] = {**body["spec"][key], **value}
        else:
            body["spec"][key] = value
    proc = apply_cr(cluster, body, check=False)
    assert proc.returncode != 0, f"{case}: accepted"
    assert expected in proc.stderr, f"{case}: {proc.stderr}"


# The CRD's CEL and the pydantic models must draw the same line: each spec below goes to the apiserver (a server-side
# dry run) and to the models, and both must accept it or both refuse it.
AGREE_HOST_PATHS = ["/", "/etc", "/etc/", "/etcetera/m", "/proc/1/root", "/var/run/docker.sock", "/run/x", "/usr/m",
                    "/lib64", "/var", "/var/", "/var/lib", "/var/lib/kubelet", "/var/lib/kubelet/pods/x",
                    "/var/lib/kubelet-models/m", "/var/lib/kvfleet/models/m", "/var/log/m", "/home", "/home/ml/m",
                    "/data/models/m", "/data/models/m/", "//data", "/data//m", "/./data", "/data/.", "/data/../etc",
                    "/srv/a..b/m", "relative/m", "/dev", "/dev-models/m", "/boot", "/root", "/sys/fs", "/tmp/m"]
AGREE_ENV: list[dict[str, Any]] = [
    {"name": "A", "value": ""}, {"name": "A"}, {"name": "A", "value": "x", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.name"}}},
    *({"name": "A", "valueFrom": {"fieldRef": {"fieldPath": path}}} for path in (
        "metadata.name", "metadata.labels['a/b']", "metadata.annotations['x']", "status.podIPs", "spec.nodeName",
        "metadata.labels", "spec.containers", "status.phase")),
    *({"name": "A", "valueFrom": {"resourceFieldRef": ref}} for ref in (
        {"resource": "limits.memory", "divisor": "1Mi"}, {"resource": "requests.cpu", "divisor": 1},
        {"resource": "limits.hugepages-2Mi"}, {"resource": "limits.nvidia.com/gpu"},
        {"resource": "limits.memory", "divisor": "a lot"})),
    {"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
    {"name": "A", "valueFrom": {"secretKeyRef": {"name": "S_x", "key": "k"}}},
    {"name": "A", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k/x"}}},
    {"name": "A", "valueFrom": {}},
    {"name": "KVFLEET_API_KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
]
# Suffix decoding's fields: its own method only, within their bounds, k required as for every method.
AGREE_SPECULATIVE: list[dict[str, Any]] = [
    {"method": "suffix", "numSpeculativeTokens": 4},
    {"method": "suffix", "numSpeculativeTokens": 4, "suffixDecodingMaxTreeDepth": 16,
     "suffixDecodingMaxCachedRequests": 0, "suffixDecodingMaxSpecFactor": 2.5, "suffixDecodingMinTokenProb": 0.0,
     "suffixDecodingMaxCachedTokens": 1000},
    {"method": "suffix"},
    {"method": "suffix", "numSpeculativeTokens": 4, "suffixDecodingMaxCachedTokens": -1},
    {"method": "suffix", "numSpeculativeTokens": 4, "suffixDecodingMinTokenProb": 1.5},
    {"method": "suffix", "numSpeculativeTokens": 4, "suffixDecodingMaxTreeDepth": 0},
    {"method": "ngram", "numSpeculativeTokens": 3, "suffixDecodingMaxCachedTokens": 10},
    {"method": "draft_model", "numSpeculativeTokens": 3, "suffixDecodingMaxTreeDepth": 4},
]


def test_the_apiserver_and_the_models_agree(cluster: LocalCluster, operator: Operator, namespace: str,
                                            tiny_model: Path) -> None:
    specs: list[tuple[str, dict[str, Any]]] = []
    for path in AGREE_HOST_PATHS:
        body = inference_deployment("agree", namespace, tiny_model)
        body["spec"]["model"]["source"] = {"hostPath": {"path": path}}
        specs.append((f"hostPath {path}", body))
    for env in AGREE_ENV:
        specs.append((f"env {env}", inference_deployment("agree", namespace, tiny_model, pod={"env": [env]})))
    for config in AGREE_SPECULATIVE:
        body = inference_deployment("agree", namespace, tiny_model)
        body["spec"]["runtime"]["speculativeConfig"] = config
        specs.append((f"speculativeConfig {config}", body))
    disagree = []
    for case, body in specs:
        server = cluster.kubectl("apply", "--server-side", "--dry-run=server", "--field-manager=e2e-user", "-f", "-",
                                 stdin=json.dumps(body), check=False)
        models = _valid(body)
        if (server.returncode == 0) != models:
            disagree.append(f"{case}: apiserver {'accepts' if server.returncode == 0 else 'refuses'} "
                            f"({server.stderr.strip()[-300:]}), models {'accept' if models else 'refuse'}")
    assert not disagree, "\n".join(disagree)
    accepted = sum(1 for _, body in specs if _valid(body))
    assert 0 < accepted < len(specs)  # both sides of the line are exercised


def _valid(body: dict[str, Any]) -> bool:
    try:
        InferenceDeployment.model_validate(body)
    except ValidationError:
        return False
    return True


def test_crd_is_established_with_printer_columns(cluster: LocalCluster, operator: Operator) -> None:
    crd = cluster.kubectl_json("get", "crd", "inferencedeployments.serving.kvfleet.dev")
    version = crd["spec"]["versions"][0]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    assert {c["name"] for c in version["additionalPrinterColumns"]} >= {"Ready", "Replicas", "Desired", "Model", "Age"}
    assert crd["spec"]["names"]["shortNames"]


def test_lifecycle_of_an_inference_deployment(cluster: LocalCluster, operator: Operator, namespace: str,
                                              tiny_model: Path) -> None:
    """Create → Ready with owned objects; a spec change rolls the pods; kubectl scale; delete → all gone."""
    name = "tiny"
    apply_cr(cluster, inference_deployment(name, namespace, tiny_model, autoscaling={"mode": "external",
                                                                                      "maxReplicas": 3}))
    cr = wait_ready(cluster, namespace, name, 1)
    # No finalizer of kopf's (a daemon or timer would add one): deletable while the operator is down.
    assert not cr["metadata"].get("finalizers"), cr["metadata"]
    objs = owned(cluster, namespace, name)
    assert [len(objs[k]) for k in ("deployments", "services", "poddisruptionbudgets")] == [1, 1, 1], objs
    for items in objs.values():
        ref = items[0]["metadata"]["ownerReferences"][0]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "InferenceDeployment", name, cr["metadata"]["uid"], True)
    dep = objs["deployments"][0]
    live = cluster.api("GET", f"/apis/apps/v1/namespaces/{namespace}/deployments/{dep['metadata']['name']}")
    managers = {m["manager"] for m in live["metadata"]["managedFields"]}
    assert "kvfleet-operator" in managers
    assert cr["status"]["selector"] and cr["status"]["desiredReplicas"] == 1
    first = {p["metadata"]["uid"] for p in pods(cluster, namespace, f"{SELECTOR}={name}")}

    # A runtime change rolls the pods (config hash on the template); maxUnavailable 0 keeps one serving.
    body = inference_deployment(name, namespace, tiny_model, autoscaling={"mode": "external", "maxReplicas": 3})
    body["spec"]["runtime"]["maxNumSeqs"] = 4
    apply_cr(cluster, body)
    wait_ready(cluster, namespace, name, 1)
    rolled = wait_for("new pods after the spec change", lambda: (
        ps if (ps := [p for p in pods(cluster, namespace, f"{SELECTOR}={name}") if is_running_ready(p)])
        and not {p["metadata"]["uid"] for p in ps} & first and len(ps) == 1 else None), timeout=READY_S)
    args = rolled[0]["spec"]["containers"][0]["args"]
    assert "--max-num-seqs" in args and args[args.index("--max-num-seqs") + 1] == "4"

    # External mode: `kubectl scale` drives spec.replicas through the scale subresource.
    cluster.kubectl("scale", "inferencedeployment", name, "-n", namespace, "--replicas=2")
    cr = wait_ready(cluster, namespace, name, 2)
    assert cluster.kubectl_json("get", "deployment", dep["metadata"]["name"], "-n", namespace)["spec"]["replicas"] == 2
    table = cluster.kubectl("get", "infd", name, "-n", namespace).stdout
    assert "READY" in table and "tiny" in table

    pids = [e["pid"] for e in cluster.agent_processes().values() if e["pod"].startswith(f"{namespace}/")]
    assert len(pids) == 2
    cluster.kubectl("delete", "inferencedeployment", name, "-n", namespace, "--wait=false")
    wait_for("owned objects and pods garbage-collected", lambda: not any(owned(cluster, namespace, name).values())
             and not pods(cluster, namespace, f"{SELECTOR}={name}"), timeout=90)
    wait_for("agent processes stopped", lambda: not any(
        e["pod"].startswith(f"{namespace}/") for e in cluster.agent_processes().values()), timeout=30)


def test_restart_in_the_middle_of_a_reconcile_converges(cluster: LocalCluster, operator: Operator, namespace: str,
                                                         tiny_model: Path) -> None:
    name = f"restart-{uuid.uuid4().hex[:4]}"
    apply_cr(cluster, inference_deployment(name, namespace, tiny_model))
    # Kill it as soon as the reconcile has written its first object, before the status write.
    wait_for("the Deployment created", lambda: owned(cluster, namespace, name)["deployments"], timeout=30,
             interval=0.05)
    operator.kill()
    operator.start()
    wait_ready(cluster, namespace, name, 1)
    objs = owned(cluster, namespace, name)
    assert [len(objs[k]) for k in ("deployments", "services", "poddisruptionbudgets")] == [1, 1, 1], objs
    assert len(pods(cluster, namespace, f"{SELECTOR}={name}")) == 1


def test_operator_service_account_is_least_privilege(cluster: LocalCluster, operator: Operator) -> None:
    sa = f"system:serviceaccount:{NAMESPACE}:kvfleet-operator"

    def can(*args: str) -> bool:
        return cluster.kubectl("auth", "can-i", *args, f"--as={sa}", check=False).stdout.strip() == "yes"

    assert can("patch", "deployments.apps", "-n", "default")
    assert can("patch", "inferencedeployments.serving.kvfleet.dev/status", "-n", "default")
    assert can("create", "events", "-n", "default")
    assert can("patch", "networkpolicies.networking.k8s.io", "-n", "default")
    assert not can("create", "secrets", "-n", "default")
    assert not can("get", "secrets", "-n", "default")  # API keys reach agents as secretKeyRefs the kubelet resolves
    assert not can("delete", "nodes")
    assert not can("create", "clusterrolebindings")


def test_the_loops_beside_kopf_pause_while_another_instance_leads(cluster: LocalCluster, operator: Operator,
                                                                   namespace: str, tiny_model: Path) -> None:
    """With peering, a live peer of a higher priority in the peering object (what `kopf freeze` or a dev-mode
    operator writes) pauses kopf's handlers and our resync alike; once it is gone, the resync heals the drift. The
    peering object is the operator's own: manifests/base does not ship it (so that it applies in one pass)."""
    name, peering = "peer", "clusterkopfpeering/kvfleet"

    def deployment_replicas() -> int:
        return int(cluster.kubectl_json("get", "deployment", name, "-n", namespace)["spec"]["replicas"])

    def freeze(entry: dict[str, Any] | None) -> None:
        cluster.kubectl("patch", peering, "--type=merge", "-p", json.dumps({"status": {"e2e-freeze": entry}}))

    def logged(text: str) -> bool:
        return operator.proc is not None and text in operator.proc.log.read_text(errors="replace")

    operator.stop()
    operator.extra_env = {"KVFLEET_PEERING": "kvfleet", "KVFLEET_RESYNC_SECONDS": str(RESYNC_S)}
    operator.start()
    try:
        # kopf keeps alive under the identity we gave it: the loops find their own entry by it.
        def peers() -> dict[str, Any]:  # a list, not a get: the object exists once the operator has made it
            found = cluster.kubectl_json("get", "clusterkopfpeerings")["items"]
            return next((p.get("status") or {} for p in found if p["metadata"]["name"] == "kvfleet"), {})

        wait_for("our identity in the peering object", lambda: any(
            peer.startswith("kvfleet-operator@") for peer in peers()), timeout=30)
        apply_cr(cluster, inference_deployment(name, namespace, tiny_model))
        wait_for("the Deployment created", lambda: owned(cluster, namespace, name)["deployments"], timeout=30)

        freeze({"priority": 1000, "lifetime": 600, "lastseen": datetime.now(UTC).isoformat()})
        wait_for("the loops paused", lambda: logged("peering kvfleet: paused"), timeout=30)
        cluster.kubectl("scale", "deployment", name, "-n", namespace, "--replicas=2")  # drift nobody reconciles
        until = time.monotonic() + 3 * RESYNC_S
        while time.monotonic() < until:
            assert deployment_replicas() == 2, "reconciled while another instance leads"
            time.sleep(0.5)  # sampling the replica count while resync periods pass

        freeze(None)
        wait_for("the drift healed once leading again", lambda: deployment_replicas() == 1, timeout=30)
    finally:
        freeze(None)
        operator.stop()
        operator.extra_env = {}
        operator.start()
