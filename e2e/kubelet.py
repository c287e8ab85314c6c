"""A process kubelet for kwok's fake GPU nodes: each agent or router pod runs as a real local process on its pod IP.

kwok simulates every other pod (its stages skip these, see gpu_nodes.py). For a pod scheduled to a kwok
node whose container runs kvfleet-agent or kvfleet-router, this kubelet picks an IP from KUBELET_POD_CIDR,
starts it with the pod's command, args and env (podspec.py; a router also gets its ServiceAccount's token
and a kubeconfig), runs its startup, readiness and liveness probes against that IP and writes the pod
status (Running; Ready follows /ready); it restarts a container that exits or fails liveness, and when
the pod is deleted it sends SIGTERM, waits the grace period, kills what is left of the process group and
finishes the deletion.
It runs inside the cluster's network namespace (netns.py), the only place pod IPs exist.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kubeapi import KubeApi  # e2e/ is not a package
from netns import KUBELET_POD_CIDR
from pod_runner import RETRY_ERRORS, PodRunner
from podspec import runs_locally

READY_LINE = "kvfleet-kubelet ready"


class Kubelet:
    """Watches all pods; runs the agent and router pods scheduled to kwok-managed nodes."""

    def __init__(self, api: KubeApi, run_dir: Path, node_annotation: str, max_probe_period: float,
                 ca_pem: bytes = b"") -> None:
        self.api = api
        self.ca_pem = ca_pem  # the cluster CA, for the kubeconfigs of router pods
        self.run_dir = run_dir
        self.node_annotation = node_annotation  # key=value marking the nodes we serve
        self.max_probe_period = max_probe_period
        self.host_ip = "10.249.0.1"
        self.base_env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "PYTHONPATH")}
        # The CPU C++ ops `make setup` built, as the agent image carries its own (KVFLEET_EXT_CACHE, set there):
        # a pod's HOME is its own folder, where it would otherwise build them again at start-up.
        self.base_env["KVFLEET_EXT_CACHE"] = os.environ.get("KVFLEET_EXT_CACHE") or str(
            Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvfleet/ext")
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
        if not node or not runs_locally(pod):
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
        """Stop the pod's process within its grace period, then finish the deletion (off the watch loop).

        Retried until the pod is gone: a pod left Terminating blocks rollouts and namespace deletion.
        """
        meta = pod["metadata"]
        if runner is not None:
            grace = float(meta.get("deletionGracePeriodSeconds") or 0)
            await runner.stop(grace, pre_stop=grace > 0)
            self.pods.pop(meta["uid"], None)
            self.record_pids()
        backoff = 0.5
        while kind != "DELETED":
            try:
                await self.api.delete_pod_now(meta["namespace"], meta["name"], meta["uid"])
                return
            except RETRY_ERRORS as exc:
                print(f"finishing deletion of {meta['namespace']}/{meta['name']}: {exc}", file=sys.stderr, flush=True)
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, 10.0)

    async def run(self, stop: asyncio.Event) -> int:
        """List, then watch, until stop is set (0) or the watch loop fails for good (1)."""
        async with aiohttp.ClientSession() as self.probe_session:
            watcher = asyncio.create_task(self._watch_forever())
            stopper = asyncio.create_task(stop.wait())
            await asyncio.wait([watcher, stopper], return_when=asyncio.FIRST_COMPLETED)
            code = 0
            if watcher.done():
                print(f"the watch loop ended: {watcher.exception()!r}", file=sys.stderr, flush=True)
                code = 1
            for task in (watcher, stopper):
                task.cancel()
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await task
            await asyncio.gather(*(r.stop(min(r.pod["spec"].get("terminationGracePeriodSeconds", 30), 10.0))
                                   for r in list(self.pods.values())), return_exceptions=True)
            self.pods.clear()
            self.record_pids()
            return code

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
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                print(f"watch: {exc!r}; relisting", file=sys.stderr, flush=True)
                await asyncio.sleep(1.0)  # back off before relisting against a struggling API server


async def _amain(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    pki = Path(args.pki)
    async with KubeApi(args.server, pki / "ca.crt", pki / f"{args.user}.crt", pki / f"{args.user}.key") as api:
        return await Kubelet(api, Path(args.run_dir), args.node_annotation, args.max_probe_period,
                             (pki / "ca.crt").read_bytes()).run(stop)


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
    return asyncio.run(_amain(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
