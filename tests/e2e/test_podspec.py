"""How the process kubelet turns a pod spec into a local process (e2e/podspec.py): pure, no cluster."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e"))
from pki import _Pki
from podspec import (
    KWOK_LOCAL_EXCLUSION,
    configmap_names,
    env_object_names,
    expand,
    kubeconfig,
    needs_credentials,
    process_spec,
    runs_locally,
)

IP, HOST_IP = "10.250.128.7", "10.249.0.1"


def pod(container: dict[str, Any], **spec: Any) -> dict[str, Any]:
    base = {"name": "agent", "image": "x", "command": ["kvfleet-agent"], "args": ["serve"]}
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "u-1"},
            "spec": {"containers": [{**base, **container}], **spec}}


def translate(p: dict[str, Any], tmp_path: Path, **kw: Any) -> Any:
    return process_spec(p, IP, HOST_IP, tmp_path / "pod", tmp_path, {"PATH": "/venv/bin"}, **kw)


def test_only_the_agent_and_router_commands_themselves_are_run() -> None:
    assert runs_locally(pod({})) and runs_locally(pod({"command": ["kvfleet-router"]}))
    assert not runs_locally(pod({"command": ["/usr/bin/kvfleet-agent"]}))  # no host binaries by path
    assert not runs_locally(pod({"command": ["python", "-m", "kvfleet_agent"]}))
    assert not runs_locally(pod({"command": ["kvfleet-operator"]}))
    assert not runs_locally({"spec": {"containers": [{"name": "c", "image": "x"}]}})
    assert KWOK_LOCAL_EXCLUSION["values"] == ["kvfleet-agent", "kvfleet-router"]  # kwok skips exactly these


def test_var_expansion_follows_kubernetes() -> None:
    env = {"A": "1"}
    assert expand("$(A)-$(B)-$$(A)", env) == "1-$(B)-$(A)"


def test_agents_bind_their_pod_ip_and_mount_paths_are_rewritten(tmp_path: Path) -> None:
    model = tmp_path / "models" / "tiny"
    p = pod({"args": ["serve", "--model", "/models/tiny", "--host", "0.0.0.0", "--config=/etc/kv/c.yaml",
                      "@/etc/kv/extra-args", "--cache", "/data/x"],
             "env": [{"name": "KVFLEET_HOST", "value": "0.0.0.0"}, {"name": "PATH", "value": "/evil"},
                     {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
             "volumeMounts": [{"name": "m", "mountPath": "/models/tiny"}, {"name": "cfg", "mountPath": "/etc/kv"},
                              {"name": "claim", "mountPath": "/data", "subPath": "sub"}]},
            volumes=[{"name": "m", "hostPath": {"path": str(model)}}, {"name": "cfg", "configMap": {"name": "c"}},
                     {"name": "claim", "persistentVolumeClaim": {"claimName": "models"}}])
    spec = translate(p, tmp_path, configmaps={"c": {"extra-args": "--seed\n1\n"}})
    cfg = tmp_path / "pod" / "volumes" / "cfg"
    assert spec.argv == ["kvfleet-agent", "serve", "--model", str(model), "--host", IP, f"--config={cfg}/c.yaml",
                         f"@{cfg}/extra-args", "--cache", str(tmp_path / "pvc" / "ns" / "models" / "sub" / "x")]
    assert spec.env["KVFLEET_HOST"] == IP and spec.env["PATH"] == "/venv/bin" and spec.env["NAME"] == "p"
    assert spec.files == {cfg / "extra-args": "--seed\n1\n"}


def test_probe_periods_are_capped_but_keep_their_failure_budget(tmp_path: Path) -> None:
    p = pod({"ports": [{"name": "http", "containerPort": 8000}],
             "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10,
                               "failureThreshold": 6},
             "startupProbe": {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 10,
                              "failureThreshold": 360}},
            restartPolicy="OnFailure", terminationGracePeriodSeconds=45)
    spec = translate(p, tmp_path, max_period=1.0)
    assert spec.liveness is not None and spec.startup is not None
    assert (spec.liveness.port, spec.liveness.period, spec.liveness.failure_threshold) == (8000, 1.0, 60)
    assert spec.startup.failure_threshold == 3600  # 3600 s to start, as the pod asked
    assert spec.readiness is None and spec.restart_policy == "OnFailure" and spec.grace_seconds == 45


@pytest.mark.parametrize("probe", [{"exec": {"command": ["true"]}}, {"tcpSocket": {"port": 8000}},
                                   {"httpGet": {"path": "/", "port": "nope"}},
                                   {"httpGet": {"path": "/", "port": 1, "scheme": "HTTPS"}}])
def test_unsupported_probes_are_refused_not_ignored(tmp_path: Path, probe: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="readinessProbe"):
        translate(pod({"readinessProbe": probe}), tmp_path)


def test_env_reads_secrets_and_config_maps_by_key(tmp_path: Path) -> None:
    def ref(kind: str, name: str, key: str, **extra: Any) -> dict[str, Any]:
        return {kind: {"name": name, "key": key, **extra}}

    p = pod({"env": [{"name": "KVFLEET_API_KEY", "valueFrom": ref("secretKeyRef", "auth", "api-key")},
                     {"name": "LEVEL", "valueFrom": ref("configMapKeyRef", "settings", "level")},
                     {"name": "GONE", "valueFrom": ref("secretKeyRef", "absent", "k", optional=True)},
                     {"name": "NOKEY", "valueFrom": ref("configMapKeyRef", "settings", "nope", optional=True)},
                     {"name": "ECHO", "value": "$(LEVEL)"}]})
    spec = translate(p, tmp_path, configmaps={"settings": {"level": "DEBUG"}}, secrets={"auth": {"api-key": "k1"}})
    assert (spec.env["KVFLEET_API_KEY"], spec.env["LEVEL"], spec.env["ECHO"]) == ("k1", "DEBUG", "DEBUG")
    assert "GONE" not in spec.env and "NOKEY" not in spec.env  # optional and missing: left out
    # A required reference that cannot be resolved keeps the pod from starting (retried, as CreateContainerConfigError).
    with pytest.raises(ValueError, match="secret 'auth' not found"):
        translate(p, tmp_path, configmaps={"settings": {"level": "DEBUG"}})
    with pytest.raises(ValueError, match="configmap 'settings' has no key 'level'"):
        translate(p, tmp_path, configmaps={"settings": {}}, secrets={"auth": {"api-key": "k1"}})
    resource = pod({"env": [{"name": "M", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory"}}}]})
    with pytest.raises(ValueError, match="not supported by the process kubelet"):
        translate(resource, tmp_path)


def test_env_object_names_are_fetched_before_start() -> None:
    p = pod({"env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
                     {"name": "B", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}},
                     {"name": "C", "value": "x"}]}, volumes=[{"name": "v", "configMap": {"name": "vol"}}])
    assert env_object_names(p) == {"configmaps": {"c"}, "secrets": {"s"}}
    assert configmap_names(p) == {"vol"}  # volumes must exist; env references may be optional


def test_a_router_pod_gets_a_kubeconfig_and_its_identity_but_an_agent_does_not(tmp_path: Path) -> None:
    router = pod({"command": ["kvfleet-router"], "args": ["--kubernetes", "--host", "0.0.0.0", "--port", "8080"],
                  "env": [{"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]},
                 serviceAccountName="front")
    spec = translate(router, tmp_path)
    credentials = tmp_path / "pod" / "serviceaccount"
    assert spec.credentials == credentials and credentials in spec.dirs
    assert (spec.env["KUBECONFIG"], spec.env["POD_NAMESPACE"], spec.env["POD_NAME"]) == (
        str(credentials / "kubeconfig"), "ns", "p")
    assert spec.argv[-3:] == [IP, "--port", "8080"]  # 0.0.0.0 is the pod's own IP here
    assert needs_credentials(router) and not needs_credentials(pod({}))
    agent = translate(pod({}), tmp_path)
    assert agent.credentials is None and "KUBECONFIG" not in agent.env
    opted_out = pod({"command": ["kvfleet-router"]}, automountServiceAccountToken=False)
    assert not needs_credentials(opted_out) and translate(opted_out, tmp_path).credentials is None


def test_the_kubeconfig_is_read_by_the_router_as_written(tmp_path: Path) -> None:
    from kvfleet_router.kube import from_kubeconfig  # the router's own loader: the contract this file meets

    pki = _Pki(tmp_path / "pki")
    pki.make_ca()
    (tmp_path / "token").write_text("t0k3n")
    (tmp_path / "kubeconfig").write_text(kubeconfig("https://127.0.0.1:6443", pki.ca_crt.read_bytes(), "ns", "token"))
    config = from_kubeconfig([tmp_path / "kubeconfig"], must_exist=True)
    assert config.server == "https://127.0.0.1:6443" and config.token is None
    assert config.token_file == tmp_path / "token"  # re-read by the router: the kubelet renews it in place
