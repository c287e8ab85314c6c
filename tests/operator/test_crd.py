"""The committed CRD is what the models generate, and it is a structural schema with the subresources we rely on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from kvfleet_operator.crd import CRD_FILE, FILES, REGENERATE, crd, render

ROOT = Path(__file__).resolve().parents[2]


def test_committed_crds_are_up_to_date() -> None:
    assert CRD_FILE in FILES
    for name in FILES:
        committed = (ROOT / "crds" / name).read_text()
        assert committed == render(name), f"crds/{name} is stale: regenerate it with `{REGENERATE}`"


def test_crds_kustomization_lists_every_file() -> None:
    listed = yaml.safe_load((ROOT / "crds" / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in (ROOT / "crds").glob("*.yaml") if p.name != "kustomization.yaml")


def _walk(node: dict[str, Any], path: str) -> list[str]:
    """Paths whose schema is not structural: every node needs a type (or int-or-string / preserve-unknown)."""
    bad = []
    if not ({"type", "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields"} & node.keys()):
        bad.append(path)
    for key, sub in (node.get("properties") or {}).items():
        bad += _walk(sub, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        bad += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        bad += _walk(node["additionalProperties"], f"{path}{{}}")
    return bad


def _described(node: dict[str, Any], path: str) -> list[str]:
    missing = [] if node.get("description") else [path]
    for key, sub in (node.get("properties") or {}).items():
        missing += _described(sub, f"{path}.{key}")
    return missing


def test_schema_is_structural_and_documented() -> None:
    version = crd()["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    assert _walk(schema, "") == []
    assert _described(schema["properties"]["spec"], "spec") == []
    text = yaml.safe_dump(schema)
    assert "$ref" not in text and "title:" not in text
    assert "nullable" not in yaml.safe_dump(schema["properties"]["spec"])  # absent, not null, in a spec
    status = schema["properties"]["status"]
    assert "x-kubernetes-preserve-unknown-fields" not in yaml.safe_dump(status)
    assert status["properties"]["conditions"]["x-kubernetes-list-type"] == "map"


def test_lists_and_strings_in_cel_rules_are_bounded() -> None:
    # The apiserver estimates each rule's cost from maxItems/maxLength; unbounded ones can exceed its budget.
    def check(node: dict[str, Any], path: str) -> None:
        if node.get("type") == "array":
            assert "maxItems" in node, path
        if node.get("type") == "string" and "enum" not in node and "format" not in node:
            assert "maxLength" in node, path
        for key, sub in (node.get("properties") or {}).items():
            check(sub, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            check(node["items"], f"{path}[]")

    check(crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"], "spec")


def test_names_subresources_and_columns() -> None:
    c = crd()
    assert c["metadata"]["name"] == "inferencedeployments.serving.kvfleet.dev"
    names = c["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"], names["categories"]) == (
        "InferenceDeployment", "inferencedeployments", ["infd"], ["kvfleet"])
    v = c["spec"]["versions"][0]
    assert v["name"] == "v1alpha1" and v["served"] and v["storage"]
    assert v["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                          "statusReplicasPath": ".status.replicas",
                                          "labelSelectorPath": ".status.selector"}
    cols = {col["name"]: col for col in v["additionalPrinterColumns"]}
    assert cols["Ready"]["jsonPath"] == ".status.readyReplicas" and cols["Model"]["jsonPath"] == ".spec.model.name"
    # The SLO columns are strings with their unit; they and the autoscaling mode show without -o wide.
    assert cols["TTFT-P95"]["jsonPath"] == ".status.autoscaling.ttftP95" and cols["TTFT-P95"]["type"] == "string"
    assert cols["ITL-P95"]["jsonPath"] == ".status.autoscaling.itlP95" and "Age" in cols
    assert cols["Autoscaling"]["jsonPath"] == ".spec.autoscaling.mode"
    assert not [c for c in cols.values() if c.get("priority")]
    props = v["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["autoscaling"]["properties"]
    assert "windowSeconds" in props["ttftP95"]["description"] and "lower of" in props["ttftP95"]["description"]


def test_module_writes_every_crd(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "kvfleet_operator.crd", str(tmp_path)], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert p.stdout == ""  # nothing on stdout: `... > crds/FILE`, the old way to run it, cannot clobber a file
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted(FILES)
    for name in FILES:
        assert (tmp_path / name).read_text() == render(name), name
    missing = subprocess.run([sys.executable, "-m", "kvfleet_operator.crd", str(tmp_path / "nope")],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert missing.returncode == 2 and "no directory" in missing.stderr
