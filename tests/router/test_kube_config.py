"""The router's Kubernetes credentials: kubeconfig files (tokens, client certificates, CAs, merged lists) and the
in-cluster service account, from files the tests write; and the CLI flags that choose them."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvfleet_router import cli
from kvfleet_router.kube import SA_DIR, KubeClient, KubeConfigError, load_config, own_namespace


def _self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    """A P-256 key and a self-signed certificate for CN=name, made by the openssl CLI."""
    key, crt = directory / f"{name}.key", directory / f"{name}.crt"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-keyout", str(key), "-out", str(crt), "-subj", f"/CN={name}", "-days", "1"],
                   check=True, capture_output=True)
    return key, crt


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Key and certificate pairs: a cluster CA, a client, and another client (for a mismatched pair)."""
    d = tmp_path_factory.mktemp("pki")
    return {name: _self_signed(d, name) for name in ("cluster-ca", "client", "other")}


def b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def kubeconfig(path: Path, user: dict[str, Any], cluster: dict[str, Any] | None = None,
               current: str = "ctx", **extra: Any) -> Path:
    """Write a one-context kubeconfig (JSON is YAML)."""
    doc = {"apiVersion": "v1", "kind": "Config", "current-context": current,
           "clusters": [{"name": "c", "cluster": cluster or {"server": "https://10.0.0.1:6443"}}],
           "users": [{"name": "u", "user": user}],
           "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}], **extra}
    path.write_text(json.dumps(doc))
    return path


def ca_subjects(config_ssl: Any) -> list[str]:
    return [dict(x[0] for x in cert["subject"])["commonName"] for cert in config_ssl.get_ca_certs()]


def test_a_token_user_with_a_ca_file_relative_to_the_kubeconfig(tmp_path: Path,
                                                               pki: dict[str, tuple[Path, Path]]) -> None:
    (tmp_path / "certs").mkdir()
    (tmp_path / "certs" / "ca.crt").write_bytes(pki["cluster-ca"][1].read_bytes())
    path = kubeconfig(tmp_path / "config", {"token": "s3cret"},
                      {"server": "https://api.example:6443/", "certificate-authority": "certs/ca.crt"})
    config = load_config(str(path), {})
    assert config.server == "https://api.example:6443" and config.token == "s3cret" and config.token_file is None
    assert ca_subjects(config.ssl) == ["cluster-ca"]  # the named CA only, not the system's
    assert config.source == str(path)


def test_client_certificate_data_and_ca_data(tmp_path: Path, pki: dict[str, tuple[Path, Path]]) -> None:
    key, crt = pki["client"]
    path = kubeconfig(tmp_path / "config", {"client-certificate-data": b64(crt), "client-key-data": b64(key)},
                      {"server": "https://127.0.0.1:6443", "certificate-authority-data": b64(pki["cluster-ca"][1])})
    config = load_config(str(path), {})
    assert config.token is None and ca_subjects(config.ssl) == ["cluster-ca"]


def test_client_certificate_files_are_relative_to_the_kubeconfig(tmp_path: Path,
                                                                pki: dict[str, tuple[Path, Path]]) -> None:
    key, crt = pki["client"]
    (tmp_path / "client.crt").write_bytes(crt.read_bytes())
    (tmp_path / "client.key").write_bytes(key.read_bytes())
    load_config(str(kubeconfig(tmp_path / "config", {"client-certificate": "client.crt",
                                                      "client-key": "client.key"})), {})


@pytest.mark.parametrize(("user", "says"), [
    ({"exec": {"command": "aws"}}, "authenticates with exec"),
    ({"auth-provider": {"name": "gcp"}}, "authenticates with auth-provider"),
    ({"username": "admin", "password": "x"}, "authenticates with username"),
    ({"client-certificate-data": "bm90IGEgY2VydA=="}, "needs both its certificate and its key"),
    ({"client-key-data": "%%%"}, "client-key-data is not base64"),
])
def test_unusable_users_are_refused_by_name(tmp_path: Path, user: dict[str, Any], says: str) -> None:
    with pytest.raises(KubeConfigError, match=says) as info:
        load_config(str(kubeconfig(tmp_path / "config", user)), {})
    assert "user 'u'" in str(info.value)


def test_a_key_that_is_not_the_certificates_is_refused(tmp_path: Path, pki: dict[str, tuple[Path, Path]]) -> None:
    path = kubeconfig(tmp_path / "config", {"client-certificate-data": b64(pki["client"][1]),
                                            "client-key-data": b64(pki["other"][0])})
    with pytest.raises(KubeConfigError, match="user 'u'"):
        load_config(str(path), {})


@pytest.mark.parametrize(("doc", "says"), [
    ({"current-context": "nope"}, "current-context 'nope' is not among the contexts"),
    ({"clusters": [{"name": "c", "cluster": {"server": "api.example:6443"}}]}, "has no https:// server"),
    ({"contexts": [{"name": "ctx", "context": {"cluster": "elsewhere", "user": "u"}}]}, "names cluster 'elsewhere'"),
])
def test_broken_kubeconfigs_are_refused_with_the_field(tmp_path: Path, doc: dict[str, Any], says: str) -> None:
    path = kubeconfig(tmp_path / "config", {"token": "t"})
    path.write_text(json.dumps({**json.loads(path.read_text()), **doc}))
    with pytest.raises(KubeConfigError, match=says):
        load_config(str(path), {})


def test_a_missing_or_unreadable_kubeconfig_is_named(tmp_path: Path) -> None:
    with pytest.raises(KubeConfigError, match="no such file"):
        load_config(str(tmp_path / "absent"), {})
    (tmp_path / "list").write_text("- just\n- a list\n")
    with pytest.raises(KubeConfigError, match="not a kubeconfig"):
        load_config(str(tmp_path / "list"), {})


def test_kubeconfig_list_merges_first_wins_and_skips_missing_files(tmp_path: Path) -> None:
    """$KUBECONFIG as kubectl reads it: the first file to set a name or the current context wins."""
    first = tmp_path / "first"
    first.write_text(json.dumps({"current-context": "ctx", "users": [{"name": "u", "user": {"tokenFile": "tok"}}],
                                 "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}]}))
    (tmp_path / "sub").mkdir()
    second = kubeconfig(tmp_path / "sub" / "second", {"token": "ignored"}, current="other")
    config = load_config(None, {"KUBECONFIG": f"{tmp_path / 'missing'}:{first}:{second}"})
    assert config.server == "https://10.0.0.1:6443"  # the cluster only the second file defines
    assert config.token is None and config.token_file == tmp_path / "tok"  # the first file's user, relative to it
    with pytest.raises(KubeConfigError, match="none of the kubeconfig files exists"):
        load_config(None, {"KUBECONFIG": str(tmp_path / "missing")})


def service_account(directory: Path, pki: dict[str, tuple[Path, Path]], namespace: str = "serving") -> Path:
    """What the kubelet mounts at /var/run/secrets/kubernetes.io/serviceaccount."""
    directory.mkdir()
    (directory / "token").write_text("pod-token\n")
    (directory / "ca.crt").write_bytes(pki["cluster-ca"][1].read_bytes())
    (directory / "namespace").write_text(namespace)
    return directory


def test_in_cluster_from_the_service_account_and_the_environment(tmp_path: Path,
                                                                 pki: dict[str, tuple[Path, Path]]) -> None:
    sa = service_account(tmp_path / "sa", pki)
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    config = load_config(None, env, sa)
    assert (config.server, config.source, config.token_file) == ("https://10.96.0.1:443", "in-cluster", sa / "token")
    assert ca_subjects(config.ssl) == ["cluster-ca"]
    assert load_config(None, {**env, "KUBERNETES_SERVICE_HOST": "fd00::1"}, sa).server == "https://[fd00::1]:443"
    # A kubeconfig, when named, comes first: --kubeconfig, then $KUBECONFIG, then the service account.
    path = kubeconfig(tmp_path / "config", {"token": "t"})
    assert load_config(None, {**env, "KUBECONFIG": str(path)}, sa).source == str(path)
    with pytest.raises(KubeConfigError, match="--kubeconfig PATH, set \\$KUBECONFIG"):
        load_config(None, {}, sa)  # a service account, but not in a pod (no apiserver address)


def test_the_token_file_is_read_for_each_request_window(tmp_path: Path, pki: dict[str, tuple[Path, Path]]) -> None:
    sa = service_account(tmp_path / "sa", pki)
    config = load_config(None, {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}, sa)

    async def headers() -> dict[str, str]:
        async with KubeClient(config) as client:
            return await client._headers()

    assert asyncio.run(headers())["Authorization"] == "Bearer pod-token"


def test_own_namespace_from_the_service_account_else_the_environment(tmp_path: Path,
                                                                     pki: dict[str, tuple[Path, Path]]) -> None:
    sa = service_account(tmp_path / "sa", pki, namespace="from-file")
    assert own_namespace({"POD_NAMESPACE": "from-env"}, sa) == "from-file"
    assert own_namespace({"POD_NAMESPACE": "from-env"}, tmp_path / "none") == "from-env"
    assert own_namespace({}, tmp_path / "none") is None


def test_cli_kubernetes_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    path = kubeconfig(tmp_path / "config", {"token": "t"})
    a = cli.parse(["--kubernetes", "--kubeconfig", str(path), "--watch-namespace", "a", "--watch-namespace", "b",
                   "--watch-namespace", "a"])
    assert a.namespaces == ["a", "b"] and a.kube.token == "t" and a.endpoints == {}
    monkeypatch.setenv("POD_NAMESPACE", "mine")
    if not (SA_DIR / "namespace").exists():  # outside a pod: the environment names the router's namespace
        assert cli.parse(["--kubernetes", "--kubeconfig", str(path)]).namespaces == ["mine"]
        monkeypatch.delenv("POD_NAMESPACE")
        with pytest.raises(SystemExit):
            cli.parse(["--kubernetes", "--kubeconfig", str(path)])
        assert "--watch-namespace: not given, and the router's own namespace is unknown" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "says"), [
    (["--kubernetes", "--endpoint", "m=http://a:1"], "--endpoint and --kubernetes"),
    (["--watch-namespace", "a", "--endpoint", "m=http://a:1"], "--watch-namespace needs --kubernetes"),
    (["--kubeconfig", "x", "--endpoint", "m=http://a:1"], "--kubeconfig needs --kubernetes"),
    ([], "give at least one --endpoint MODEL=URL, or --kubernetes"),
    (["--kubernetes", "--kubeconfig", "/nonexistent/config"], "--kubeconfig: /nonexistent/config: no such file"),
    (["--kubernetes", "--kubeconfig", "CONFIG", "--watch-namespace", "Bad_NS"], "--watch-namespace 'Bad_NS'"),
])
def test_cli_errors_name_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                  says: str) -> None:
    path = kubeconfig(tmp_path / "config", {"token": "t"})
    with pytest.raises(SystemExit):
        cli.parse([str(path) if x == "CONFIG" else x for x in argv])
    assert says in capsys.readouterr().err
