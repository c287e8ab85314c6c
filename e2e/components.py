"""The control-plane components: finding their binaries (through build.sh) and their command lines."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from errors import ClusterError
from gpu_nodes import KWOK_ANNOTATION_KEY, KWOK_ANNOTATION_VALUE, NODE_IP
from netns import KWOK_POD_CIDR
from pki import _Pki

E2E_DIR = Path(__file__).resolve().parent
BUILD_SH = E2E_DIR / "build.sh"
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")

SERVICE_CIDR = "10.96.0.0/16"
KUBERNETES_SERVICE_IP = "10.96.0.1"  # first address of SERVICE_CIDR; must be in the serving cert


def find_bin_dir(build: bool = False) -> Path | None:
    """The bin dir of build.sh's cache; None if not built and build is False. KVFLEET_K8S_BIN overrides."""
    override = os.environ.get("KVFLEET_K8S_BIN")
    if override:
        path = Path(override)
        missing = [c for c in COMPONENTS if not (path / c).is_file()]
        if missing:
            raise ClusterError(f"KVFLEET_K8S_BIN={override} lacks {', '.join(missing)}")
        return path
    env = dict(os.environ)
    if not build:
        env["CHECK_ONLY"] = "1"
    # When building, Go's progress goes straight to our stderr (minutes on a cold cache).
    proc = subprocess.run(
        ["bash", str(BUILD_SH)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=None if build else subprocess.PIPE,
        text=True,
        check=False,
    )
    if not build and proc.returncode == 3:
        return None
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise ClusterError(f"{BUILD_SH} failed (exit {proc.returncode}): {(proc.stderr or '').strip()[-2000:]}")
    return Path(lines[-1])


def etcd_argv(bin_dir: Path, run_dir: Path, ports: dict[str, int]) -> list[str]:
    """etcd: one member on loopback, data in run_dir/etcd-data, no fsync."""
    client = f"http://127.0.0.1:{ports['etcd_client']}"
    peer = f"http://127.0.0.1:{ports['etcd_peer']}"
    return [
        str(bin_dir / "etcd"),
        "--name=default",
        f"--data-dir={run_dir / 'etcd-data'}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=default={peer}",
        "--initial-cluster-state=new",
        "--unsafe-no-fsync=true",
        "--log-level=warn",
    ]


def apiserver_argv(bin_dir: Path, run_dir: Path, pki: _Pki, ports: dict[str, int]) -> list[str]:
    """kube-apiserver: TLS from pki, RBAC, the front proxy, service accounts signed with pki's SA key."""
    d = pki.dir
    return [
        str(bin_dir / "kube-apiserver"),
        f"--etcd-servers=http://127.0.0.1:{ports['etcd_client']}",
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        f"--secure-port={ports['apiserver']}",
        f"--cert-dir={run_dir / 'apiserver-certs'}",  # unused: the cert files below are given
        f"--tls-cert-file={d / 'serving.crt'}",
        f"--tls-private-key-file={d / 'serving.key'}",
        f"--client-ca-file={pki.ca_crt}",
        f"--kubelet-client-certificate={d / 'apiserver-kubelet-client.crt'}",
        f"--kubelet-client-key={d / 'apiserver-kubelet-client.key'}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={pki.sa_pub}",
        f"--service-account-signing-key-file={pki.sa_key}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--authorization-mode=Node,RBAC",
        # The default reconciler rejects a loopback advertise address (kwokctl does the same).
        "--endpoint-reconciler-type=none",
        "--allow-privileged=true",
        f"--requestheader-client-ca-file={d / 'front-proxy-ca.crt'}",
        "--requestheader-allowed-names=front-proxy-client",
        "--requestheader-username-headers=X-Remote-User",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        f"--proxy-client-cert-file={d / 'front-proxy-client.crt'}",
        f"--proxy-client-key-file={d / 'front-proxy-client.key'}",
        "--enable-aggregator-routing=true",  # no kube-proxy: reach extension servers by endpoint, not VIP
        # Default admission plugins otherwise (ServiceAccount included: pods wait for the SA).
        "--enable-admission-plugins=NodeRestriction",
        "--profiling=false",
    ]


def _serving(pki: _Pki) -> list[str]:
    """KCM's and the scheduler's serving cert: the apiserver's (all listen on 127.0.0.1)."""
    return [f"--tls-cert-file={pki.dir / 'serving.crt'}", f"--tls-private-key-file={pki.dir / 'serving.key'}"]


def _delegated(run_dir: Path, name: str) -> list[str]:
    """One kubeconfig, run_dir/NAME.kubeconfig, for the API and for delegated authn/authz."""
    kc = run_dir / f"{name}.kubeconfig"
    return [f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}"]


def _control_component(bin_dir: Path, run_dir: Path, pki: _Pki, name: str, port: int) -> list[str]:
    """What the controller-manager and the scheduler share: binary, kubeconfigs, serving on loopback."""
    return [str(bin_dir / name), *_delegated(run_dir, name), "--leader-elect=false", "--bind-address=127.0.0.1",
            f"--secure-port={port}", *_serving(pki), "--profiling=false"]


def controller_manager_argv(bin_dir: Path, run_dir: Path, pki: _Pki, ports: dict[str, int]) -> list[str]:
    """kube-controller-manager: SA credentials per controller, and pki's CA as the CSR signer."""
    return [
        *_control_component(bin_dir, run_dir, pki, "kube-controller-manager", ports["kcm"]),
        f"--service-account-private-key-file={pki.sa_key}",
        f"--root-ca-file={pki.ca_crt}",
        "--use-service-account-credentials=true",
        # So a real kubelet can later get its client cert through a CSR.
        f"--cluster-signing-cert-file={pki.ca_crt}",
        f"--cluster-signing-key-file={pki.ca_key}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--cluster-name=kvfleet-e2e",
        "--kube-api-qps=100",
        "--kube-api-burst=200",
    ]


def scheduler_argv(bin_dir: Path, run_dir: Path, pki: _Pki, ports: dict[str, int]) -> list[str]:
    """kube-scheduler with the default profile."""
    return _control_component(bin_dir, run_dir, pki, "kube-scheduler", ports["scheduler"])


def kwok_argv(bin_dir: Path, run_dir: Path, ports: dict[str, int]) -> list[str]:
    """kwok: manages the annotated nodes and their pods, with the stages in run_dir/kwok.yaml."""
    return [
        str(bin_dir / "kwok"),
        f"--kubeconfig={run_dir / 'kwok.kubeconfig'}",
        f"--config={run_dir / 'kwok.yaml'}",
        f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION_KEY}={KWOK_ANNOTATION_VALUE}",
        f"--cidr={KWOK_POD_CIDR}",
        f"--node-ip={NODE_IP}",
        f"--server-address=127.0.0.1:{ports['kwok']}",
        # kwok's own default is 0 = no node leases; then KCM marks the nodes NotReady after its grace
        # period and kwok flips them back, every ~50 s. kwokctl passes 40 as well.
        "--node-lease-duration-seconds=40",
    ]
