"""Generates the InferenceDeployment and InferenceRouter CRDs from the pydantic models into crds/:
`python -m kvfleet_operator.crd`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, NoDefault
from pydantic_core import core_schema

from kvfleet_operator.models import GROUP, KIND, PLURAL, VERSION, InferenceDeploymentSpec
from kvfleet_operator.router_models import ROUTER_KIND, ROUTER_PLURAL, InferenceRouterSpec, InferenceRouterStatus
from kvfleet_operator.router_rules import ROUTER_NAME_RULE
from kvfleet_operator.rules import NAME_RULE
from kvfleet_operator.status import InferenceDeploymentStatus

CRD_FILE = f"{GROUP}_{PLURAL}.yaml"
ROUTER_CRD_FILE = f"{GROUP}_{ROUTER_PLURAL}.yaml"
REGENERATE = ".venv/bin/python -m kvfleet_operator.crd"
# JSON-schema keywords a structural OpenAPI v3 schema accepts (the rest, e.g. title, are dropped).
_KEEP = {"type", "description", "default", "enum", "format", "minimum", "maximum", "exclusiveMinimum",
         "exclusiveMaximum", "minLength", "maxLength", "pattern", "minItems", "maxItems", "minProperties",
         "maxProperties", "items", "properties", "required", "additionalProperties", "nullable", "anyOf"}


def _drop_empty(value: dict[str, Any]) -> dict[str, Any]:
    """A default object without its empty lists and maps (they would only clutter every stored object)."""
    out = {k: _drop_empty(v) if isinstance(v, dict) else v for k, v in value.items()}
    return {k: v for k, v in out.items() if v not in ({}, [])}


class _Schema(GenerateJsonSchema):
    """Pydantic's JSON schema, with default factories evaluated so the apiserver applies the same defaults."""

    def get_default_value(self, schema: core_schema.WithDefaultSchema) -> Any:
        factory = schema.get("default_factory")
        if factory is None or schema.get("default_factory_takes_data"):
            return super().get_default_value(schema)
        value = factory()  # type: ignore[call-arg]
        if isinstance(value, BaseModel):
            # In full, not `{}`: the apiserver checks a default against the CEL rules without defaulting inside it.
            return _drop_empty(value.model_dump(mode="json", by_alias=True, exclude_none=True))
        if isinstance(value, list) and value and isinstance(value[0], BaseModel):
            return [v.model_dump(mode="json", by_alias=True, exclude_defaults=False) for v in value]
        return value if value else NoDefault  # an empty list or map needs no default


def _convert(node: dict[str, Any], defs: dict[str, Any], *, status: bool) -> dict[str, Any]:
    """Inline $refs and turn JSON Schema 2020 into the OpenAPI v3 subset a structural CRD schema accepts."""
    if "$ref" in node:
        target = defs[node["$ref"].split("/")[-1]]
        node = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
    if "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
        variants = [v for v in node["anyOf"] if v.get("type") != "null"]
        if len(variants) == 1:  # Optional[X]: absent in the spec; null allowed only in status
            rest = {k: v for k, v in node.items() if k != "anyOf"}
            node = {**_convert(variants[0], defs, status=status), **rest}
            if status:
                node["nullable"] = True
            if node.get("default", 0) is None:
                del node["default"]
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-"):
            out[key] = value
        elif key == "const":
            out["enum"] = [value]
        elif key not in _KEEP:
            continue
        elif key == "properties":
            out[key] = {k: _convert(v, defs, status=status) for k, v in value.items()}
        elif key in ("items",) or (key == "additionalProperties" and isinstance(value, dict)):
            out[key] = _convert(value, defs, status=status)
        elif key == "additionalProperties":
            continue  # `false` is implied by a structural schema's pruning; `true` becomes preserve-unknown
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "default" and status:
            continue  # status is written by the operator whole; defaults there would only hide missing writes
        else:
            out[key] = value
    if out.get("type") == "object" and node.get("additionalProperties") is True and "properties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    if out.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("type", "object")
    if "description" in out:
        out["description"] = " ".join(out["description"].split())
    return out


_ORDER = ("description", "type", "format", "enum", "default")


def _ordered(node: Any) -> Any:
    """Readable key order: description and type first, then the rest as generated."""
    if isinstance(node, list):
        return [_ordered(v) for v in node]
    if not isinstance(node, dict):
        return node
    keys = [k for k in _ORDER if k in node] + [k for k in node if k not in _ORDER]
    return {k: (_ordered(node[k]) if k not in ("default", "enum") else node[k]) for k in keys}


class _Dumper(yaml.SafeDumper):  # type: ignore[misc]  # PyYAML ships no types
    def ignore_aliases(self, data: Any) -> bool:
        return True  # shared sub-schemas are written out in full, not as YAML anchors


