"""manifests/: the kustomize base and the single-namespace overlay render with the default load restrictor, RBAC
covers what the operator touches (cluster-wide or in one namespace), and the samples are valid InferenceDeployments."""

from __future__ import annotations

import os
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet_operator import kube
from kvfleet_operator.builders import OPERATOR_POD_LABELS, network_policy, plan
from kvfleet_operator.config import OperatorConfig
from kvfleet_operator.models import InferenceDeployment
from kvfleet_operator.plan import child_keys, make_plan

ROOT = Path(__file__).resolve().parents[2]
# The InferenceDeployment samples (router.yaml, an InferenceRouter, is tested in test_router_manifests.py).
SAMPLES = sorted(p for p in (ROOT / "manifests" / "samples").glob("*.yaml")
                 if yaml.safe_load(p.read_text())["kind"] == "InferenceDeployment")


@cache
def kubectl() -> str | None:
    """The kubectl that e2e/build.sh built, without ever building it here."""
    p = subprocess.run(["bash", str(ROOT / "e2e" / "build.sh")], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "CHECK_ONLY": "1"})
    path = Path(p.stdout.strip().splitlines()[-1]) / "kubectl" if p.returncode == 0 and p.stdout.strip() else None
    return str(path) if path and path.exists() else None


SINGLE_NAMESPACE = ROOT / "manifests" / "overlays" / "single-namespace"


