"""The InferenceRouter models refuse what its CRD's CEL rules refuse, with the same message; the CRD is structural,
documented, bounded, and its defaults are the models' (the apiserver's side: e2e/test_router_operator.py)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from kvfleet_operator import router_rules, router_tier_rules, rules
from kvfleet_operator.crd import ROUTER_CRD_FILE, render, router_crd
from kvfleet_operator.router_models import InferenceRouter, InferenceRouterSpec

# (spec, the rule it breaks): one mistake per rule; test_every_rule_has_a_case keeps the list complete.
CASES: list[tuple[str, dict[str, Any], rules.Rule]] = [
    ("reserved pod label", {"pod": {"labels": {"app.kubernetes.io/instance": "x"}}}, router_rules.ROUTER_LABELS_RULE),
    ("client label", {"pod": {"labels": {"serving.kvfleet.dev/client": "false"}}}, router_rules.ROUTER_LABELS_RULE),
    ("namespace with capitals", {"watchNamespaces": ["Team-A"]}, router_rules.WATCH_NAMESPACES_NAME_RULE),
    ("namespace ending in -", {"watchNamespaces": ["team-"]}, router_rules.WATCH_NAMESPACES_NAME_RULE),
    ("namespace twice", {"watchNamespaces": ["a", "b", "a"]}, router_rules.WATCH_NAMESPACES_UNIQUE_RULE),
    ("negative epsilon", {"epsilon": -0.1}, router_rules.EPSILON_RULE),
    ("huge epsilon", {"epsilon": 101}, router_rules.EPSILON_RULE),
    ("zero scrape interval", {"scrapeIntervalSeconds": 0}, router_rules.SCRAPE_INTERVAL_RULE),
    ("slow scrape interval", {"scrapeIntervalSeconds": 5.5}, router_rules.SCRAPE_INTERVAL_RULE),
    ("negative hold queue", {"holdQueue": {"size": -1}}, router_rules.HOLD_SIZE_RULE),
    ("huge hold queue", {"holdQueue": {"size": 100001}}, router_rules.HOLD_SIZE_RULE),
    ("zero hold timeout", {"holdQueue": {"timeoutSeconds": 0}}, router_rules.HOLD_TIMEOUT_RULE),
    ("hold timeout over an hour", {"holdQueue": {"timeoutSeconds": 3601}}, router_rules.HOLD_TIMEOUT_RULE),
    ("bad quantity", {"resources": {"limits": {"memory": "much"}}}, rules.QUANTITY_RULE),
]


@pytest.mark.parametrize(("patch", "rule"), [(p, r) for _, p, r in CASES], ids=[c[0] for c in CASES])
def test_rule_rejects_with_its_message(patch: dict[str, Any], rule: rules.Rule) -> None:
    with pytest.raises(ValidationError) as e:
        InferenceRouterSpec.model_validate(patch)
    assert rule.message in str(e.value)


def _validations(node: Any) -> list[dict[str, str]]:
    if isinstance(node, dict):
        return [*node.get("x-kubernetes-validations", []), *(v for x in node.values() for v in _validations(x))]
    if isinstance(node, list):
        return [v for x in node for v in _validations(x)]
    return []


def test_every_rule_has_a_case_and_sits_in_the_crd() -> None:
    shared = {v for v in vars(rules).values() if isinstance(v, rules.Rule)}
    ours = {v for v in vars(router_rules).values() if isinstance(v, rules.Rule)} - shared
    assert ours - {r for _, _, r in CASES} == {router_rules.ROUTER_NAME_RULE}  # see test_metadata_name
    # spec.tieredModels' rules: their cases are in test_router_tier_models.py.
    tiers = {v for v in vars(router_tier_rules).values() if isinstance(v, rules.Rule)}
    in_crd = {(v["rule"], v["message"]) for v in _validations(router_crd())}
    assert in_crd == {(r.rule, r.message) for r in ours | tiers | {rules.QUANTITY_RULE}}


def test_metadata_name_must_be_a_dns_label() -> None:
    for bad in ("Upper", "has.dot", "-lead", "x" * 64):
        with pytest.raises(ValidationError, match="the router's Service is named after it"):
            InferenceRouter.model_validate({"metadata": {"name": bad}, "spec": {}})
    assert InferenceRouter.model_validate({"metadata": {"name": "ok-1"}}).metadata.name == "ok-1"


def test_accepts_the_edges_the_rules_allow() -> None:
    edges = InferenceRouterSpec.model_validate({"epsilon": 0, "scrapeIntervalSeconds": 5, "replicas": 0,
                                                "holdQueue": {"size": 0, "timeoutSeconds": 3600},
                                                "watchNamespaces": ["a", "a-1", "1"]})
    assert (edges.epsilon, edges.scrape_interval_seconds, edges.hold_queue.size) == (0, 5, 0)


def _defaults(schema: dict[str, Any]) -> dict[str, Any]:
    """What the apiserver makes of an empty spec: each property's default, recursively applied."""
    out: dict[str, Any] = {}
    for key, prop in schema.get("properties", {}).items():
        if "default" in prop:
            value = prop["default"]
            out[key] = {**_defaults(prop), **value} if prop.get("type") == "object" else value
    return out


def test_an_empty_spec_defaults_in_the_crd_as_in_the_models() -> None:
    spec_schema = router_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec_schema["default"] == {}  # `spec:` may be left out
    from_crd = InferenceRouterSpec.model_validate(_defaults(spec_schema))
    assert from_crd == InferenceRouterSpec()
    assert from_crd.model_dump() == InferenceRouterSpec.model_validate({}).model_dump()


def test_names_columns_and_no_scale_subresource() -> None:
    c = router_crd()
    assert c["metadata"]["name"] == "inferencerouters.serving.kvfleet.dev"
    names = c["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"], names["categories"]) == (
        "InferenceRouter", "inferencerouters", ["ir"], ["kvfleet"])
    [version] = c["spec"]["versions"]
    assert version["subresources"] == {"status": {}}
    assert [col["name"] for col in version["additionalPrinterColumns"]] == ["Ready", "Replicas", "Models", "Age"]
    assert "required" not in version["schema"]["openAPIV3Schema"]


def test_schema_is_structural_documented_and_bounded() -> None:
    schema = router_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]

    def check(node: dict[str, Any], path: str, spec: bool) -> None:
        assert {"type", "x-kubernetes-int-or-string"} & node.keys(), path
        if spec:
            assert node.get("description"), path
            if node.get("type") == "array":
                assert "maxItems" in node, path
            if node.get("type") == "string" and "enum" not in node:
                assert "maxLength" in node, path
        for key, sub in (node.get("properties") or {}).items():
            check(sub, f"{path}.{key}", spec)
        if isinstance(node.get("items"), dict):
            check(node["items"], f"{path}[]", spec and "properties" in node["items"])

    check(schema["properties"]["spec"], "spec", True)
    check(schema["properties"]["status"], "status", False)
    text = yaml.safe_dump(schema)
    assert "$ref" not in text and "title:" not in text
    assert schema["properties"]["status"]["properties"]["conditions"]["x-kubernetes-list-type"] == "map"
    assert render(ROUTER_CRD_FILE).startswith("# Generated from operator/kvfleet_operator/router_models.py")
