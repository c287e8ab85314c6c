"""Golden tests of the pure builders: tests/operator/golden/*.input.yaml (a CR) → *.expected.yaml (the plan).

Regenerate the expected files after an intended change, then review the diff:
    KVFLEET_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/operator/test_builders.py
"""

from __future__ import annotations

import argparse
import difflib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet_operator.builders import (
    COMPILE_CACHE_DIR,
    CONFIG_HASH_ANNOTATION,
    agent_args,
    deployment,
    plan,
    replicas_for,
    selector_string,
)
from kvfleet_operator.config import DEFAULT_AGENT_IMAGE
from kvfleet_operator.models import InferenceDeployment, InferenceDeploymentSpec

GOLDEN = Path(__file__).parent / "golden"
INPUTS = sorted(GOLDEN.glob("*.input.yaml"))
UPDATE = os.environ.get("KVFLEET_UPDATE_GOLDEN") == "1"


def load(name: str) -> InferenceDeployment:
    return InferenceDeployment.model_validate(yaml.safe_load((GOLDEN / name).read_text()))


def render(cr: InferenceDeployment) -> str:
    p = plan(cr, DEFAULT_AGENT_IMAGE, replicas_for(cr.spec, None))
    doc = {"apply": p.apply, "delete": [f"{api}/{kind} {name}" for api, kind, name in p.delete]}
    return yaml.safe_dump(doc, sort_keys=False, width=120)


@pytest.mark.parametrize("path", INPUTS, ids=[p.name.removesuffix(".input.yaml") for p in INPUTS])
def test_golden(path: Path) -> None:
    expected_path = path.with_name(path.name.replace(".input.yaml", ".expected.yaml"))
    got = render(InferenceDeployment.model_validate(yaml.safe_load(path.read_text())))
    if UPDATE:
        expected_path.write_text(got)
    assert expected_path.exists(), f"missing {expected_path.name}: run with KVFLEET_UPDATE_GOLDEN=1"
    want = expected_path.read_text()
    if got != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True), "expected", "got"))
        pytest.fail(f"{path.name} renders differently (KVFLEET_UPDATE_GOLDEN=1 to accept):\n{diff}")


def test_golden_inputs_cover_every_source_and_override() -> None:
    specs = [load(p.name).spec for p in INPUTS]
    assert {s.model.source.pvc is not None for s in specs} == {True, False}
    assert any(s.model.source.host_path for s in specs) and any(s.model.source.image for s in specs)
    assert any(s.runtime.tensor_parallel_size == 4 for s in specs)
    assert {s.autoscaling.mode for s in specs} == {"off", "external", "builtin"}
    full = next(s for s in specs if s.pod.affinity)
    for key in ("node_selector", "tolerations", "env", "annotations", "labels", "priority_class_name",
                "service_account_name"):
        assert getattr(full.pod, key), key
    assert full.resources.requests and full.resources.limits and full.runtime.extra_args
    assert any(s.auth.api_key_secret_ref for s in specs) and not all(s.network_policy.enabled for s in specs)
    sources = {k for s in specs for e in s.pod.env if e.value_from
               for k, v in e.value_from.model_dump(exclude_none=True).items() if v}
    assert sources == {"secret_key_ref", "config_map_key_ref", "field_ref", "resource_field_ref"}
    assert any(s.network_policy.from_ for s in specs)
    assert any(s.runtime.compile_cache for s in specs) and {s.runtime.metrics_compat for s in specs} == {"kvfleet",
                                                                                                           "vllm"}


def _deployment(spec: dict[str, Any], replicas: int = 1) -> dict[str, Any]:
    cr = InferenceDeployment.model_validate({"metadata": {"name": "x", "uid": "u"}, "spec": spec})
    return deployment(cr, DEFAULT_AGENT_IMAGE, replicas)