@cache
def rendered(kustomization: Path = ROOT / "manifests" / "base") -> list[dict[str, Any]]:
    binary = kubectl()
    if binary is None:
        pytest.skip("kubectl not built (bash e2e/build.sh builds it)")
    p = subprocess.run([binary, "kustomize", str(kustomization)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return [d for d in yaml.safe_load_all(p.stdout) if d]


def find(kind: str, name: str | None = None, docs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return next(d for d in (rendered() if docs is None else docs)
                if d["kind"] == kind and (name is None or d["metadata"]["name"] == name))


def test_base_renders_the_crds_and_the_operator() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for d in rendered()}
    assert ("CustomResourceDefinition", "inferencedeployments.serving.kvfleet.dev") in kinds
    assert ("CustomResourceDefinition", "clusterkopfpeerings.kopf.dev") in kinds
    assert {("Namespace", "kvfleet-system"), ("ServiceAccount", "kvfleet-operator"),
            ("ClusterRole", "kvfleet-operator"), ("ClusterRoleBinding", "kvfleet-operator"),
            ("Deployment", "kvfleet-operator")} <= kinds
    # One pass: no custom resource beside its CRD (the operator creates its ClusterKopfPeering itself).
    crd_kinds = {d["spec"]["names"]["kind"] for d in rendered() if d["kind"] == "CustomResourceDefinition"}
    assert not crd_kinds & {d["kind"] for d in rendered()}
    crd = find("CustomResourceDefinition", "inferencedeployments.serving.kvfleet.dev")
    committed = yaml.safe_load((ROOT / "crds" / "serving.kvfleet.dev_inferencedeployments.yaml").read_text())
    assert crd["spec"] == committed["spec"]  # the base carries the generated CRD, not a stale copy
    for d in rendered():
        cluster_scoped = d["kind"] in ("Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                                       "ClusterKopfPeering")
        assert ("namespace" in d["metadata"]) != cluster_scoped, d["kind"]
        if not cluster_scoped:
            assert d["metadata"]["namespace"] == "kvfleet-system"


def _verbs(group: str, resource: str, role: dict[str, Any] | None = None) -> set[str]:
    return {v for r in (role or find("ClusterRole"))["rules"] if group in r["apiGroups"] and resource in r["resources"]
            for v in r["verbs"]}


def _allowed(group: str, resource: str, verb: str) -> bool:
    return verb in _verbs(group, resource)


# What the operator does with each kind kube.py knows (get: ownership checks and reads; create + patch:
# server-side apply; list + watch: kopf's watches; delete: only the args ConfigMap, an opted-out NetworkPolicy and a
# router's grants it no longer needs; pods: the autoscaler and the router status list them, and get + watch are held
# only to be granted to routers; peering objects: kopf watches and patches them, peering.py lists them and creates
# the operator's own).
CALLS = {"Deployment": {"get", "list", "watch", "create", "patch"}, "Service": {"get", "create", "patch"},
         "PodDisruptionBudget": {"get", "create", "patch"}, "ConfigMap": {"get", "create", "patch", "delete"},
         "NetworkPolicy": {"get", "create", "patch", "delete"},
         "Pod": {"get", "list", "watch"}, "InferenceDeployment": {"get", "list", "watch", "patch"},
         "ServiceAccount": {"get", "create", "patch"}, "Role": {"get", "list", "create", "patch", "delete"},
         "RoleBinding": {"get", "list", "create", "patch", "delete"},
         "InferenceRouter": {"get", "list", "watch", "patch"},
         "ClusterKopfPeering": {"list", "watch", "create", "patch"}}
GROUPS = {"/api/v1": "", "/apis/apps/v1": "apps", "/apis/policy/v1": "policy",
          "/apis/networking.k8s.io/v1": "networking.k8s.io",
          "/apis/rbac.authorization.k8s.io/v1": "rbac.authorization.k8s.io",
          "/apis/serving.kvfleet.dev/v1alpha1": "serving.kvfleet.dev", "/apis/kopf.dev/v1": "kopf.dev"}


def test_rbac_covers_every_call_and_no_more() -> None:
    assert set(kube._KINDS) == set(CALLS)
    for kind, (prefix, plural) in kube._KINDS.items():
        assert _verbs(GROUPS[prefix], plural) == CALLS[kind], kind
    for plural in ("inferencedeployments", "inferencerouters"):
        assert _verbs("serving.kvfleet.dev", f"{plural}/status") == {"patch"}
        # blockOwnerDeletion on the owner references needs this under OwnerReferencesPermissionEnforcement.
        assert _verbs("serving.kvfleet.dev", f"{plural}/finalizers") == {"update"}
        assert not _allowed("serving.kvfleet.dev", plural, "update")  # never writes the spec
    assert not _allowed("", "pods", "delete") and not _allowed("", "secrets", "get")
    assert not _allowed("", "configmaps", "list")  # no cluster-wide read of every ConfigMap
    assert _verbs("", "events") == {"create", "patch"}
    assert _verbs("kopf.dev", "clusterkopfpeerings") == {"list", "watch", "create", "patch"}
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
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}
    assert env["KVFLEET_PEERING"] == "kvfleet"  # the ClusterKopfPeering it creates


def _downward_env(deployment: dict[str, Any]) -> dict[str, str]:
    """The operator container's environment as its kubelet would resolve it (metadata.namespace references)."""
    [c] = deployment["spec"]["template"]["spec"]["containers"]
    out = {}
    for e in c["env"]:
        if "valueFrom" in e:
            assert e["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}, e
            out[e["name"]] = deployment["metadata"]["namespace"]
        else:
            out[e["name"]] = e["value"]
    return out


def test_agents_network_policies_admit_the_operator_pods_as_installed() -> None:
    dep = find("Deployment", "kvfleet-operator")
    cfg = OperatorConfig.from_env(_downward_env(dep))
    assert cfg.operator_namespace == "kvfleet-system"
    cr = InferenceDeployment.model_validate(yaml.safe_load((ROOT / "manifests/samples/tiny-cpu.yaml").read_text())
                                            | {"metadata": {"name": "tiny", "namespace": "team-a"}})
    [operator_peer] = network_policy(cr, cfg.operator_namespace)["spec"]["ingress"][1]["from"]
    namespace = find("Namespace", "kvfleet-system")
    namespace_labels = {"kubernetes.io/metadata.name": namespace["metadata"]["name"]}  # set by the apiserver
    assert operator_peer["namespaceSelector"]["matchLabels"].items() <= namespace_labels.items()
    assert operator_peer["podSelector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert operator_peer["podSelector"]["matchLabels"] == OPERATOR_POD_LABELS


def test_single_namespace_overlay_needs_no_cluster_scoped_rights() -> None:
    docs = rendered(SINGLE_NAMESPACE)
    assert {(d["kind"], d["metadata"]["name"]) for d in docs} == {
        ("ServiceAccount", "kvfleet-operator"), ("Role", "kvfleet-operator"), ("RoleBinding", "kvfleet-operator"),
        ("Deployment", "kvfleet-operator"), ("Service", "kvfleet-operator-metrics")}  # no CRDs, no Namespace
    namespace = find("Deployment", docs=docs)["metadata"]["namespace"]
    assert {d["metadata"]["namespace"] for d in docs} == {namespace}
    role, binding = find("Role", docs=docs), find("RoleBinding", docs=docs)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "kvfleet-operator"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kvfleet-operator", "namespace": namespace}]
    # The ClusterRole's rules, less kopf's cluster-wide peering and its CRD and namespace watches.
    cluster_only = {"clusterkopfpeerings", "customresourcedefinitions", "namespaces"}
    assert role["rules"] == [r for r in find("ClusterRole")["rules"] if not set(r["resources"]) & cluster_only]
    for kind, (prefix, plural) in kube._KINDS.items():
        assert _verbs(GROUPS[prefix], plural, role) == (set() if kind == "ClusterKopfPeering" else CALLS[kind]), kind
    # The operator watches its own namespace only, standalone (peering is cluster-wide), and kopf reads nothing
    # cluster-scoped.
    cfg = OperatorConfig.from_env(_downward_env(find("Deployment", docs=docs)))
    assert cfg.namespaces == (namespace,) and cfg.peering == "" and cfg.operator_namespace == namespace
    assert cfg.settings().scanning.disabled


def test_single_namespace_overlay_follows_a_wrapping_namespace(tmp_path: Path) -> None:
    """A GitOps repository wraps the overlay and sets its own namespace: the RoleBinding's subject follows."""
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "team-a",
        "resources": [os.path.relpath(SINGLE_NAMESPACE, tmp_path)]}))
    docs = rendered(tmp_path)
    assert {d["metadata"]["namespace"] for d in docs} == {"team-a"}
    assert find("RoleBinding", docs=docs)["subjects"][0]["namespace"] == "team-a"


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


def test_the_cpu_sample_runs_on_a_cpu_node_and_says_what_it_waits_for() -> None:
    body = yaml.safe_load((ROOT / "manifests/samples/tiny-cpu.yaml").read_text())
    cr = InferenceDeployment.model_validate(body | {"metadata": {**body["metadata"], "namespace": "default"}})
    [deployment] = [o for o in plan(cr, "agent:test", 1).apply if o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert not pod.get("tolerations") and not pod.get("nodeSelector")  # any schedulable node, no GPU taint
    assert all("nvidia.com/gpu" not in str(c.get("resources")) for c in pod["containers"])
    unready = {"metadata": {"generation": 1},
               "status": {"replicas": 1, "updatedReplicas": 1, "observedGeneration": 1}}
    meta = {**body["metadata"], "namespace": "default", "uid": "u", "generation": 1}
    found = dict.fromkeys(child_keys("tiny-llama"))
    status = make_plan(body | {"metadata": meta}, found, OperatorConfig(), None).status(
        deployment=unready, errors=[], now="2026-01-01T00:00:00Z")
    [available] = [c for c in status["conditions"] if c["type"] == "Available"]
    assert "GPU" not in available["message"].replace("no GPU requested", "")
    assert "1 CPU and 2Gi memory free" in available["message"], available["message"]
