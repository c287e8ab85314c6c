"""charts/kvfleet: `helm lint` and `helm template` with the real helm (e2e/build_helm.sh), its CRDs equal to crds/, and
the chart rendering the same operator objects as manifests/base (scope cluster) and the single-namespace overlay."""

from __future__ import annotations

import copy
import os
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_manifests import SINGLE_NAMESPACE, rendered

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvfleet"
BUILD_HELM = ROOT / "e2e" / "build_helm.sh"
# Helm's own labels: the only difference allowed between the chart's objects and the kustomize base's.
HELM_LABELS = {"helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/instance",
               "app.kubernetes.io/version"}
EVERY_OPTION = ["--set", "router.enabled=true", "--set", "monitoring.serviceMonitor.enabled=true",
                "--set", "monitoring.podMonitor.enabled=true", "--set", "createNamespace=true"]


@cache
def helm() -> str:
    """The helm that e2e/build_helm.sh built. Missing: built here in CI (`make test` builds it first, with
    cluster-bins) or when KVFLEET_BUILD_HELM is set; a skip elsewhere, saying how to get it."""
    build = bool(os.environ.get("CI") or os.environ.get("KVFLEET_BUILD_HELM"))
    env = os.environ if build else {**os.environ, "CHECK_ONLY": "1"}
    p = subprocess.run(["bash", str(BUILD_HELM)], stdout=subprocess.PIPE, stderr=None if build else subprocess.PIPE,
                       text=True, timeout=1800, env=env)
    if p.returncode == 3 and not build:
        pytest.skip("helm not built: run `bash e2e/build_helm.sh` (about 4 min cold) or set KVFLEET_BUILD_HELM=1")
    assert p.returncode == 0 and p.stdout.strip(), f"{BUILD_HELM} failed (exit {p.returncode})"
    return p.stdout.strip().splitlines()[-1]


def run_helm(*args: str) -> str:
    p = subprocess.run([helm(), *args], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "HELM_CACHE_HOME": "/nonexistent", "KUBECONFIG": "/dev/null"})
    assert p.returncode == 0, p.stderr
    return p.stdout


def template(*args: str, namespace: str = "kvfleet-system") -> list[dict[str, Any]]:
    out = run_helm("template", "kvfleet", str(CHART), "--namespace", namespace, *args)
    return [d for d in yaml.safe_load_all(out) if d]


def comparable(doc: dict[str, Any]) -> dict[str, Any]:
    """An object less Helm's labels, its operator container's env in name order (kustomize's patch moves two)."""
    d = copy.deepcopy(doc)
    labels = d["metadata"].get("labels") or {}
    for key in HELM_LABELS & set(labels):
        del labels[key]
    if d["kind"] == "Deployment":
        for c in d["spec"]["template"]["spec"]["containers"]:
            c["env"] = sorted(c["env"], key=lambda e: e["name"])
    return d


def by_key(docs: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]): comparable(d) for d in docs}


@pytest.mark.parametrize("scope", ["cluster", "namespace"])
def test_helm_lint_passes_strict_with_every_option(scope: str) -> None:
    run_helm("lint", str(CHART), "--strict", "--set", f"scope={scope}", *EVERY_OPTION)
    run_helm("lint", str(CHART), "--strict", "--set", f"scope={scope}")


def test_chart_crds_are_the_generated_ones() -> None:
    chart_files = sorted(p.name for p in (CHART / "crds").glob("*.yaml"))
    assert chart_files == sorted(p.name for p in (ROOT / "crds").glob("*.yaml") if p.name != "kustomization.yaml")
    for name in chart_files:  # regenerate both: .venv/bin/python -m kvfleet_operator.crd
        assert (CHART / "crds" / name).read_text() == (ROOT / "crds" / name).read_text(), name


def test_cluster_scope_renders_what_the_kustomize_base_does() -> None:
    chart = by_key(template("--include-crds", "--set", "createNamespace=true"))
    base = by_key(rendered())
    assert chart.keys() == base.keys()
    for key, obj in base.items():
        assert chart[key] == obj, key
    assert by_key(template("--include-crds")).keys() == base.keys() - {("Namespace", "", "kvfleet-system")}


def test_namespace_scope_renders_what_the_single_namespace_overlay_does(tmp_path: Path) -> None:
    """As the overlay wrapped by a GitOps repository that sets its namespace, with the CRDs left to a cluster admin
    (`helm install --skip-crds`, which `helm template` without --include-crds mirrors)."""
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "team-a",
        "resources": [os.path.relpath(SINGLE_NAMESPACE, tmp_path)]}))
    overlay = by_key(rendered(tmp_path))
    chart = by_key(template("--set", "scope=namespace", namespace="team-a"))
    assert chart.keys() == overlay.keys()
    for key, obj in overlay.items():
        assert chart[key] == obj, key


def test_optional_objects_render_only_when_enabled() -> None:
    kinds = {d["kind"] for d in template()}
    assert not kinds & {"ServiceMonitor", "PodMonitor", "InferenceRouter", "Namespace"}
    docs = {d["kind"]: d for d in template(*EVERY_OPTION)}
    router = docs["InferenceRouter"]
    assert router["metadata"]["namespace"] == "kvfleet-system" and router["spec"]["replicas"] == 2
    monitor = docs["PodMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"]["app.kubernetes.io/name"] == "kvfleet-agent"
    assert monitor["namespaceSelector"] == {"any": True}
    scoped = {d["kind"]: d for d in template("--set", "scope=namespace", *EVERY_OPTION, namespace="team-a")}
    assert scoped["PodMonitor"]["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]}
    assert "Namespace" not in scoped  # a namespace-scoped install never creates cluster-scoped objects
    service = by_key(rendered())["Service", "kvfleet-system", "kvfleet-operator-metrics"]
    endpoint = docs["ServiceMonitor"]["spec"]["endpoints"][0]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"]


def test_values_the_chart_refuses() -> None:
    for bad in (["--set", "scope=everywhere"], ["--set", "scope=namespace", "--set", "replicas=2"]):
        p = subprocess.run([helm(), "template", "kvfleet", str(CHART), *bad], capture_output=True, text=True,
                           timeout=120)
        assert p.returncode != 0 and ("scope" in p.stderr), p.stderr