def openapi_schema(model: type[BaseModel], *, status: bool = False) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of one pydantic model, ready to sit in a CRD."""
    raw = model.model_json_schema(by_alias=True, schema_generator=_Schema)
    return _ordered(_convert(raw, raw.get("$defs", {}), status=status))  # type: ignore[no-any-return]


def _definition(kind: str, plural: str, short_name: str, description: str, spec: type[BaseModel],
                status: type[BaseModel], name_rule: dict[str, str], version: dict[str, Any]) -> dict[str, Any]:
    """A namespaced CustomResourceDefinition of our group with one version (`version`: its subresources and
    printer columns). A spec whose every field has a default may be left out: it defaults to {} and its fields
    to theirs."""
    optional = not spec.model_json_schema().get("required")
    schema: dict[str, Any] = {
        "type": "object",
        "description": description,
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"},
            "spec": _ordered({**openapi_schema(spec), "default": {}}) if optional else openapi_schema(spec),
            "status": openapi_schema(status, status=True),
        },
        "x-kubernetes-validations": [name_rule],
    }
    if optional:
        del schema["required"]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}", "labels": {"app.kubernetes.io/part-of": "kvfleet"}},
        "spec": {
            "group": GROUP, "scope": "Namespaced",
            "names": {"kind": kind, "listKind": f"{kind}List", "plural": plural, "singular": kind.lower(),
                      "shortNames": [short_name], "categories": ["kvfleet"]},
            "versions": [{"name": VERSION, "served": True, "storage": True,
                          "schema": {"openAPIV3Schema": schema}, **version}],
        },
    }


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition of InferenceDeployment."""
    columns = [
        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
        {"name": "Replicas", "type": "integer", "jsonPath": ".status.replicas"},
        {"name": "Desired", "type": "integer", "jsonPath": ".status.desiredReplicas"},
        {"name": "Model", "type": "string", "jsonPath": ".spec.model.name"},
        {"name": "Autoscaling", "type": "string", "jsonPath": ".spec.autoscaling.mode",
         "description": "Who sets the replicas: off (spec.replicas), external (an HPA/KEDA) or builtin"},
        # Strings with their unit: a printer column shows a field as it is (status.autoscaling documents them).
        {"name": "TTFT-P95", "type": "string", "jsonPath": ".status.autoscaling.ttftP95",
         "description": "Time to first token, p95 over spec.autoscaling.windowSeconds across ready replicas (builtin "
                        "mode; the decision uses the lower of this and the last interval's p95)"},
        {"name": "ITL-P95", "type": "string", "jsonPath": ".status.autoscaling.itlP95",
         "description": "Inter-token latency, p95 over the same window (builtin mode)"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    version = {
        "subresources": {"status": {}, "scale": {"specReplicasPath": ".spec.replicas",
                                                 "statusReplicasPath": ".status.replicas",
                                                 "labelSelectorPath": ".status.selector"}},
        "additionalPrinterColumns": columns,
    }
    return _definition(KIND, PLURAL, "infd", "A model served by an autoscaled fleet of kvfleet agents.",
                       InferenceDeploymentSpec, InferenceDeploymentStatus, NAME_RULE.cel(), version)


def router_crd() -> dict[str, Any]:
    """The CustomResourceDefinition of InferenceRouter (no scale subresource: an HPA has no signal to scale a
    router on; spec.replicas says how many)."""
    columns = [
        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
        {"name": "Replicas", "type": "integer", "jsonPath": ".status.replicas"},
        {"name": "Models", "type": "integer", "jsonPath": ".status.modelCount",
         "description": "Distinct model names served in the watched namespaces"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    return _definition(ROUTER_KIND, ROUTER_PLURAL, "ir", "One OpenAI endpoint in front of the kvfleet agents of one "
                       "or more namespaces (kvfleet-router).", InferenceRouterSpec, InferenceRouterStatus,
                       ROUTER_NAME_RULE.cel(), {"subresources": {"status": {}}, "additionalPrinterColumns": columns})


# Each generated file: its CRD and the module its schema comes from.
FILES = {CRD_FILE: (crd, "models.py"), ROUTER_CRD_FILE: (router_crd, "router_models.py")}


def render(file: str = CRD_FILE) -> str:
    """A CRD as the YAML committed under crds/ (by its file name there)."""
    build, source = FILES[file]
    header = f"# Generated from operator/kvfleet_operator/{source}; do not edit. Regenerate: {REGENERATE}\n"
    return header + str(yaml.dump(build(), Dumper=_Dumper, sort_keys=False, width=120))


# Helm installs a chart's CRDs from its crds/ folder as plain files (never templated): the same files as crds/.
CHART_CRDS = "charts/kvfleet/crds"


def main() -> int:
    """Write every CRD into the directory given as the only argument (default: crds and the Helm chart's crds,
    from the repository root)."""
    directories = [Path(sys.argv[1])] if len(sys.argv) > 1 else [Path("crds"), Path(CHART_CRDS)]
    for directory in directories:
        if not directory.is_dir():
            print(f"no directory {directory}: run from the repository root, or name the directory", file=sys.stderr)
            return 2
        for file in FILES:
            (directory / file).write_text(render(file))
            # stdout stays empty: `> file` from old habits is harmless
            print(f"wrote {directory / file}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