def _hash(d: dict[str, Any]) -> str:
    return str(d["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION])


BASE = {"model": {"name": "m", "source": {"pvc": {"claimName": "c"}}}}


def test_config_hash_follows_the_pod_not_the_replicas() -> None:
    base = _hash(_deployment(BASE))
    assert _hash(_deployment(BASE, replicas=5)) == base
    assert _hash(_deployment({**BASE, "replicas": 7})) == base
    assert _hash(_deployment({**BASE, "autoscaling": {"maxReplicas": 9}})) == base
    assert _hash(_deployment({**BASE, "networkPolicy": {"enabled": False}})) == base  # not a pod's concern
    for change in ({"runtime": {"maxNumSeqs": 64}}, {"runtime": {"extraArgs": ["--seed", "3"]}},
                   {"image": "other:1"}, {"pod": {"env": [{"name": "A", "value": "b"}]}},
                   {"pod": {"env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "b"}}}]}},
                   {"resources": {"requests": {"memory": "1Gi"}}}):
        assert _hash(_deployment({**BASE, **change})) != base, change


def _api_key(name: str, key: str) -> dict[str, Any]:
    return {**BASE, "auth": {"apiKeySecretRef": {"name": name, "key": key}}}


def test_the_api_key_is_a_secret_reference_and_changing_it_rolls_the_pods() -> None:
    d = _deployment(_api_key("llama-key", "api-key"))
    [c] = d["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["KVFLEET_API_KEY"] == {"name": "KVFLEET_API_KEY",
                                      "valueFrom": {"secretKeyRef": {"name": "llama-key", "key": "api-key"}}}
    # The probes hit the endpoints the agent keeps open, so they need no key.
    assert {c[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")} == {
        "/health", "/ready"}
    hashes = {_hash(_deployment(spec)) for spec in (BASE, _api_key("llama-key", "api-key"),
                                                    _api_key("llama-key", "rotated"), _api_key("other", "api-key"))}
    assert len(hashes) == 4


def test_pod_env_overrides_keep_their_place_and_value_from() -> None:
    pod_ip = {"fieldRef": {"fieldPath": "status.podIP"}}
    env_in = [{"name": "A", "valueFrom": pod_ip}, {"name": "KVFLEET_HOST", "valueFrom": pod_ip}]
    d = _deployment({**BASE, "auth": {"apiKeySecretRef": {"name": "k", "key": "v"}}, "pod": {"env": env_in}})
    env = d["spec"]["template"]["spec"]["containers"][0]["env"]
    assert [e["name"] for e in env] == ["KVFLEET_HOST", "KVFLEET_API_KEY", "A"]
    assert env[0] == {"name": "KVFLEET_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def test_the_agent_reads_its_api_key_from_the_variable_the_pod_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfleet_agent import cli, cli_serve

    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(cli_serve, "run_serve", lambda a, options: seen.append(a) or 0)
    monkeypatch.setenv("KVFLEET_API_KEY", "s3cret")
    env = _deployment(_api_key("k", "v"))["spec"]["template"]["spec"]["containers"][0]["env"]
    assert "KVFLEET_API_KEY" in {e["name"] for e in env}
    assert cli.main(agent_args(InferenceDeploymentSpec.model_validate(BASE))) == 0
    assert seen[0].api_key == "s3cret"


def test_config_hash_covers_the_args_file() -> None:
    def long_args(ch: str) -> dict[str, Any]:
        return {**BASE, "runtime": {"extraArgs": ["--note", ch * 1000] * 5}}

    a, b = _deployment(long_args("a")), _deployment(long_args("b"))
    assert a["spec"]["template"]["spec"]["containers"][0]["args"] == b["spec"]["template"]["spec"]["containers"][0][
        "args"]  # same pod spec: only the ConfigMap differs
    assert _hash(a) != _hash(b)


def test_replicas_ownership_by_mode() -> None:
    off = InferenceDeploymentSpec.model_validate({**BASE, "replicas": 3})
    assert replicas_for(off, None) == 3 and replicas_for(off, 9) == 3  # spec.replicas wins, even over a hand edit
    external = InferenceDeploymentSpec.model_validate({**BASE, "replicas": 4, "autoscaling": {"mode": "external"}})
    assert replicas_for(external, 1) == 4
    builtin = InferenceDeploymentSpec.model_validate(
        {**BASE, "replicas": 9, "autoscaling": {"mode": "builtin", "minReplicas": 2, "maxReplicas": 6,
                                                "targets": {"queueDepthPerReplica": 4}}})
    assert replicas_for(builtin, None) == 2  # created at minReplicas
    assert replicas_for(builtin, 5) == 5  # the autoscaler's number is kept
    assert replicas_for(builtin, 1) == 2 and replicas_for(builtin, 10) == 6  # clamped to an edited range


def test_agent_args_are_parsed_by_the_real_agent_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfleet_agent import cli, cli_serve

    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(cli_serve, "run_serve", lambda a, options: seen.append(a) or 0)
    spec = InferenceDeploymentSpec.model_validate(
        {**BASE, "runtime": {"maxModelLen": 4096, "maxNumBatchedTokens": 2048, "enablePrefixCaching": False,
                             "enableChunkedPrefill": False, "extraArgs": ["--seed", "5"]}})
    args = agent_args(spec)
    assert args[:2] == ["serve", "--model"] and "--host" not in args  # the host comes from KVFLEET_HOST
    assert cli.main(args) == 0
    ns = seen[0]
    assert (ns.model, ns.served_model_name, ns.port, ns.grpc_port) == ("/models/m", "m", 8000, 50051)
    assert (ns.max_model_len, ns.max_num_batched_tokens, ns.seed) == (4096, 2048, 5)
    assert ns.enable_prefix_caching is False and ns.enable_chunked_prefill is False
    assert ns.dtype == "auto" and ns.block_size == 16 and ns.gpu_memory_utilization == 0.9
    assert (ns.max_queue_length, ns.drain_grace_period, ns.tensor_parallel_size) == (256, 30.0, 1)
    assert ns.metrics_compat == "kvfleet"


def test_selector_string_matches_the_deployment_selector() -> None:
    d = _deployment(BASE)
    labels = d["spec"]["selector"]["matchLabels"]
    assert selector_string("x") == ",".join(f"{k}={v}" for k, v in labels.items())
    assert labels.items() <= d["spec"]["template"]["metadata"]["labels"].items()


def test_a_compile_cache_claim_is_where_triton_and_inductor_keep_their_kernels() -> None:
    d = _deployment({**BASE, "runtime": {"compileCache": {"claimName": "kernels", "path": "team-a"}}})
    pod = d["spec"]["template"]["spec"]
    agent = pod["containers"][0]
    assert {"name": "compile-cache", "persistentVolumeClaim": {"claimName": "kernels"}} in pod["volumes"]
    mount = next(m for m in agent["volumeMounts"] if m["name"] == "compile-cache")
    assert mount == {"name": "compile-cache", "mountPath": COMPILE_CACHE_DIR, "subPath": "team-a"}  # read-write
    env = {e["name"]: e["value"] for e in agent["env"] if "value" in e}
    # The libraries themselves, in a fresh process with the pod's variables, resolve their caches there.
    probe = ("from triton import knobs; from torch._inductor.runtime.cache_dir_utils import cache_dir; "
             "print(knobs.cache.dir); print(cache_dir())")
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == [f"{COMPILE_CACHE_DIR}/triton", f"{COMPILE_CACHE_DIR}/inductor"]
    without = _deployment(BASE)["spec"]["template"]["spec"]
    assert not any(v["name"] == "compile-cache" for v in without["volumes"])
    assert not {"TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"} & {e["name"] for e in without["containers"][0]["env"]}
    assert _hash(d) != _hash(_deployment(BASE))  # adding (or moving) the cache rolls the pods


def test_metrics_compat_reaches_the_agent_as_its_flag() -> None:
    for value in ("kvfleet", "vllm"):
        args = _deployment({**BASE, "runtime": {"metricsCompat": value}})["spec"]["template"]["spec"][
            "containers"][0]["args"]
        assert args[args.index("--metrics-compat") + 1] == value
