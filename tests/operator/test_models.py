"""The pydantic models refuse what the CRD's CEL rules refuse, with the same message; defaults match the CRD's."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pydantic import ValidationError

from kvfleet_operator import rules
from kvfleet_operator.autoscaling.decide import DEFAULT_SCALE_UP
from kvfleet_operator.crd import crd
from kvfleet_operator.models import InferenceDeployment, InferenceDeploymentSpec
from kvfleet_operator.quantization_models import RULES as QUANT_RULES
from kvfleet_operator.speculative_models import RULES as SPEC_RULES

BASE: dict[str, Any] = {"model": {"name": "m", "source": {"pvc": {"claimName": "c"}}}}

# (spec patch, the rule it breaks): one mistake per rule; test_every_rule_has_a_case keeps the list complete.
CASES: list[tuple[str, dict[str, Any], rules.Rule]] = [
    ("two sources", {"model": {"name": "m", "source": {"pvc": {"claimName": "c"}, "hostPath": {"path": "/x"}}}},
     rules.SOURCE_RULE),
    ("no source", {"model": {"name": "m", "source": {}}}, rules.SOURCE_RULE),
    ("absolute sub-path", {"model": {"name": "m", "source": {"pvc": {"claimName": "c", "path": "/abs"}}}},
     rules.SUBPATH_RULE),
    ("dotdot sub-path", {"model": {"name": "m", "source": {"pvc": {"claimName": "c", "path": "a/../b"}}}},
     rules.SUBPATH_RULE),
    ("relative hostPath", {"model": {"name": "m", "source": {"hostPath": {"path": "rel"}}}}, rules.HOST_PATH_RULE),
    ("relative image path", {"model": {"name": "m", "source": {"image": {"path": "rel/m"}}}},
     rules.IMAGE_PATH_RULE),
    ("model name with space", {"model": {"name": "bad name", "source": {"pvc": {"claimName": "c"}}}},
     rules.MODEL_NAME_RULE),
    ("model name with ..", {"model": {"name": "a/../b", "source": {"pvc": {"claimName": "c"}}}},
     rules.MODEL_NAME_RULE),
    ("blockSize 24", {"runtime": {"blockSize": 24}}, rules.BLOCK_SIZE_RULE),
    ("absolute compile cache sub-path", {"runtime": {"compileCache": {"claimName": "k", "path": "/cache"}}},
     rules.COMPILE_CACHE_PATH_RULE),
    ("dotdot compile cache sub-path", {"runtime": {"compileCache": {"claimName": "k", "path": "a/../../b"}}},
     rules.COMPILE_CACHE_PATH_RULE),
    ("newline in extraArgs", {"runtime": {"extraArgs": ["--a\n--b"]}}, rules.EXTRA_ARGS_RULE),
    ("bad quantity", {"resources": {"requests": {"cpu": "lots"}}}, rules.QUANTITY_RULE),
    ("gpus not a multiple of TP", {"runtime": {"tensorParallelSize": 4}, "resources": {"gpusPerReplica": 6}},
     rules.GPU_RULE),
    ("min > max", {"autoscaling": {"minReplicas": 3}}, rules.MIN_MAX_RULE),
    ("idle window under the interval at minReplicas 0", {"autoscaling": {
        "minReplicas": 0, "intervalSeconds": 30, "scaleToZeroAfterSeconds": 20}}, rules.SCALE_TO_ZERO_RULE),
    ("builtin without a target", {"autoscaling": {"mode": "builtin", "maxReplicas": 3}}, rules.BUILTIN_TARGET_RULE),
    ("latency budget 0", {"autoscaling": {"targets": {"latency": [{"metric": "ttft", "seconds": 0}]}}},
     rules.LATENCY_SECONDS_RULE),
    ("same latency target twice", {"autoscaling": {"targets": {"latency": [
        {"metric": "ttft", "seconds": 1}, {"metric": "ttft", "percentile": 95.0, "seconds": 2}]}}},
     rules.LATENCY_UNIQUE_RULE),
    ("empty scaleUp policies", {"autoscaling": {"behavior": {"scaleUp": {"policies": []}}}},
     rules.SCALE_UP_POLICY_RULE),
    ("empty scaleDown policies", {"autoscaling": {"behavior": {"scaleDown": {"policies": []}}}},
     rules.SCALE_DOWN_POLICY_RULE),
    ("selector label override", {"pod": {"labels": {"app.kubernetes.io/managed-by": "me"}}}, rules.LABELS_RULE),
    ("hostPath /", {"model": {"name": "m", "source": {"hostPath": {"path": "/"}}}}, rules.HOST_PATH_SYSTEM_RULE),
    ("hostPath with //", {"model": {"name": "m", "source": {"hostPath": {"path": "//etc"}}}}, rules.HOST_PATH_RULE),
    ("env with value and valueFrom", {"pod": {"env": [{"name": "A", "value": "x", "valueFrom": {
        "secretKeyRef": {"name": "s", "key": "k"}}}]}}, rules.ENV_VALUE_RULE),
    ("env with neither", {"pod": {"env": [{"name": "A"}]}}, rules.ENV_VALUE_RULE),
    ("valueFrom with two sources", {"pod": {"env": [{"name": "A", "valueFrom": {
        "secretKeyRef": {"name": "s", "key": "k"}, "configMapKeyRef": {"name": "c", "key": "k"}}}]}},
     rules.ENV_SOURCE_RULE),
    ("valueFrom with none", {"pod": {"env": [{"name": "A", "valueFrom": {}}]}}, rules.ENV_SOURCE_RULE),
    ("fieldRef to spec.containers", {"pod": {"env": [{"name": "A", "valueFrom": {
        "fieldRef": {"fieldPath": "spec.containers"}}}]}}, rules.FIELD_PATH_RULE),
    ("resourceFieldRef to limits.gpu", {"pod": {"env": [{"name": "A", "valueFrom": {
        "resourceFieldRef": {"resource": "limits.nvidia.com/gpu"}}}]}}, rules.RESOURCE_FIELD_RULE),
    ("resourceFieldRef divisor", {"pod": {"env": [{"name": "A", "valueFrom": {
        "resourceFieldRef": {"resource": "limits.memory", "divisor": "one MiB"}}}]}}, rules.RESOURCE_FIELD_RULE),
    ("API key as a pod env", {"pod": {"env": [{"name": "KVFLEET_API_KEY", "value": "s3cret"}]}},
     rules.ENV_API_KEY_RULE),
    ("API key in extraArgs", {"runtime": {"extraArgs": ["--api-key=s3cret"]}}, rules.EXTRA_ARGS_API_KEY_RULE),
    ("peer mixing ipBlock and a selector", {"networkPolicy": {"from": [
        {"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]}}, rules.PEER_RULE),
    ("empty peer", {"networkPolicy": {"from": [{}]}}, rules.PEER_RULE),
    ("In without values", {"networkPolicy": {"from": [{"namespaceSelector": {"matchExpressions": [
        {"key": "team", "operator": "In"}]}}]}}, rules.SELECTOR_RULE),
]

# Refused: the node's root, system directories and what lies under them, and non-canonical spellings of them.
SYSTEM_HOST_PATHS = ["/", "/etc", "/etc/", "/etc/kubernetes/pki", "/proc/1/root", "/sys", "/dev/nvidia0", "/boot",
                     "/root/.ssh", "/run/containerd/containerd.sock", "/var/run/docker.sock", "/usr", "/usr/local/m",
                     "/bin", "/sbin", "/lib/modules", "/lib64", "/var/lib/kubelet/pods", "/var/lib/containerd",
                     "/var/lib/docker/volumes", "/var/lib/etcd", "/var/log/pods", "/var", "/var/", "/var/lib",
                     "/var/lib/", "/home", "/home/"]
NON_CANONICAL_HOST_PATHS = ["//etc", "/./etc", "/etc/.", "/data/../etc", "/data//m", "relative/m", "/data/m//"]
# Accepted: directories of their own, including names that merely start like a system directory.
MODEL_HOST_PATHS = ["/data/models/llama", "/var/lib/kvfleet/models/tiny-llama", "/home/ml/models", "/mnt/nvme/m",
                    "/opt/models/", "/etcetera", "/dev-models/m", "/var/lib/kubelet-models", "/srv/x..y/m", "/tmp/m"]


@pytest.mark.parametrize("path", SYSTEM_HOST_PATHS)
def test_host_path_refuses_system_directories(path: str) -> None:
    with pytest.raises(ValidationError) as e:
        spec({"model": {"name": "m", "source": {"hostPath": {"path": path}}}})
    assert rules.HOST_PATH_SYSTEM_RULE.message in str(e.value)
    assert "spec.model.source.hostPath.path" in rules.HOST_PATH_SYSTEM_RULE.message  # names the field and the fix
    assert "e.g. /data/models/llama-3-8b" in rules.HOST_PATH_SYSTEM_RULE.message


@pytest.mark.parametrize("path", NON_CANONICAL_HOST_PATHS)
def test_host_path_must_be_written_plainly(path: str) -> None:
    with pytest.raises(ValidationError) as e:
        spec({"model": {"name": "m", "source": {"hostPath": {"path": path}}}})
    assert rules.HOST_PATH_RULE.message in str(e.value)


@pytest.mark.parametrize("path", MODEL_HOST_PATHS)
def test_host_path_accepts_model_directories(path: str) -> None:
    source = spec({"model": {"name": "m", "source": {"hostPath": {"path": path}}}}).model.source.host_path
    assert source is not None and source.path == path


def test_env_value_from_every_source_round_trips() -> None:
    env = [{"name": "S", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k", "optional": False}}},
           {"name": "C", "valueFrom": {"configMapKeyRef": {"name": "c.d", "key": "a_b-c.d"}}},
           {"name": "F", "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['x/y']"}}},
           {"name": "R", "valueFrom": {"resourceFieldRef": {"resource": "requests.hugepages-2Mi", "divisor": 1}}},
           {"name": "E", "value": ""}]
    s = spec({"pod": {"env": env}})
    assert [e.manifest() for e in s.pod.env] == [
        *env[:3], {"name": "R", "valueFrom": {"resourceFieldRef": {"resource": "requests.hugepages-2Mi",
                                                                   "divisor": "1"}}}, env[4]]
    for bad_ref in ({"name": "Bad_Name", "key": "k"}, {"name": "s", "key": "a/b"}, {"name": "s"}):
        with pytest.raises(ValidationError):
            spec({"pod": {"env": [{"name": "A", "valueFrom": {"secretKeyRef": bad_ref}}]}})


def test_api_key_secret_ref_is_a_name_and_a_key() -> None:
    ref = spec({"auth": {"apiKeySecretRef": {"name": "llama-key", "key": "api-key"}}}).auth.api_key_secret_ref
    assert ref is not None and (ref.name, ref.key) == ("llama-key", "api-key")
    assert spec({}).auth.api_key_secret_ref is None
    for bad in ({"name": "k"}, {"name": "k", "key": "api-key", "optional": True}, {"secretName": "k", "key": "x"}):
        with pytest.raises(ValidationError):
            spec({"auth": {"apiKeySecretRef": bad}})  # optional would silently serve an open API
    assert spec({"runtime": {"extraArgs": ["--api-key-file-is-not-a-flag"]}})  # only --api-key itself is refused


def spec(patch: dict[str, Any]) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate({**copy.deepcopy(BASE), **patch})


@pytest.mark.parametrize(("patch", "rule"), [(p, r) for _, p, r in CASES], ids=[c[0] for c in CASES])
def test_rule_rejects_with_its_message(patch: dict[str, Any], rule: rules.Rule) -> None:
    with pytest.raises(ValidationError) as e:
        spec(patch)
    assert rule.message in str(e.value)


def test_every_rule_has_a_case_and_sits_in_the_crd() -> None:
    all_rules = {v for v in vars(rules).values() if isinstance(v, rules.Rule)}
    assert all_rules - {r for _, _, r in CASES} == {rules.NAME_RULE}  # metadata.name: test_metadata_name
    in_crd: list[dict[str, str]] = []

    def collect(node: Any) -> None:
        if isinstance(node, dict):
            in_crd.extend(node.get("x-kubernetes-validations", []))
            for v in node.values():
                collect(v)
        elif isinstance(node, list):
            for v in node:
                collect(v)

    collect(crd())
    # spec.runtime.speculativeConfig's rules have their cases in test_speculative_models.py, quantization's and
    # kvCacheDtype's in test_quantization_spec.py.
    def key(v: dict[str, str]) -> tuple[tuple[str, str], ...]:
        return tuple(sorted(v.items()))

    assert {key(v) for v in in_crd} == {key(r.cel()) for r in all_rules | set(SPEC_RULES) | set(QUANT_RULES)}


def test_metadata_name_must_be_a_dns_label() -> None:
    for bad in ("Upper", "has.dot", "-lead", "x" * 64):
        with pytest.raises(ValidationError, match="DNS-1035"):
            InferenceDeployment.model_validate({"metadata": {"name": bad}, "spec": BASE})
    assert InferenceDeployment.model_validate({"metadata": {"name": "ok-1"}, "spec": BASE}).metadata.name == "ok-1"


def test_accepts_the_edges_the_rules_allow() -> None:
    s = spec({"runtime": {"tensorParallelSize": 4, "blockSize": 256}, "resources": {"gpusPerReplica": 8}})
    assert s.gpus_per_replica == 8
    assert spec({"runtime": {"tensorParallelSize": 2}}).gpus_per_replica == 2  # default: one GPU per shard
    assert spec({"resources": {"gpusPerReplica": 0}}).gpus_per_replica == 0  # CPU
    assert spec({"resources": {"requests": {"cpu": 2, "memory": "1.5Gi"}}}).resources.requests is not None
    assert spec({"model": {"name": "org/model:v1.2", "source": {"pvc": {"claimName": "c", "path": "a/b"}}}})
    assert spec({"autoscaling": {"mode": "builtin", "targets": {"queueDepthPerReplica": 0.5}}})
    assert spec({"autoscaling": {"behavior": {"scaleUp": {"policies": [], "selectPolicy": "Disabled"}}}})


def test_schema_ranges_refuse_out_of_range_values() -> None:
    for patch in ({"runtime": {"tensorParallelSize": 16}}, {"runtime": {"gpuMemoryUtilization": 0}},
                  {"runtime": {"dtype": "int8"}}, {"autoscaling": {"intervalSeconds": 1}},
                  {"autoscaling": {"targets": {"latency": [{"metric": "ttft", "percentile": 100, "seconds": 1}]}}},
                  {"autoscaling": {"mode": "sometimes"}}, {"unknownField": 1}):
        with pytest.raises(ValidationError):
            spec(patch)


def test_defaults_match_the_crd_defaults() -> None:
    s = spec({})
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert schema["runtime"]["default"] == {k: v for k, v in s.runtime.model_dump(by_alias=True, exclude_none=True)
                                            .items() if v != []}
    up = schema["autoscaling"]["properties"]["behavior"]["properties"]["scaleUp"]["properties"]["policies"]
    # The CRD ships the defaults the autoscaler was tuned with (bench/autoscale).
    assert up["default"] == [{"type": p.type, "value": p.value, "periodSeconds": p.period_seconds}
                             for p in DEFAULT_SCALE_UP.policies]
    assert (s.runtime.block_size, s.runtime.max_num_seqs, s.autoscaling.mode, s.replicas) == (16, 128, "off", 1)
    assert s.autoscaling.behavior.scale_down.stabilization_window_seconds == 300


def test_round_trip_through_camel_case() -> None:
    s = spec({"runtime": {"tensorParallelSize": 2, "extraArgs": ["--x"]}, "pod": {"nodeSelector": {"a": "b"}}})
    dumped = s.model_dump(by_alias=True, exclude_none=True)
    assert dumped["runtime"]["tensorParallelSize"] == 2 and dumped["pod"]["nodeSelector"] == {"a": "b"}
    assert InferenceDeploymentSpec.model_validate(dumped) == s
