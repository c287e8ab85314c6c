"""manifests/ and docker/ for InferenceRouters: the base installs their CRD, the operator holds every permission its
router grants hand out (RBAC refuses to grant more than the granter holds), the sample is a valid router, and the
router image installs what the router imports."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from test_manifests import SINGLE_NAMESPACE, find, rendered

from kvfleet_operator import router_builders as rb
from kvfleet_operator.config import DEFAULT_ROUTER_IMAGE
from kvfleet_operator.router_models import InferenceRouter

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTION = {"prometheus_client": "prometheus-client", "yaml": "pyyaml"}  # import name → what pip installs


def _holds(role: dict[str, Any], group: str, resource: str, verb: str) -> bool:
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in role["rules"])


def test_the_base_installs_the_router_crd() -> None:
    crd = find("CustomResourceDefinition", "inferencerouters.serving.kvfleet.dev")
    committed = yaml.safe_load((ROOT / "crds" / "serving.kvfleet.dev_inferencerouters.yaml").read_text())
    assert crd["spec"] == committed["spec"]


def test_the_operator_holds_what_it_grants_routers_cluster_wide_and_in_one_namespace() -> None:
    for role in (find("ClusterRole"), find("Role", docs=rendered(SINGLE_NAMESPACE))):
        for rule in rb.GRANTED_RULES:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        assert _holds(role, group, resource, verb), (role["kind"], group, resource, verb)
        for kind in ("roles", "rolebindings"):
            assert _holds(role, "rbac.authorization.k8s.io", kind, "create")
            assert not _holds(role, "rbac.authorization.k8s.io", kind, "escalate")  # no way around the above
            assert not _holds(role, "rbac.authorization.k8s.io", kind, "bind")
        assert not _holds(role, "rbac.authorization.k8s.io", "clusterroles", "create")


def test_the_sample_router_is_valid_and_builds() -> None:
    body = yaml.safe_load((ROOT / "manifests" / "samples" / "router.yaml").read_text())
    body["metadata"]["namespace"] = "default"
    cr = InferenceRouter.model_validate(body)
    kinds = [o["kind"] for o in rb.desired(cr, "router:test")]
    assert kinds == ["ServiceAccount", "Role", "RoleBinding", "Deployment", "Service", "PodDisruptionBudget"]
    assert cr.spec.replicas >= 2  # the sample shows a router that survives a drain


def test_the_operator_deployment_names_the_default_router_image() -> None:
    [c] = find("Deployment", "kvfleet-operator")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["KVFLEET_ROUTER_IMAGE"] == DEFAULT_ROUTER_IMAGE


def test_the_router_image_installs_what_the_router_imports() -> None:
    """docker/router.Dockerfile installs the package without its dependencies, then only these: every third-party
    module the router's serving code imports must come from one of them (bench.py and the cost report, cost_*.py,
    are development tools run from a checkout)."""
    dockerfile = (ROOT / "docker" / "router.Dockerfile").read_text()
    match = re.search(r"wanted = \{([^}]*)\}", dockerfile)
    assert match is not None
    wanted = {w.strip().strip("'\"") for w in match.group(1).split(",")}
    imported: set[str] = set()
    for path in (ROOT / "router" / "kvfleet_router").glob("*.py"):
        if path.name == "bench.py" or path.name.startswith("cost_"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            imported |= {n.split(".")[0] for n in names}
    third_party = imported - set(sys.stdlib_module_names) - {"__future__", "kvfleet_router", "kvfleet_contract"}
    assert {DISTRIBUTION.get(m, m) for m in third_party} == wanted
