"""manifests/: the kustomize base renders with the default load restrictor, RBAC covers what the operator
touches, and the samples are valid InferenceDeployments."""

from __future__ import annotations

import os
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet_operator import kube
from kvfleet_operator.builders import plan
from kvfleet_operator.models import InferenceDeployment

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = sorted((ROOT / "manifests" / "samples").glob("*.yaml"))


@cache
def kubectl() -> str | None:
    """The kubectl that e2e/build.sh built, without ever building it here."""
    p = subprocess.run(["bash", str(ROOT / "e2e" / "build.sh")], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "CHECK_ONLY": "1"})
    path = Path(p.stdout.strip().splitlines()[-1]) / "kubectl" if p.returncode == 0 and p.stdout.strip() else None
    return str(path) if path and path.exists() else None


@cache
def rendered() -> list[dict[str, Any]]:
    binary = kubectl()
    if binary is None:
        pytest.skip("kubectl not built (bash e2e/build.sh builds it)")
    p = subprocess.run([binary, "kustomize", str(ROOT / "manifests" / "base")], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    return [d for d in yaml.safe_load_all(p.stdout) if d]


def find(kind: str, name: str | None = None) -> dict[str, Any]:
    return next(d for d in rendered() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name))


def test_base_renders_the_crds_and_the_operator() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for d in rendered()}
    assert ("CustomResourceDefinition", "inferencedeployments.serving.kvfleet.dev") in kinds
    assert ("CustomResourceDefinition", "clusterkopfpeerings.kopf.dev") in kinds
    assert {("Namespace", "kvfleet-system"), ("ServiceAccount", "kvfleet-operator"),
            ("ClusterRole", "kvfleet-operator"), ("ClusterRoleBinding", "kvfleet-operator"),
            ("Deployment", "kvfleet-operator"),
            ("ClusterKopfPeering", "kvfleet")} <= kinds
    crd = find("CustomResourceDefinition", "inferencedeployments.serving.kvfleet.dev")
    committed = yaml.safe_load((ROOT / "crds" / "serving.kvfleet.dev_inferencedeployments.yaml").read_text())
    assert crd["spec"] == committed["spec"]  # the base carries the generated CRD, not a stale copy
    for d in rendered():
        cluster_scoped = d["kind"] in ("Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                                       "ClusterKopfPeering")
        assert ("namespace" in d["metadata"]) != cluster_scoped, d["kind"]
        if not cluster_scoped:
            assert d["metadata"]["namespace"] == "kvfleet-system"


def _verbs(group: str, resource: str) -> set[str]:
    return {v for r in find("ClusterRole")["rules"] if group in r["apiGroups"] and resource in r["resources"]
            for v in r["verbs"]}


def _allowed(group: str, resource: str, verb: str) -> bool:
    return verb in _verbs(group, resource)


# What the operator does with each kind kube.py knows (get: ownership checks and reads; create + patch:
# server-side apply; list + watch: kopf's watches; delete: only the args ConfigMap; pods: the autoscaler lists;
# peering objects: kopf watches and patches them, peering.py lists them).
CALLS = {"Deployment": {"get", "list", "watch", "create", "patch"}, "Service": {"get", "create", "patch"},
         "PodDisruptionBudget": {"get", "create", "patch"}, "ConfigMap": {"get", "create", "patch", "delete"},
         "Pod": {"list"}, "InferenceDeployment": {"get", "list", "watch", "patch"},
         "ClusterKopfPeering": {"list", "watch", "patch"}}


def test_rbac_covers_every_call_and_no_more() -> None:
    groups = {"/api/v1": "", "/apis/apps/v1": "apps", "/apis/policy/v1": "policy",
              "/apis/serving.kvfleet.dev/v1alpha1": "serving.kvfleet.dev", "/apis/kopf.dev/v1": "kopf.dev"}
    assert set(kube._KINDS) == set(CALLS)
    for kind, (prefix, plural) in kube._KINDS.items():
        assert _verbs(groups[prefix], plural) == CALLS[kind], kind
    assert _verbs("serving.kvfleet.dev", "inferencedeployments/status") == {"patch"}
    # blockOwnerDeletion on the owner references needs this under OwnerReferencesPermissionEnforcement.
    assert _verbs("serving.kvfleet.dev", "inferencedeployments/finalizers") == {"update"}
    assert not _allowed("serving.kvfleet.dev", "inferencedeployments", "update")  # never writes the spec
    assert not _allowed("", "pods", "delete") and not _allowed("", "secrets", "get")
    assert not _allowed("", "configmaps", "list")  # no cluster-wide read of every ConfigMap
    assert _verbs("", "events") == {"create", "patch"}
    assert _verbs("kopf.dev", "clusterkopfpeerings") == {"list", "watch", "patch"}
    assert not _verbs("kopf.dev", "kopfpeerings")  # namespaced peering is refused by the config
    subject = find("ClusterRoleBinding")["subjects"][0]
    assert (subject["name"], subject["namespace"]) == ("kvfleet-operator", "kvfleet-system")


def test_operator_deployment_is_locked_down() -> None:
    pod = find("Deployment", "kvfleet-operator")["spec"]["template"]["spec"]
    [c] = pod["containers"]
    assert pod["serviceAccountName"] == "kvfleet-operator" and pod["securityContext"]["runAsNonRoot"]
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["KVFLEET_PEERING"] == find("ClusterKopfPeering")["metadata"]["name"]


@pytest.mark.parametrize("path", SAMPLES, ids=[p.stem for p in SAMPLES])
def test_samples_are_valid_and_build(path: Path) -> None:
    body = yaml.safe_load(path.read_text())
    body["metadata"].setdefault("namespace", "default")
    cr = InferenceDeployment.model_validate(body)
    assert plan(cr, "agent:test", 1).apply


def test_samples_cover_cpu_one_gpu_and_tensor_parallel() -> None:
    specs = [InferenceDeployment.model_validate(yaml.safe_load(p.read_text())).spec for p in SAMPLES]
    assert sorted(s.gpus_per_replica for s in specs) == [0, 1, 4]
    assert any(s.runtime.tensor_parallel_size == 4 for s in specs)
