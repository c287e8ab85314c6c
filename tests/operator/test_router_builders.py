"""Golden tests of the router's pure builders: tests/operator/golden/router/*.input.yaml (an InferenceRouter) →
*.expected.yaml (what the operator applies), and the contracts the golden files cannot show.

Regenerate the expected files after an intended change, then review the diff:
    KVFLEET_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/operator/test_router_builders.py
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet_contract.metrics import ROUTER_APP, ROUTER_PORT
from kvfleet_operator import router_builders as rb
from kvfleet_operator.builders import CLIENT_LABEL, network_policy
from kvfleet_operator.config import DEFAULT_ROUTER_IMAGE
from kvfleet_operator.models import InferenceDeployment
from kvfleet_operator.router_models import InferenceRouter

GOLDEN = Path(__file__).parent / "golden" / "router"
INPUTS = sorted(GOLDEN.glob("*.input.yaml"))
UPDATE = os.environ.get("KVFLEET_UPDATE_GOLDEN") == "1"


def load(path: Path) -> InferenceRouter:
    return InferenceRouter.model_validate(yaml.safe_load(path.read_text()))


def router(spec: dict[str, Any] | None = None, namespace: str = "serving") -> InferenceRouter:
    return InferenceRouter.model_validate({"metadata": {"name": "front", "namespace": namespace, "uid": "u-1"},
                                           "spec": spec or {}})


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


@pytest.mark.parametrize("path", INPUTS, ids=[p.name.removesuffix(".input.yaml") for p in INPUTS])
def test_golden(path: Path) -> None:
    expected_path = path.with_name(path.name.replace(".input.yaml", ".expected.yaml"))
    got = yaml.safe_dump({"apply": rb.desired(load(path), DEFAULT_ROUTER_IMAGE)}, sort_keys=False, width=120)
    if UPDATE:
        expected_path.write_text(got)
    assert expected_path.exists(), f"missing {expected_path.name}: run with KVFLEET_UPDATE_GOLDEN=1"
    want = expected_path.read_text()
    if got != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True), "expected", "got"))
        pytest.fail(f"{path.name} renders differently (KVFLEET_UPDATE_GOLDEN=1 to accept):\n{diff}")


def test_golden_inputs_cover_defaults_every_setting_and_foreign_namespaces() -> None:
    crs = [load(p) for p in INPUTS]
    assert any(cr.spec.model_dump(exclude_defaults=True) == {} for cr in crs)
    full = next(cr for cr in crs if cr.spec.replicas > 1)
    for key in ("node_selector", "tolerations", "labels", "annotations"):
        assert getattr(full.spec.pod, key), key
    assert full.spec.image and full.spec.image_pull_policy and full.spec.resources.limits
    assert full.metadata.namespace in full.watched and len(full.watched) > 2
    assert any(cr.metadata.namespace not in cr.watched for cr in crs)


def test_every_child_is_owned_except_grants_in_other_namespaces() -> None:
    cr = router({"watchNamespaces": ["serving", "team-a"]})
    objs = rb.desired(cr, "r:1")
    assert [(o["kind"], o["metadata"]["namespace"]) for o in objs] == [
        ("ServiceAccount", "serving"), ("Role", "serving"), ("RoleBinding", "serving"), ("Role", "team-a"),
        ("RoleBinding", "team-a"), ("Deployment", "serving"), ("Service", "serving"),
        ("PodDisruptionBudget", "serving")]
    for o in objs:
        refs = o["metadata"].get("ownerReferences")
        # Garbage collection deletes a dependent whose owner is not in its own namespace: none there.
        if o["metadata"]["namespace"] == "team-a":
            assert refs is None
        else:
            assert refs == [{"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceRouter", "name": "front",
                             "uid": "u-1", "controller": True, "blockOwnerDeletion": True}]
    for grant in by_kind(objs, "Role") + by_kind(objs, "RoleBinding"):
        assert grant["metadata"]["name"] == "kvfleet-router:serving:front"
        labels = grant["metadata"]["labels"]
        selector = dict(term.split("=") for term in rb.grant_selector("serving", "front").split(","))
        assert selector.items() <= labels.items()


def test_the_grants_are_read_only_on_pods_and_inference_deployments() -> None:
    objs = rb.desired(router({"watchNamespaces": ["a", "b"]}), "r:1")
    for role in by_kind(objs, "Role"):
        assert role["rules"] == [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": ["serving.kvfleet.dev"], "resources": ["inferencedeployments"],
             "verbs": ["get", "list", "watch"]}]
    for binding in by_kind(objs, "RoleBinding"):
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                      "name": "kvfleet-router:serving:front"}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "front", "namespace": "serving"}]
    [sa] = by_kind(objs, "ServiceAccount")
    [dep] = by_kind(objs, "Deployment")
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]


def test_grant_names_cannot_collide_between_routers() -> None:
    names = {rb.grant_name(ns, name) for ns in ("a", "a-b", "b") for name in ("x", "b-x", "x-b")}
    assert len(names) == 9  # ':' is in neither a namespace nor a router name


def test_the_pod_runs_kvfleet_router_with_every_setting_explicit(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfleet_router import cli

    cr = router({"watchNamespaces": ["team-a", "serving"], "epsilon": 0.5, "scrapeIntervalSeconds": 1,
                 "holdQueue": {"size": 16, "timeoutSeconds": 30}})
    [c] = rb.pod_template(cr, "r:1")["spec"]["containers"]
    assert c["command"] == [ROUTER_APP] and c["ports"] == [{"name": "http", "containerPort": ROUTER_PORT,
                                                            "protocol": "TCP"}]
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}} in c["env"]
    # The router's own parser reads the arguments (with credentials, as in a pod: a kubeconfig here).
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:6443", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "t"}}], "contexts": [{"name": "c", "context": {"cluster": "k",
                                                                                               "user": "u"}}]}))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    a = cli.parse(c["args"])
    assert a.kubernetes and (a.host, a.port) == ("0.0.0.0", ROUTER_PORT)
    assert a.namespaces == ["team-a", "serving"]
    assert (a.epsilon, a.scrape_interval, a.hold_queue_size, a.hold_timeout) == (0.5, 1.0, 16, 30.0)


def test_router_pods_are_admitted_by_the_agents_network_policy_of_their_namespace() -> None:
    pod_labels = rb.pod_template(router({"pod": {"labels": {"team": "x"}}}), "r:1")["metadata"]["labels"]
    assert pod_labels[rb.NAME_LABEL] == ROUTER_APP and pod_labels["team"] == "x"
    idp = InferenceDeployment.model_validate({"metadata": {"name": "m", "namespace": "serving", "uid": "u"},
                                              "spec": {"model": {"name": "m", "source": {"pvc": {"claimName": "c"}}}}})
    clients = network_policy(idp, "kvfleet-system")["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert clients.items() <= pod_labels.items() and CLIENT_LABEL in clients
    assert rb.selector_labels("front").items() <= pod_labels.items()


def test_resources_default_only_when_none_are_given() -> None:
    def resources(spec: dict[str, Any]) -> Any:
        return rb.pod_template(router(spec), "r:1")["spec"]["containers"][0].get("resources")

    assert resources({}) == {"requests": {"cpu": "250m", "memory": "256Mi"}}
    # Given limits alone: no default request that could exceed them (the API would refuse such pods).
    assert resources({"resources": {"limits": {"memory": "128Mi"}}}) == {"limits": {"memory": "128Mi"}}
    assert resources({"resources": {}}) is None


def test_the_spec_image_wins_over_the_operators_default() -> None:
    def image(spec: dict[str, Any]) -> str:
        return str(rb.deployment(router(spec), "default:1")["spec"]["template"]["spec"]["containers"][0]["image"])

    assert image({}) == "default:1" and image({"image": "mine:2"}) == "mine:2"


def test_the_pdb_never_blocks_a_drain_and_keeps_one_of_two() -> None:
    for replicas in (1, 2, 5):
        pdb = rb.pod_disruption_budget(router({"replicas": replicas}))
        assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
        assert pdb["spec"]["selector"]["matchLabels"] == rb.selector_labels("front")


def test_tiered_models_reach_the_router_as_it_parses_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfleet_router import cli
    from kvfleet_router.tier_config import parse_tiers

    assert "--tiers" not in rb.router_args(router().spec, ("serving",))  # none: the flag is left out
    [cr] = [load(p) for p in INPUTS if p.name == "tiered-models.input.yaml"]
    args = rb.router_args(cr.spec, cr.watched)
    assert args.count("--tiers") == 1 and args[-2] == "--tiers"
    rendered = json.loads(args[-1])
    # camelCase, every default written out: the router runs what the CR shows, whatever its own defaults.
    assert rendered[0]["quality"] == {"sampleRate": 0.05, "threshold": 0.5, "hysteresis": 0.1, "windowSeconds": 300.0,
                                      "minSamples": 20, "maxConcurrentReplays": 2, "maxReplaysPerMinute": 60}
    assert rendered[0]["classifier"]["classes"] == [{"name": "simple", "tier": 0, "maxPromptTokens": 512,
                                                     "maxOutputTokens": 256, "maxTurns": 4, "markers": False}]
    given = yaml.safe_load((GOLDEN / "tiered-models.input.yaml").read_text())["spec"]["tieredModels"]
    assert parse_tiers(rendered) == parse_tiers(given)
    kubeconfig = tmp_path / "kubeconfig"  # the router's own command line parser, as in its pod
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:6443", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "t"}}], "contexts": [{"name": "c", "context": {"cluster": "k",
                                                                                               "user": "u"}}]}))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    assert cli.parse(args).tiered == parse_tiers(given)
