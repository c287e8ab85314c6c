"""Local Kubernetes control plane (etcd, apiserver, controller-manager, scheduler, kwok) with fake GPU and CPU nodes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

# e2e/ is not a package: these sibling modules are found because e2e/ is on sys.path.
import components
import gpu_nodes
import netns
import pod_network
from components import BUILD_SH, KUBERNETES_SERVICE_IP, find_bin_dir
from errors import ApiError, ClusterError
from gpu_nodes import CPU_NODE_PREFIX, GPU_LABEL, GPU_RESOURCE, GPU_TAINT, GPU_TOLERATION, NODE_PREFIX
from pki import _Pki, make_cluster_certs, write_kubeconfig
from procs import (
    Proc,
    free_ports,
    pid_runs,
    private_dir,
    read_pids,
    spawn,
    stop_run_dir,
    terminate_all,
    wait_until,
    write_pids,
)

# Also re-exported from the helper modules, for test_cluster.py and other users of `from cluster import ...`.
__all__ = ["BUILD_SH", "CONTEXT", "CPU_NODE_PREFIX", "DEFAULT_RUN_DIR", "GPU_LABEL", "GPU_RESOURCE", "GPU_TAINT",
           "GPU_TOLERATION", "NODE_PREFIX", "ApiError", "ClusterError", "LocalCluster", "find_bin_dir", "main",
           "stop_run_dir"]

DEFAULT_RUN_DIR = Path(tempfile.gettempdir()) / "kvfleet-cluster"
CONTEXT = "kvfleet-e2e"


def _http_get(url: str, ctx: ssl.SSLContext | None = None, timeout: float = 5.0) -> str:
    """GET url and return the body; raises OSError (URLError/HTTPError) on failure."""
    with urllib.request.urlopen(url, context=ctx, timeout=timeout) as resp:
        return str(resp.read().decode().strip())


class LocalCluster:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler + kwok as local processes.

    Use as a context manager, or call start()/stop(). Everything (certs, kubeconfigs, etcd data,
    logs, pids.json) lives in run_dir; stop() removes it unless keep is set.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None = None,
        gpu_nodes: int = 2,
        bin_dir: str | os.PathLike[str] | None = None,
        keep: bool = False,
        timeout: float = 120.0,
        gpus_per_node: int = 8,
        cpu_nodes: int = 1,
    ) -> None:
        self._own_dir = run_dir is None
        self.run_dir = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="kvfleet-cluster-"))
        self.gpu_nodes = gpu_nodes
        self.gpus_per_node = gpus_per_node
        self.cpu_nodes = cpu_nodes
        self.keep = keep
        self.timeout = timeout
        self._bin_dir = Path(bin_dir) if bin_dir is not None else None
        self.procs: list[Proc] = []
        self.ports: dict[str, int] = {}
        self.timings: dict[str, float] = {}
        self.pki = _Pki(self.run_dir / "pki")
        self._ssl: ssl.SSLContext | None = None
        self.netns_pid: int | None = None  # holder of the pod network namespace

    # -- paths and environment

    @property
    def bin_dir(self) -> Path:
        """The directory holding the control-plane binaries (found through build.sh on first use)."""
        if self._bin_dir is None:
            found = find_bin_dir(build=False)
            if found is None:
                raise ClusterError(f"control-plane binaries are not built; run `bash {BUILD_SH}` (about 10 min)")
            self._bin_dir = found
        return self._bin_dir

    @property
    def kubeconfig(self) -> Path:
        """Admin kubeconfig (client cert in system:masters) for kubectl, kopf and the Python client."""
        return self.run_dir / "admin.kubeconfig"

    @property
    def server(self) -> str:
        """The API server URL."""
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    @property
    def kubectl_path(self) -> str:
        """kubectl built by build.sh if present, else the one on PATH."""
        built = self.bin_dir / "kubectl"
        if built.is_file():
            return str(built)
        found = shutil.which("kubectl")
        if found is None:
            raise ClusterError("no kubectl: build it with e2e/build.sh or put one on PATH")
        return found

    @property
    def env(self) -> dict[str, str]:
        """os.environ plus KUBECONFIG, with the bin dir first on PATH (so `kubectl` is the matching one)."""
        path = f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
        return dict(os.environ, KUBECONFIG=str(self.kubeconfig), PATH=path)

    @property
    def node_names(self) -> list[str]:
        """Names of the fake GPU nodes."""
        return [f"{NODE_PREFIX}{i}" for i in range(self.gpu_nodes)]

    @property
    def cpu_node_names(self) -> list[str]:
        """Names of the fake CPU nodes: untainted, no nvidia.com/gpu; the process kubelet runs agents there too."""
        return [f"{CPU_NODE_PREFIX}{i}" for i in range(self.cpu_nodes)]

    # -- context manager

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- start

    def start(self) -> None:
        """Start every component, register the GPU nodes and wait until all are ready; clean up on failure."""
        t0 = time.monotonic()
        pids_file = self.run_dir / "pids.json"
        if pids_file.exists() and any(pid_runs(p["pid"], p["argv0"], p.get("started")) for p in read_pids(pids_file)):
            raise ClusterError(f"a cluster is already running in {self.run_dir}; stop it first (cluster.py down)")
        bin_dir = self.bin_dir  # resolve before making anything
        private_dir(self.run_dir)  # keys, kubeconfigs and tokens live here
        self._ssl = None  # new certs below
        for sub in ("pki", "logs"):
            shutil.rmtree(self.run_dir / sub, ignore_errors=True)
        shutil.rmtree(self.run_dir / "etcd-data", ignore_errors=True)
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        try:
            self._phase("certs", self._make_certs)
            names = ("etcd_client", "etcd_peer", "apiserver", "kcm", "scheduler", "kwok")
            self.ports = dict(zip(names, free_ports(len(names)), strict=True))
            self._write_kubeconfigs()
            self._phase("kwok config", self._write_kwok_config)
            self._phase("etcd", lambda: self._start_etcd(bin_dir))
            self._phase("kube-apiserver", lambda: self._start_apiserver(bin_dir))
            self._phase("controllers", lambda: self._start_controllers(bin_dir))
            self._phase("gpu nodes", self._register_nodes)
            self._phase("pod network + process kubelet", self._start_pod_network)
            self._phase("default serviceaccount", self._wait_default_sa)
        except ClusterError as exc:
            self._stop_procs()
            self._write_state()
            raise ClusterError(f"{exc}\n(all logs are in {self.run_dir / 'logs'})") from exc
        except BaseException:
            self._stop_procs()
            self._write_state()
            raise
        self.timings["total"] = round(time.monotonic() - t0, 2)
        self._write_state()

    def _phase(self, name: str, fn: Callable[[], None]) -> None:
        """Run one start-up phase and record its wall time."""
        t = time.monotonic()
        fn()
        self.timings[name] = round(time.monotonic() - t, 2)

    def _make_certs(self) -> None:
        make_cluster_certs(self.pki, KUBERNETES_SERVICE_IP)

    def _write_kubeconfigs(self) -> None:
        for user, path in (
            ("admin", self.kubeconfig),
            ("kube-controller-manager", self.run_dir / "kube-controller-manager.kubeconfig"),
            ("kube-scheduler", self.run_dir / "kube-scheduler.kubeconfig"),
            ("kwok", self.run_dir / "kwok.kubeconfig"),
        ):
            self.write_kubeconfig(path, user, self.pki.dir / f"{user}.crt", self.pki.dir / f"{user}.key")

    def write_kubeconfig(self, path: Path, user: str, crt: Path, key: Path) -> None:
        """A self-contained kubeconfig (CA, cert and key embedded) for user at this cluster's API server."""
        write_kubeconfig(path, self.server, CONTEXT, self.pki.ca_crt, user, crt, key)

    def _write_kwok_config(self) -> None:
        gpu_nodes.write_kwok_config(self.run_dir / "kwok.yaml", self.bin_dir / "kwok")

    def _spawn(self, name: str, argv: list[str], record_argv: list[str] | None = None,
               env: dict[str, str] | None = None) -> Proc:
        """Start one component with its output in logs/NAME.log and record its pid."""
        proc = spawn(self.run_dir, name, argv, env, record_argv)
        self.procs.append(proc)
        write_pids(self.run_dir / "pids.json", self.procs)
        return proc

    def _write_state(self) -> None:
        state = {"server": self.server if self.ports else None, "kubeconfig": str(self.kubeconfig),
                 "bin_dir": str(self.bin_dir), "ports": self.ports, "timings_s": self.timings,
                 "nodes": self.node_names, "cpu_nodes": self.cpu_node_names, "netns_pid": self.netns_pid}
        (self.run_dir / "cluster.json").write_text(json.dumps(state, indent=1) + "\n")

    def _wait(self, what: str, proc: Proc, check: Callable[[], bool], timeout: float | None = None) -> None:
        """Poll check() until it is true; fail fast if proc dies, or at the deadline, with its log tail."""
        wait_until(what, proc, check, self.timeout if timeout is None else timeout)

    def _start_etcd(self, bin_dir: Path) -> None:
        client = f"http://127.0.0.1:{self.ports['etcd_client']}"
        proc = self._spawn("etcd", components.etcd_argv(bin_dir, self.run_dir, self.ports))
        self._wait("etcd /health", proc, lambda: json.loads(_http_get(f"{client}/health")).get("health") == "true")

    def _start_apiserver(self, bin_dir: Path) -> None:
        proc = self._spawn("kube-apiserver", components.apiserver_argv(bin_dir, self.run_dir, self.pki, self.ports))
        self._wait("kube-apiserver /readyz", proc, lambda: self.api_text("GET", "/readyz") == "ok")

    def _start_controllers(self, bin_dir: Path) -> None:
        run_dir, pki, ports = self.run_dir, self.pki, self.ports
        kcm = self._spawn("kube-controller-manager", components.controller_manager_argv(bin_dir, run_dir, pki, ports))
        sched = self._spawn("kube-scheduler", components.scheduler_argv(bin_dir, run_dir, pki, ports))
        kwok = self._spawn("kwok", components.kwok_argv(bin_dir, run_dir, ports))
        # Started together above; now wait for each (they come up in parallel).
        self._wait("kube-controller-manager /healthz", kcm, lambda: self._healthz(self.ports["kcm"]))
        self._wait("kube-scheduler /healthz", sched, lambda: self._healthz(self.ports["scheduler"]))
        self._wait("kwok /healthz", kwok, lambda: _http_get(f"http://127.0.0.1:{self.ports['kwok']}/healthz") == "ok")

    def _healthz(self, port: int) -> bool:
        """KCM/scheduler /healthz over TLS (their serving cert is from our CA); anonymous access is allowed."""
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_crt))
        return _http_get(f"https://127.0.0.1:{port}/healthz", ctx) == "ok"

    def _start_pod_network(self) -> None:
        _, holder, _ = pod_network.start(self.run_dir, self.ports["apiserver"], self._spawn, self.timeout)
        self.netns_pid = holder.pid

    # -- the pod network, from the host

    def exec_in_pod_network(self, *argv: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run a command where pod IPs are reachable (e.g. `curl http://POD_IP:8000/ready`)."""
        return pod_network.exec_inside(self._holder_pid(), argv, timeout)

    def spawn_in_pod_network(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        """Start a long-running process (e.g. the operator) in the pod network, stopped with the cluster."""
        return self._spawn(name, netns.nsenter_argv(self._holder_pid(), argv), argv, env)

    def port_forward(self, ip: str, port: int) -> contextlib.AbstractContextManager[int]:
        """with cluster.port_forward(pod_ip, 8000) as local_port: ... (a loopback port on the host)."""
        return pod_network.forward(self.run_dir, f"{ip}:{port}")

    def agent_processes(self) -> dict[str, dict[str, Any]]:
        """The process kubelet's running agents: pod uid → {pod, pid, ip}."""
        try:
            result: dict[str, dict[str, Any]] = json.loads((self.run_dir / "kubelet-pods.json").read_text())
        except (OSError, ValueError):
            return {}
        return result

    def pvc_dir(self, namespace: str, claim: str) -> Path:
        """The directory the process kubelet mounts for PersistentVolumeClaim `claim` in namespace."""
        return self.run_dir / "pvc" / namespace / claim

    def _holder_pid(self) -> int:
        if self.netns_pid is None:
            state = json.loads((self.run_dir / "cluster.json").read_text())
            self.netns_pid = state.get("netns_pid")
        if self.netns_pid is None:
            raise ClusterError("the pod network is not up")
        return int(self.netns_pid)

    def node_manifest(self, name: str) -> dict[str, Any]:
        """A fake GPU node: kwok-managed, labelled and tainted for GPUs, with nvidia.com/gpu capacity."""
        return gpu_nodes.node_manifest(name, self.gpus_per_node)

    def _register_nodes(self) -> None:
        manifests = [self.node_manifest(n) for n in self.node_names]
        manifests += [gpu_nodes.cpu_node_manifest(n) for n in self.cpu_node_names]
        for manifest in manifests:
            try:
                self.api("POST", "/api/v1/nodes", manifest)
            except ApiError as exc:
                if exc.status != 409:
                    raise
        kwok = self._proc("kwok")
        self._wait(f"{self.gpu_nodes} GPU and {self.cpu_nodes} CPU nodes Ready and schedulable", kwok,
                   self._nodes_ready)

    def _nodes_ready(self) -> bool:
        """Our nodes are Ready, have a heartbeat lease, and KCM has lifted the not-ready taint (else no scheduling)."""
        nodes = self.api("GET", "/api/v1/nodes")["items"]
        leases = self.api("GET", "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases")["items"]
        return gpu_nodes.nodes_ready(nodes, leases, self.node_names + self.cpu_node_names)

    def _wait_default_sa(self) -> None:
        """ServiceAccount admission rejects pods until the namespace's `default` SA exists."""
        def exists() -> bool:
            try:
                self.api("GET", "/api/v1/namespaces/default/serviceaccounts/default")
            except ApiError as exc:
                if exc.status == 404:
                    return False
                raise
            return True

        self._wait("the default ServiceAccount", self._proc("kube-controller-manager"), exists)

    def _proc(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    # -- API access (stdlib only)

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            ctx = ssl.create_default_context(cafile=str(self.pki.ca_crt))
            ctx.load_cert_chain(str(self.pki.dir / "admin.crt"), str(self.pki.dir / "admin.key"))
            self._ssl = ctx
        return self._ssl

    def api_text(self, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = 10.0) -> str:
        """One request to the API server as admin; the response body as text. Raises ApiError on HTTP errors."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        req.add_header("Accept", "application/json")
        try:
            with urllib.request.urlopen(req, context=self._ssl_context(), timeout=timeout) as resp:
                return str(resp.read().decode())
        except urllib.error.HTTPError as exc:
            raise ApiError(method, path, exc.code, exc.read().decode(errors="replace")) from None

    def api(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """One JSON request to the API server as admin."""
        result: dict[str, Any] = json.loads(self.api_text(method, path, body))
        return result

    def kubectl(self, *args: str, check: bool = True, timeout: float = 60.0,
                stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster; raise ClusterError with its stderr if check and it fails."""
        proc = subprocess.run([self.kubectl_path, *args], env=self.env, capture_output=True, text=True,
                              input=stdin, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def kubectl_json(self, *args: str) -> Any:
        """kubectl ARGS -o json, parsed."""
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    # -- stop

    def _stop_procs(self, grace: float = 10.0) -> None:
        terminate_all(self.procs, grace)
        self.procs = []

    def stop(self, keep: bool | None = None) -> None:
        """SIGTERM the components in reverse start order, SIGKILL stragglers, remove run_dir unless keep."""
        self._stop_procs()
        pids_file = self.run_dir / "pids.json"
        if pids_file.exists():  # e.g. a cluster started by another process in the same run dir
            stop_run_dir(self.run_dir, keep=True)
        ours = self._own_dir or (self.run_dir / "cluster.json").exists()  # never wipe an unrelated dir
        if ours and not (self.keep if keep is None else keep):
            shutil.rmtree(self.run_dir, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    """`python e2e/cluster.py up|down` (see cluster_cli.py)."""
    from cluster_cli import main as cli_main  # the CLI imports this module; import it only when run

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
