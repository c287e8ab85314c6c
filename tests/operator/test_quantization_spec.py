"""spec.runtime.quantization and kvCacheDtype: the agent flags they render, the specs refused (pydantic and the CRD's
CEL rules, with the same messages) because this agent image cannot run them, and the generated CRD's fields."""

from __future__ import annotations

import argparse
import ast
import copy
import json
import re
from typing import Any

import pytest
from cr_helpers import cr
from pydantic import ValidationError

from kvfleet_operator import quantization_models as qm
from kvfleet_operator.builders import agent_args, deployment
from kvfleet_operator.config import DEFAULT_AGENT_IMAGE, OperatorConfig
from kvfleet_operator.crd import crd
from kvfleet_operator.models import InferenceDeployment, InferenceDeploymentSpec
from kvfleet_operator.plan import child_keys, make_plan
from kvfleet_operator.rules import Rule

BASE: dict[str, Any] = {"model": {"name": "m", "source": {"pvc": {"claimName": "c"}}}}
FP8_FLOAT32 = ("spec.runtime.quantization fp8 cannot run with spec.runtime.dtype float32 (FP8 weights compute in "
               "bfloat16 or float16): set dtype to bfloat16 or float16, or leave it auto")
# An image that ran only the model's dtype in its KV cache (as kvfleet's did before int8/fp8): the refusal machinery
# every Support field uses when the CRD names more than the image runs.
OLD_KV = qm.Support("kvCacheDtype", qm.KV_CACHE_DTYPES, ("auto",))


def spec(**runtime: Any) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate({**copy.deepcopy(BASE), "runtime": runtime})


def flags(s: InferenceDeploymentSpec) -> list[str]:
    """The quantization flags among the agent's arguments, in order."""
    args = agent_args(s)
    out = []
    for flag in ("--quantization", "--kv-cache-dtype"):
        if flag in args:
            out += [flag, args[args.index(flag) + 1]]
    return out


def runtime_schema() -> dict[str, Any]:
    spec_schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec_schema["properties"]["runtime"]  # type: ignore[no-any-return]


# (case, spec.runtime, the rule it breaks, the message pydantic raises and the apiserver reports).
CASES: list[tuple[str, dict[str, Any], Rule | None, str]] = [
    ("fp8 weights with dtype float32", {"quantization": "fp8", "dtype": "float32"}, qm.FP8_DTYPE_RULE, FP8_FLOAT32),
]


