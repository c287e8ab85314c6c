"""Starting the cluster's pod network and process kubelet, and reaching into it from the host (exec, forward)."""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import netns
from errors import ClusterError
from procs import Proc, wait_until

E2E_DIR = Path(__file__).resolve().parent
SpawnFn = Callable[[str, list[str], list[str], dict[str, str] | None], Proc]


def _log_has(proc: Proc, line: str) -> bool:
    return line in proc.log.read_text(errors="replace")


def start(run_dir: Path, api_port: int, spawn: SpawnFn, timeout: float) -> tuple[Proc, Proc, Proc]:
    """API relay (host), namespace holder, process kubelet (inside); returns them once all are ready."""
    py = sys.executable
    script = str(netns.script_path())
    api_sock, gw_sock = str(run_dir / "api.sock"), str(run_dir / "gateway.sock")
    relay_argv = [py, script, "relay", "--listen-sock", api_sock, "--connect", f"127.0.0.1:{api_port}"]
    relay = spawn("api-relay", relay_argv, relay_argv, None)
    wait_until("the API relay", relay, lambda: _log_has(relay, netns.READY_LINE), timeout)

    inside = [py, script, "inside", "--api-port", str(api_port), "--api-sock", api_sock, "--gateway-sock", gw_sock]
    holder = spawn("netns", netns.unshare_argv(inside), inside, None)
    wait_until("the pod network namespace (unshare --user --net; needs unprivileged user namespaces)",
               holder, lambda: _log_has(holder, netns.READY_LINE), timeout)

    kubelet_argv = [py, str(E2E_DIR / "kubelet.py"), "--server", f"https://127.0.0.1:{api_port}",
                    "--pki", str(run_dir / "pki"), "--run-dir", str(run_dir)]
    # The agents it starts find `kvfleet-agent` next to this interpreter (the project's virtualenv).
    env = dict(os.environ, PATH=f"{Path(py).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    kubelet = spawn("process-kubelet", netns.nsenter_argv(holder.pid, kubelet_argv), kubelet_argv, env)
    wait_until("the process kubelet's first pod list", kubelet, lambda: _log_has(kubelet, "kvfleet-kubelet ready"),
               timeout)
    return relay, holder, kubelet


def exec_inside(holder_pid: int, argv: Sequence[str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run argv in the pod network (e.g. curl to a pod IP) and return its result."""
    return subprocess.run(netns.nsenter_argv(holder_pid, argv), capture_output=True, text=True, timeout=timeout,
                          check=False)


@contextlib.contextmanager
def forward(run_dir: Path, target: str, timeout: float = 10.0) -> Iterator[int]:
    """A loopback port on the host that reaches target (ADDRESS:PORT) in the pod network."""
    argv = [sys.executable, str(netns.script_path()), "forward", "--gateway-sock", str(run_dir / "gateway.sock"),
            target]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else ""
        if not line.startswith("forwarding 127.0.0.1:"):
            raise ClusterError(f"port forward to {target} did not start: {line!r}")
        yield int(line.split()[1].rsplit(":", 1)[1])
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
