"""A process kubelet for kwok's fake GPU nodes: each agent pod runs as a real local process on its pod IP.

kwok simulates every other pod (its stages skip agent pods, see gpu_nodes.py). For a pod scheduled to
a kwok node whose container runs kvfleet-agent, this kubelet picks an IP from KUBELET_POD_CIDR,
starts the agent with the pod's command, args and env (podspec.py), runs its startup, readiness and
liveness probes against that IP and writes the pod status (Running; Ready follows /ready); it
restarts a container that exits or fails liveness, and when the pod is deleted it sends SIGTERM,
waits the grace period, kills what is left of the process group and finishes the deletion.
It runs inside the cluster's network namespace (netns.py), the only place pod IPs exist.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kubeapi import ApiStatusError, KubeApi  # e2e/ is not a package
from netns import KUBELET_POD_CIDR
from podspec import Probe, ProcessSpec, configmap_names, process_spec, runs_agent

READY_LINE = "kvfleet-kubelet ready"
RESTART_BACKOFF_MAX_S = 10.0
_PR_SET_PDEATHSIG = 1


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the kubelet dies, so no agent outlives it even on SIGKILL."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class PodRunner:
    """One pod: its process, probes and status; restarts the container on exit or liveness failure."""

    def __init__(self, kubelet: Kubelet, pod: dict[str, Any], ip: str) -> None:
        self.kubelet, self.pod, self.ip = kubelet, pod, ip
        meta = pod["metadata"]
        self.namespace, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.dir = kubelet.run_dir / "pods" / f"{self.namespace}_{self.name}_{self.uid[:8]}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.ready = False
        self.last_exit: dict[str, Any] | None = None
        self.started_at = _now()
        self.task: asyncio.Task[None] | None = None
        self.stopping = False

    async def prepare(self) -> ProcessSpec:
        """The process to run; ConfigMap volumes are read from the API now, like a kubelet's volume manager."""
        configmaps: dict[str, dict[str, str]] = {}
        for name in configmap_names(self.pod):
            cm = await self.kubelet.api.request("GET", f"/api/v1/namespaces/{self.namespace}/configmaps/{name}")
            configmaps[name] = cm.get("data", {})
        spec = process_spec(self.pod, self.ip, self.kubelet.host_ip, self.dir, self.kubelet.run_dir,
                            self.kubelet.base_env, configmaps, self.kubelet.max_probe_period)
        for d in spec.dirs:
            d.mkdir(parents=True, exist_ok=True)
        for path, text in spec.files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return spec

    def _start(self, spec: ProcessSpec) -> None:
        log = (self.dir / "agent.log").open("ab")
        log.write(f"# {' '.join(spec.argv)}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(spec.argv, env=spec.env, cwd=spec.cwd, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
                                     start_new_session=True)  # own group: TP workers are killed with it
        log.close()
        self.started_at = _now()
        self.kubelet.record_pids()

    def status(self) -> dict[str, Any]:
        """The pod status this kubelet reports (phase Running once the process started)."""
        container = self.pod["spec"]["containers"][0]
        ready = "True" if self.ready else "False"
        now = _now()
        cs: dict[str, Any] = {
            "name": container["name"], "image": container.get("image", ""), "imageID": "",
            "containerID": f"process://{self.proc.pid if self.proc else 0}",
            "ready": self.ready, "started": self.proc is not None, "restartCount": self.restarts,
            "state": {"running": {"startedAt": self.started_at}},
        }
        if self.last_exit is not None:
            cs["lastState"] = {"terminated": self.last_exit}
        return {
            "phase": "Running", "podIP": self.ip, "podIPs": [{"ip": self.ip}],
            "hostIP": self.kubelet.host_ip, "hostIPs": [{"ip": self.kubelet.host_ip}], "startTime": self.started_at,
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
                {"type": "Initialized", "status": "True", "lastTransitionTime": now},
                {"type": "ContainersReady", "status": ready, "lastTransitionTime": now},
                {"type": "Ready", "status": ready, "lastTransitionTime": now},
            ],
            "containerStatuses": [cs],
        }

    async def report(self) -> None:
        try:
            await self.kubelet.api.patch_status(self.namespace, self.name, self.status())
        except ApiStatusError as exc:
            if exc.status != 404:
                print(f"status of {self.namespace}/{self.name}: {exc}", file=sys.stderr, flush=True)

    async def run(self) -> None:
        """Start, probe and restart until stopped."""
        try:
            spec = await self.prepare()
        except (ValueError, OSError, ApiStatusError) as exc:
            print(f"pod {self.namespace}/{self.name} cannot run here: {exc}", file=sys.stderr, flush=True)
            container = self.pod["spec"]["containers"][0]
            waiting = {"reason": "CreateContainerConfigError", "message": f"process kubelet: {exc}"}
            with contextlib.suppress(ApiStatusError):
                await self.kubelet.api.patch_status(self.namespace, self.name, {"containerStatuses": [{
                    "name": container["name"], "image": container.get("image", ""), "imageID": "",
                    "ready": False, "restartCount": 0, "state": {"waiting": waiting}}]})
            return
        backoff = 1.0
        while not self.stopping:
            self._start(spec)
            await self.report()
            reason = await self._supervise(spec)
            if self.stopping:
                return
            await self._kill(grace=spec.grace_seconds if reason == "liveness" else 0.0)
            self.restarts += 1
            self.ready = False
            await self.report()
            print(f"pod {self.namespace}/{self.name}: container {reason}; restart {self.restarts} in {backoff:.0f}s",
                  file=sys.stderr, flush=True)
            await asyncio.sleep(backoff)  # CrashLoopBackOff, shortened
            backoff = min(2 * backoff, RESTART_BACKOFF_MAX_S)

    async def _supervise(self, spec: ProcessSpec) -> str:
        """Probe until the process exits ("exited") or liveness fails ("liveness")."""
        started = spec.startup is None
        fails = {"startup": 0, "liveness": 0}
        period = min(p.period for p in (spec.startup, spec.readiness, spec.liveness, Probe("/", 0, 1.0, 1, 0, 1))
                     if p is not None)
        while not self.stopping:
            assert self.proc is not None
            if (code := self.proc.poll()) is not None:
                self.last_exit = {"exitCode": code, "reason": "Error" if code else "Completed", "finishedAt": _now(),
                                  "startedAt": self.started_at}
                return "exited"
            if not started and spec.startup is not None:
                if await self._probe(spec.startup):
                    started = True
                else:
                    fails["startup"] += 1
                    if fails["startup"] >= spec.startup.failure_threshold:
                        return "liveness"
            if started:
                if spec.liveness is not None:
                    fails["liveness"] = 0 if await self._probe(spec.liveness) else fails["liveness"] + 1
                    if fails["liveness"] >= spec.liveness.failure_threshold:
                        return "liveness"
                ready = await self._probe(spec.readiness) if spec.readiness is not None else True
                if ready != self.ready:
                    self.ready = ready
                    await self.report()
            await asyncio.sleep(period)  # the probe period, not a synchronisation
        return "stopped"

    async def _probe(self, probe: Probe) -> bool:
        url = f"http://{self.ip}:{probe.port}{probe.path}"
        try:
            async with self.kubelet.probe_session.get(url, timeout=aiohttp.ClientTimeout(total=probe.timeout)) as r:
                return 200 <= r.status < 400
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def _kill(self, grace: float) -> None:
        """SIGTERM the main process, wait up to grace, then SIGKILL its whole process group."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers too (workers the agent started)
        await asyncio.get_running_loop().run_in_executor(None, proc.wait)

    async def stop(self, grace: float) -> None:
        """Stop the container for good (pod deleted, or the kubelet shutting down)."""
        self.stopping = True
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        await self._kill(grace)
        self.kubelet.record_pids()


class Kubelet:
    """Watches all pods; runs the agent pods scheduled to kwok-managed nodes."""

    def __init__(self, api: KubeApi, run_dir: Path, node_annotation: str, max_probe_period: float) -> None:
        self.api = api
        self.run_dir = run_dir
        self.node_annotation = node_annotation  # key=value marking the nodes we serve
        self.max_probe_period = max_probe_period
        self.host_ip = "10.249.0.1"
        self.base_env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "PYTHONPATH")}
        self.nodes: set[str] = set()
        self.pods: dict[str, PodRunner] = {}
        self.terminating: dict[str, asyncio.Task[None]] = {}  # pod uid → its termination, once per pod
        self._ips = (str(ip) for ip in ipaddress.ip_interface(KUBELET_POD_CIDR).network.hosts())
        self.probe_session: aiohttp.ClientSession

    def record_pids(self) -> None:
        """RUN_DIR/kubelet-pods.json: pod uid → process pid, for tests that check nothing is left behind."""
        pids = {uid: {"pod": f"{r.namespace}/{r.name}", "pid": r.proc.pid, "ip": r.ip}
                for uid, r in self.pods.items() if r.proc is not None}
        tmp = self.run_dir / "kubelet-pods.json.tmp"
        tmp.write_text(json.dumps(pids, indent=1) + "\n")
        tmp.replace(self.run_dir / "kubelet-pods.json")

    async def _refresh_nodes(self) -> None:
        key, _, value = self.node_annotation.partition("=")
        nodes = (await self.api.request("GET", "/api/v1/nodes"))["items"]
        self.nodes = {n["metadata"]["name"] for n in nodes if n["metadata"].get("annotations", {}).get(key) == value}

    async def handle(self, kind: str, pod: dict[str, Any]) -> None:
        """One pod event: start, stop or finish deleting."""
        node = pod.get("spec", {}).get("nodeName")
        if not node or not runs_agent(pod):
            return
        if node not in self.nodes:
            await self._refresh_nodes()
            if node not in self.nodes:
                return
        uid = pod["metadata"]["uid"]
        runner = self.pods.get(uid)
        if kind == "DELETED" or pod["metadata"].get("deletionTimestamp"):
            if uid not in self.terminating:  # the same deletion is seen again on every status change
                self.terminating[uid] = asyncio.create_task(self._terminate(kind, pod, runner))
            return
        if runner is None and uid not in self.terminating:  # new, or running before a kubelet restart
            runner = PodRunner(self, pod, next(self._ips))
            self.pods[uid] = runner
            runner.task = asyncio.create_task(runner.run())

    async def _terminate(self, kind: str, pod: dict[str, Any], runner: PodRunner | None) -> None:
        """Stop the pod's process within its grace period, then finish the deletion (off the watch loop)."""
        meta = pod["metadata"]
        if runner is not None:
            await runner.stop(float(meta.get("deletionGracePeriodSeconds") or 0))
            self.pods.pop(meta["uid"], None)
            self.record_pids()
        if kind != "DELETED":
            await self.api.delete_pod_now(meta["namespace"], meta["name"], meta["uid"])

    async def run(self, stop: asyncio.Event) -> None:
        """List, then watch, until stop is set; relist when the watch expires."""
        async with aiohttp.ClientSession() as self.probe_session:
            watcher = asyncio.create_task(self._watch_forever())
            await stop.wait()
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            await asyncio.gather(*(r.stop(min(r.pod["spec"].get("terminationGracePeriodSeconds", 30), 10.0))
                                   for r in list(self.pods.values())))
            self.pods.clear()
            self.record_pids()

    async def _watch_forever(self) -> None:
        announced = False
        while True:
            try:
                await self._refresh_nodes()
                listing = await self.api.request("GET", "/api/v1/pods")
                live = {p["metadata"]["uid"] for p in listing["items"]}
                for uid in [u for u in self.pods if u not in live]:  # deleted while we were not watching
                    await self.pods.pop(uid).stop(0.0)
                for pod in listing["items"]:
                    await self.handle("ADDED", pod)
                if not announced:
                    print(READY_LINE, flush=True)
                    announced = True
                async for event in self.api.watch("/api/v1/pods", listing["metadata"]["resourceVersion"]):
                    if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        await self.handle(event["type"], event["object"])
                    elif event["type"] == "ERROR":
                        break  # e.g. 410 Gone: relist
            except (TimeoutError, aiohttp.ClientError, ApiStatusError) as exc:
                print(f"watch: {exc}; relisting", file=sys.stderr, flush=True)
                await asyncio.sleep(1.0)  # back off before relisting against a struggling API server


async def _amain(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    pki = Path(args.pki)
    async with KubeApi(args.server, pki / "ca.crt", pki / f"{args.user}.crt", pki / f"{args.user}.key") as api:
        await Kubelet(api, Path(args.run_dir), args.node_annotation, args.max_probe_period).run(stop)


def main() -> int:
    """Run the process kubelet until SIGTERM."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", required=True)
    parser.add_argument("--pki", required=True, help="dir with ca.crt and USER.crt/.key")
    parser.add_argument("--user", default="admin")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--node-annotation", default="kwok.x-k8s.io/node=fake")
    parser.add_argument("--max-probe-period", type=float, default=1.0,
                        help="cap on probe periods, so tests need not wait production-sized intervals")
    asyncio.run(_amain(parser.parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