@pytest.mark.parametrize(("runtime", "message"), [(c[1], c[3]) for c in CASES], ids=[c[0] for c in CASES])
def test_a_spec_the_image_cannot_run_is_refused_saying_what_to_change(runtime: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as e:
        spec(**runtime)
    assert message in str(e.value)


def test_every_rule_has_a_case_and_sits_in_the_crd() -> None:
    assert set(qm.RULES) == {c[2] for c in CASES}
    validations = [v for node in (runtime_schema(), *runtime_schema()["properties"].values())
                   for v in node.get("x-kubernetes-validations", [])]
    for rule in qm.RULES:
        assert rule.cel() in validations, rule.message
        assert rule.message.startswith("spec.runtime.")  # names the field first


def _eval_message_expression(expr: str, value: str) -> str:
    """A messageExpression's value with self == value; it uses only CEL string literals, `self` and `+`."""
    terms = re.findall(r'"(?:[^"\\]|\\.)*"|self|\+|\S', expr)
    assert terms[1::2] == ["+"] * (len(terms) // 2), expr
    return "".join(value if t == "self" else json.loads(t) for t in terms[::2])  # CEL's escapes used here are JSON's


@pytest.mark.parametrize("value", qm.KV_CACHE_DTYPES)
def test_the_cel_rule_refuses_what_pydantic_refuses_with_the_same_message(value: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(qm, "KV_CACHE_DTYPE", OLD_KV)
    rule = OLD_KV.rule
    assert rule is not None and rule.message_expression is not None
    allowed = ast.literal_eval(rule.rule.removeprefix("self in "))
    assert (value in allowed) == (value == "auto")
    if value in allowed:
        assert spec(kvCacheDtype=value).runtime.kv_cache_dtype == value
        return
    with pytest.raises(ValidationError) as e:
        spec(kvCacheDtype=value)
    message = _eval_message_expression(rule.message_expression, value)
    assert message == (f"spec.runtime.kvCacheDtype '{value}' is not supported by this agent image (kvfleet agent "
                       "supports: auto); remove the field or set it to auto")
    assert message in str(e.value)
    assert value in rule.message  # the static message (if the expression fails) names every refused value


def test_what_this_image_runs_is_declared() -> None:
    assert qm.QUANTIZATIONS == ("int8", "int4", "gptq", "awq", "compressed-tensors", "fp8")
    assert qm.SUPPORTED_QUANTIZATIONS == qm.QUANTIZATIONS and qm.QUANTIZATION.rule is None  # all six: no rule
    assert qm.KV_CACHE_DTYPES == ("auto", "int8", "fp8", "fp8_e4m3")
    assert qm.SUPPORTED_KV_CACHE_DTYPES == qm.KV_CACHE_DTYPES and qm.KV_CACHE_DTYPE.rule is None


def test_the_agent_runs_at_least_what_is_declared_once_it_has_the_flags() -> None:
    from kvfleet_agent import cli

    parser = argparse.ArgumentParser()
    cli._engine_flags(parser)
    choices = {flag: a.choices for a in parser._actions for flag in a.option_strings}
    if "--quantization" not in choices:
        pytest.skip("this agent has no --quantization yet")
    for flag, support in (("--quantization", qm.QUANTIZATION), ("--kv-cache-dtype", qm.KV_CACHE_DTYPE)):
        if flag in choices and choices[flag] is not None:
            assert set(support.supported) <= set(choices[flag]) <= set(support.known), flag


@pytest.mark.parametrize("name", qm.QUANTIZATIONS)
def test_each_quantization_renders_its_flag(name: str) -> None:
    s = spec(quantization=name, dtype="bfloat16")
    assert flags(s) == ["--quantization", name]
    args = agent_args(s)
    assert args.index("--quantization") > args.index("--dtype")  # before extraArgs, which may still override it


@pytest.mark.parametrize(("runtime", "rendered"), [
    ({}, []),  # unset: the checkpoint decides, and no flag an older image would not know
    ({"kvCacheDtype": "auto"}, []),
    ({"quantization": "int8", "dtype": "float32"}, ["--quantization", "int8"]),  # on-load int8 may compute in fp32
    ({"quantization": "fp8", "dtype": "auto"}, ["--quantization", "fp8"]),
    ({"quantization": "fp8", "dtype": "float16", "kvCacheDtype": "auto"}, ["--quantization", "fp8"]),
    ({"quantization": "compressed-tensors", "dtype": "bfloat16"}, ["--quantization", "compressed-tensors"]),
])
def test_accepted_specs_and_their_flags(runtime: dict[str, Any], rendered: list[str]) -> None:
    assert flags(spec(**runtime)) == rendered


@pytest.mark.parametrize("value", ["int8", "fp8", "fp8_e4m3"])
def test_a_kv_cache_dtype_the_image_runs_is_rendered(value: str) -> None:
    assert flags(spec(quantization="awq", kvCacheDtype=value)) == ["--quantization", "awq", "--kv-cache-dtype", value]
    assert flags(spec(kvCacheDtype=value, dtype="float32")) == ["--kv-cache-dtype", value]  # any compute dtype


def test_unknown_names_are_refused_by_the_schema() -> None:
    for runtime in ({"quantization": "nf4"}, {"quantization": "FP8"}, {"quantization": "int8_w8a8"},
                    {"kvCacheDtype": "fp16"}, {"kvCacheDtype": "fp8_e5m2"}):
        with pytest.raises(ValidationError):
            spec(**runtime)


def test_setting_quantization_rolls_the_pods() -> None:
    def template(runtime: dict[str, Any]) -> Any:
        body = {"metadata": {"name": "x", "uid": "u"}, "spec": {**BASE, "runtime": runtime}}
        return deployment(InferenceDeployment.model_validate(body), DEFAULT_AGENT_IMAGE, 1)["spec"]["template"]

    assert template({}) == template({"kvCacheDtype": "auto"})  # auto says nothing new
    assert template({}) != template({"quantization": "int8"})


def test_the_crd_holds_both_fields_unset_by_default() -> None:
    runtime = runtime_schema()
    props = runtime["properties"]
    assert props["quantization"]["enum"] == list(qm.QUANTIZATIONS) and props["quantization"]["type"] == "string"
    assert props["kvCacheDtype"]["enum"] == list(qm.KV_CACHE_DTYPES) and props["kvCacheDtype"]["type"] == "string"
    for name in ("quantization", "kvCacheDtype"):
        assert "default" not in props[name] and name not in runtime["default"], name
        assert "--" in props[name]["description"], name  # names the agent flag
    for name in ("quantization", "kvCacheDtype"):
        assert "x-kubernetes-validations" not in props[name], name  # the image runs every name
    assert qm.FP8_DTYPE_RULE.cel() in runtime["x-kubernetes-validations"]


def test_an_object_the_old_crd_admitted_is_reported_invalid_with_the_message() -> None:
    body = cr({**BASE, "runtime": {"quantization": "fp8", "dtype": "float32"}})
    plan = make_plan(body, {key: None for key in child_keys("m")}, OperatorConfig(agent_image="agent:test"), None)
    assert plan.invalid is not None and plan.invalid.reason == "InvalidSpec" and plan.writes == ()
    assert FP8_FLOAT32 in plan.invalid.message
