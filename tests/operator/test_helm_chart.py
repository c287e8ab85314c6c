"""charts/kvfleet: `helm lint` and `helm template` with the real helm (e2e/build_helm.sh), its CRDs, dashboards and
alerts equal to their sources, and the chart rendering the same operator objects as manifests/base (scope cluster) and
the single-namespace overlay."""

from __future__ import annotations

import copy
import json
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
MONITORING = ["--set", "monitoring.serviceMonitor.enabled=true", "--set", "monitoring.podMonitor.enabled=true",
              "--set", "monitoring.prometheusRule.enabled=true", "--set", "monitoring.dashboards.enabled=true"]
EVERY_OPTION = ["--set", "router.enabled=true", *MONITORING, "--set", "createNamespace=true"]
SWITCHES = ["router.enabled", "createNamespace", *(MONITORING[i + 1].removesuffix("=true")
                                                   for i in range(0, len(MONITORING), 2))]


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


@pytest.mark.parametrize("switch", SWITCHES)
def test_helm_lint_passes_strict_with_each_switch_alone(switch: str) -> None:
    run_helm("lint", str(CHART), "--strict", "--set", f"{switch}=true")


def test_chart_files_are_copies_of_the_dashboards_and_alerts() -> None:
    """Helm reads only files inside the chart: dashboards/generate.py copies them into files/ (rerun it after editing
    alerts/kvfleet-rules.yaml or the dashboards)."""
    pairs = [(CHART / "files" / "kvfleet-rules.yaml", ROOT / "alerts" / "kvfleet-rules.yaml")]
    pairs += [(CHART / "files" / "dashboards" / p.name, p) for p in (ROOT / "dashboards").glob("*.json")]
    assert sorted(p.name for p in (CHART / "files" / "dashboards").iterdir()) == sorted(
        p.name for p in (ROOT / "dashboards").glob("*.json"))
    for copied, source in pairs:
        assert copied.read_text() == source.read_text(), f"{copied} differs: run python dashboards/generate.py"


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
    optional = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap", "InferenceRouter", "Namespace"}
    assert not {d["kind"] for d in template()} & optional
    docs = {(d["kind"], d["metadata"]["name"]): d for d in template(*EVERY_OPTION)}
    router = docs["InferenceRouter", "kvfleet"]
    assert router["metadata"]["namespace"] == "kvfleet-system" and router["spec"]["replicas"] == 2
    monitor = docs["PodMonitor", "kvfleet-agents"]["spec"]
    assert monitor["selector"]["matchLabels"]["app.kubernetes.io/name"] == "kvfleet-agent"
    assert monitor["namespaceSelector"] == {"any": True}
    scoped = {(d["kind"], d["metadata"]["name"]): d
              for d in template("--set", "scope=namespace", *EVERY_OPTION, namespace="team-a")}
    assert scoped["PodMonitor", "kvfleet-agents"]["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]}
    assert "Namespace" not in {kind for kind, _ in scoped}  # a namespace-scoped install never creates cluster objects
    service = by_key(rendered())["Service", "kvfleet-system", "kvfleet-operator-metrics"]
    endpoint = docs["ServiceMonitor", "kvfleet-operator"]["spec"]["endpoints"][0]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"]
    # kvfleet_operator_desired_replicas' own namespace label (the InferenceDeployment's) is the one queries group by.
    assert endpoint["honorLabels"] is True


@pytest.mark.parametrize("switch", SWITCHES)
def test_each_switch_renders_only_its_own_objects(switch: str) -> None:
    base = {(d["kind"], d["metadata"]["name"]) for d in template()}
    added = {(d["kind"], d["metadata"]["name"]) for d in template("--set", f"{switch}=true")} - base
    expected = {"router.enabled": {"InferenceRouter"}, "createNamespace": {"Namespace"},
                "monitoring.serviceMonitor.enabled": {"ServiceMonitor"},
                "monitoring.podMonitor.enabled": {"PodMonitor"},
                "monitoring.prometheusRule.enabled": {"PrometheusRule"},
                "monitoring.dashboards.enabled": {"ConfigMap"}}[switch]
    assert added and {kind for kind, _ in added} == expected


def test_pod_monitors_relabel_what_the_dashboards_and_alerts_query() -> None:
    """Jobs kvfleet-agent and kvfleet-router (`up{job="kvfleet-agent"}` in the dashboards), and namespace, pod and
    inference_deployment: the labels dashboards/*.json and alerts/kvfleet-rules.yaml group and select by."""
    monitors = {d["metadata"]["name"]: d["spec"] for d in template("--set", "monitoring.podMonitor.enabled=true")
                if d["kind"] == "PodMonitor"}
    assert sorted(monitors) == ["kvfleet-agents", "kvfleet-routers"]
    queries = "\n".join(t["expr"] for p in (ROOT / "dashboards").glob("*.json")
                        for panel in json.loads(p.read_text())["panels"] for t in panel["targets"])
    queries += (ROOT / "alerts" / "kvfleet-rules.yaml").read_text()
    for name, app, job, labels in (("kvfleet-agents", "kvfleet-agent", "kvfleet-agent",
                                    {"namespace", "pod", "inference_deployment"}),
                                   ("kvfleet-routers", "kvfleet-router", "kvfleet-router", {"namespace", "pod"})):
        spec = monitors[name]
        assert spec["selector"]["matchLabels"] == {"app.kubernetes.io/name": app,
                                                   "app.kubernetes.io/managed-by": "kvfleet-operator"}
        (endpoint,) = spec["podMetricsEndpoints"]
        assert endpoint["port"] == "http"
        relabel = {r["targetLabel"]: r for r in endpoint["relabelings"]}
        assert relabel.pop("job") == {"targetLabel": "job", "replacement": job}
        assert set(relabel) == labels
        assert relabel["namespace"]["sourceLabels"] == ["__meta_kubernetes_namespace"]
        assert relabel["pod"]["sourceLabels"] == ["__meta_kubernetes_pod_name"]
        for label in labels:
            assert label in queries  # each relabelled label is one the queries use
    assert monitors["kvfleet-agents"]["podMetricsEndpoints"][0]["relabelings"][-1]["sourceLabels"] == [
        "__meta_kubernetes_pod_label_serving_kvfleet_dev_inference_deployment"]
    assert 'job="kvfleet-agent"' in queries


def test_prometheus_rule_carries_the_alerts_file() -> None:
    docs = template("--set", "monitoring.prometheusRule.enabled=true",
                    "--set", "monitoring.prometheusRule.labels.release=prom")
    (rule,) = (d for d in docs if d["kind"] == "PrometheusRule")
    source = yaml.safe_load((ROOT / "alerts" / "kvfleet-rules.yaml").read_text())
    assert rule["apiVersion"] == source["apiVersion"] and rule["spec"] == source["spec"]
    assert rule["metadata"]["namespace"] == "kvfleet-system" and rule["metadata"]["labels"]["release"] == "prom"
    # Grafana/Prometheus templates in annotations stay as written (Helm must not evaluate them).
    alert = next(r for g in rule["spec"]["groups"] for r in g["rules"] if r.get("alert") == "KvfleetTTFTBudgetBurn")
    assert "{{ $labels.namespace }}" in alert["annotations"]["summary"]


def test_dashboards_render_as_configmaps_for_the_grafana_sidecar() -> None:
    docs = [d for d in template("--set", "monitoring.dashboards.enabled=true",
                                "--set", "monitoring.dashboards.namespace=monitoring") if d["kind"] == "ConfigMap"]
    sources = {p.name: p.read_text() for p in (ROOT / "dashboards").glob("*.json")}
    assert len(docs) == len(sources) == 4
    for doc in docs:
        assert doc["metadata"]["labels"]["grafana_dashboard"] == "1"  # what kube-prometheus-stack's sidecar selects
        assert doc["metadata"]["namespace"] == "monitoring"
        ((key, text),) = doc["data"].items()
        assert doc["metadata"]["name"] == key.removesuffix(".json") + "-dashboard"
        assert text == sources[key] and json.loads(text)["uid"] == key.removesuffix(".json")


def test_readme_explains_every_alert_and_dashboard() -> None:
    """README's "Watch it" tables name each alert of alerts/kvfleet-rules.yaml and each dashboard of dashboards/."""
    readme = (ROOT / "README.md").read_text()
    watch = readme[readme.index("## Watch it"):readme.index("\n## ", readme.index("## Watch it") + 1)]
    source = yaml.safe_load((ROOT / "alerts" / "kvfleet-rules.yaml").read_text())
    for alert in (r["alert"] for g in source["spec"]["groups"] for r in g["rules"] if "alert" in r):
        assert f"`{alert}`" in watch or f"`{alert.removesuffix('Slow')}` / `...Slow`" in watch, alert
    for path in (ROOT / "dashboards").glob("*.json"):
        assert f"`{path.name}`" in watch, path.name


def test_values_the_chart_refuses() -> None:
    for bad in (["--set", "scope=everywhere"], ["--set", "scope=namespace", "--set", "replicas=2"]):
        p = subprocess.run([helm(), "template", "kvfleet", str(CHART), *bad], capture_output=True, text=True,
                           timeout=120)
        assert p.returncode != 0 and ("scope" in p.stderr), p.stderr
