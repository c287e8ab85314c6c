"""One pod under the process kubelet: its process, probes, restarts and status, until the pod is deleted."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from kubeapi import ApiStatusError
from podspec import Probe, ProcessSpec, configmap_names, env_object_names, kubeconfig, process_spec

if TYPE_CHECKING:
    from kubelet import Kubelet

RESTART_BACKOFF_MAX_S = 10.0
TOKEN_SECONDS = 3600  # a router's bound token lives this long; renewed at 80%, as a kubelet renews projected tokens
RETRY_ERRORS = (ValueError, OSError, ApiStatusError, aiohttp.ClientError, TimeoutError)

# Resolved here, in the parent: the child between fork and exec must not dlopen (the kubelet has threads).
_PRCTL: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the kubelet dies (its own children are reaped by killpg)."""
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


def pod_dir(run_dir: Path, namespace: str, name: str, uid: str) -> Path:
    """Where a pod's log, volumes and working directory live."""
    return run_dir / "pods" / f"{namespace}_{name}_{uid[:8]}"


def write_private(path: Path, text: str) -> None:
    """Replace a credentials file at once (a reader never sees half of it), readable only by us."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(text)
    tmp.replace(path)


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def exit_status(pid: int) -> int | None:
    """The exit code of our child pid (128+signal if killed) without reaping it, or None while it runs.

    Not reaping matters: until we wait() for it, neither its pid nor its process-group id can be reused,
    so a killpg() on that id can only reach this pod's processes.
    """
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else 128 + info.si_status


class PodRunner:
    """One pod: start, probe, restart per restartPolicy, report status; stop() on deletion."""

    def __init__(self, kubelet: Kubelet, pod: dict[str, Any], ip: str) -> None:
        self.kubelet, self.pod, self.ip = kubelet, pod, ip
        meta = pod["metadata"]
        self.namespace, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.dir = pod_dir(kubelet.run_dir, self.namespace, self.name, self.uid)
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.ready = False
        self.state: dict[str, Any] = {"waiting": {"reason": "ContainerCreating"}}
        self.last_exit: dict[str, Any] | None = None
        self.phase = "Pending"
        self.start_time = now()
        self.transitions: dict[str, tuple[str, str]] = {}  # condition type → (status, lastTransitionTime)
        self.task: asyncio.Task[None] | None = None
        self.spec: ProcessSpec | None = None  # set once prepare() succeeded
        self.stopping = False
        self.renew_at = 0.0  # event-loop time to renew a router's token

    async def _data(self, plural: str, name: str, *, missing_ok: bool) -> dict[str, str] | None:
        """A ConfigMap's or Secret's data (a Secret's decoded); None when it does not exist and missing_ok."""
        try:
            obj = await self.kubelet.api.request("GET", f"/api/v1/namespaces/{self.namespace}/{plural}/{name}")
        except ApiStatusError as exc:
            if exc.status == 404 and missing_ok:
                return None  # podspec decides: an optional env reference is left out, a required one waits
            raise
        data: dict[str, str] = obj.get("data") or {}
        return {k: base64.b64decode(v).decode() for k, v in data.items()} if plural == "secrets" else data

    async def prepare(self) -> ProcessSpec:
        """The process to run; ConfigMaps (volumes, env) and Secrets (env) are read from the API now, like a
        kubelet's volume manager and its env resolution."""
        found: dict[str, dict[str, dict[str, str]]] = {"configmaps": {}, "secrets": {}}
        for name in configmap_names(self.pod):  # a volume's ConfigMap must exist: retried until it does
            found["configmaps"][name] = await self._data("configmaps", name, missing_ok=False) or {}
        for plural, names in env_object_names(self.pod).items():
            for name in names - found[plural].keys():
                if (data := await self._data(plural, name, missing_ok=True)) is not None:
                    found[plural][name] = data
        spec = process_spec(self.pod, self.ip, self.kubelet.host_ip, self.dir, self.kubelet.run_dir,
                            self.kubelet.base_env, found["configmaps"], self.kubelet.max_probe_period,
                            found["secrets"])
        for d in spec.dirs:
            d.mkdir(parents=True, exist_ok=True)
        for path, text in spec.files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return spec

    async def credentials(self, spec: ProcessSpec) -> None:
        """A router pod's API access (podspec.py's docstring): a token of its ServiceAccount bound to this pod, from
        the TokenRequest API, and a kubeconfig naming the apiserver as the pod network reaches it."""
        if spec.credentials is None:
            return
        account = self.pod["spec"].get("serviceAccountName") or "default"
        request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                   "spec": {"expirationSeconds": TOKEN_SECONDS,
                            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": self.name, "uid": self.uid}}}
        answer = await self.kubelet.api.request(
            "POST", f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{account}/token", request)
        write_private(spec.credentials / "token", answer["status"]["token"])
        write_private(spec.credentials / "kubeconfig",
                      kubeconfig(self.kubelet.api.server, self.kubelet.ca_pem, self.namespace, "token"))
        self.renew_at = asyncio.get_running_loop().time() + 0.8 * TOKEN_SECONDS

    def _start(self, spec: ProcessSpec) -> None:
        with (self.dir / "agent.log").open("ab") as log:
            log.write(f"# {' '.join(spec.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(spec.argv, env=spec.env, cwd=spec.cwd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
                                         start_new_session=True)  # own group: TP workers are killed with it
        self.state = {"running": {"startedAt": now()}}
        self.phase = "Running"
        self.kubelet.record_pids()

    def _condition(self, kind: str, status: str) -> dict[str, str]:
        """A condition whose lastTransitionTime moves only when its status flips."""
        previous = self.transitions.get(kind)
        if previous is None or previous[0] != status:
            self.transitions[kind] = (status, now())
        return {"type": kind, "status": status, "lastTransitionTime": self.transitions[kind][1]}

    def status(self) -> dict[str, Any]:
        """The pod status this kubelet reports."""
        container = self.pod["spec"]["containers"][0]
        ready = "True" if self.ready else "False"
        cs: dict[str, Any] = {
            "name": container["name"], "image": container.get("image", ""), "imageID": "",
            "containerID": f"process://{self.proc.pid if self.proc else 0}",
            "ready": self.ready, "started": "running" in self.state, "restartCount": self.restarts,
            "state": self.state,
        }
        if self.last_exit is not None:
            cs["lastState"] = {"terminated": self.last_exit}
        return {
            "phase": self.phase, "podIP": self.ip, "podIPs": [{"ip": self.ip}],
            "hostIP": self.kubelet.host_ip, "hostIPs": [{"ip": self.kubelet.host_ip}], "startTime": self.start_time,
            "conditions": [self._condition("PodScheduled", "True"), self._condition("Initialized", "True"),
                           self._condition("ContainersReady", ready), self._condition("Ready", ready)],
            "containerStatuses": [cs],
        }

    async def report(self) -> None:
        """Write the status; errors are logged (the next change reports again), never raised."""
        try:
            await self.kubelet.api.patch_status(self.namespace, self.name, self.status())
        except RETRY_ERRORS as exc:
            if not (isinstance(exc, ApiStatusError) and exc.status == 404):
                print(f"status of {self.namespace}/{self.name}: {exc}", file=sys.stderr, flush=True)

    async def run(self) -> None:
        """Start, probe and restart until stopped; a failure to set up is retried with back-off."""
        backoff = 1.0
        while not self.stopping:
            try:
                spec = self.spec = self.spec or await self.prepare()
                await self.credentials(spec)  # a fresh token for every start, like a kubelet's projected volume
                self._start(spec)
            except RETRY_ERRORS as exc:
                print(f"pod {self.namespace}/{self.name} cannot start: {exc}", file=sys.stderr, flush=True)
                self.state = {"waiting": {"reason": "CreateContainerConfigError", "message": f"process kubelet: {exc}"}}
                await self.report()
                await asyncio.sleep(backoff)  # retried: e.g. a ConfigMap that is created later
                backoff = min(2 * backoff, RESTART_BACKOFF_MAX_S)
                continue
            await self.report()
            reason = await self._supervise(spec)
            if self.stopping:
                return
            code = await self._kill(spec.grace_seconds if reason == "liveness" else 0.0)
            self.ready = False
            self.last_exit = {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                              "startedAt": self.state.get("running", {}).get("startedAt", now()), "finishedAt": now()}
            if spec.restart_policy == "Never" or (spec.restart_policy == "OnFailure" and code == 0):
                self.phase = "Succeeded" if code == 0 else "Failed"
                self.state = {"terminated": self.last_exit}
                await self.report()
                return
            self.restarts += 1
            self.state = {"waiting": {"reason": "CrashLoopBackOff", "message": f"container {reason} (exit {code})"}}
            await self.report()
            print(f"pod {self.namespace}/{self.name}: container {reason} (exit {code}); restart {self.restarts} "
                  f"in {backoff:.0f}s", file=sys.stderr, flush=True)
            await asyncio.sleep(backoff)  # CrashLoopBackOff, shortened
            backoff = min(2 * backoff, RESTART_BACKOFF_MAX_S)

    async def _supervise(self, spec: ProcessSpec) -> str:
        """Probe until the process exits ("exited") or startup/liveness fails ("liveness")."""
        assert self.proc is not None
        started = spec.startup is None
        fails = {"startup": 0, "liveness": 0}
        probes = [p for p in (spec.startup, spec.readiness, spec.liveness) if p is not None]
        period = min((p.period for p in probes), default=self.kubelet.max_probe_period)
        delay = min((p.initial_delay for p in probes), default=0.0)
        loop = asyncio.get_running_loop()
        begun = loop.time()
        while not self.stopping:
            if exit_status(self.proc.pid) is not None:
                return "exited"
            if spec.credentials is not None and loop.time() >= self.renew_at:
                try:
                    await self.credentials(spec)
                except RETRY_ERRORS as exc:  # the old token stays valid a while: tried again next period
                    print(f"renewing the token of {self.namespace}/{self.name}: {exc}", file=sys.stderr, flush=True)
            if loop.time() - begun >= delay:
                if not started and spec.startup is not None:
                    started = await self._probe(spec.startup)
                    fails["startup"] = 0 if started else fails["startup"] + 1
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

    async def _kill(self, grace: float, pre_stop: float = 0.0) -> int:
        """preStop sleep, SIGTERM, up to grace for the exit, then SIGKILL the process group; reap. Exit code."""
        proc = self.proc
        if proc is None:
            return 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        if exit_status(proc.pid) is None and pre_stop > 0:
            await asyncio.sleep(min(pre_stop, grace))  # lifecycle.preStop sleep, counted in the grace period
        if exit_status(proc.pid) is None:
            os.kill(proc.pid, signal.SIGTERM)  # safe: unreaped, so the pid is still ours
            while exit_status(proc.pid) is None and loop.time() < deadline:
                await asyncio.sleep(0.05)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # the whole group, stragglers included; the id cannot be reused yet
        code = await loop.run_in_executor(None, proc.wait)
        return 128 - code if code < 0 else code  # Popen: -N for signal N → a kubelet's 128+N

    async def stop(self, grace: float, pre_stop: bool = False) -> None:
        """Stop the container for good (pod deleted, or the kubelet shutting down); pre_stop runs its preStop sleep."""
        self.stopping = True
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await self.task
        await self._kill(grace, self.spec.pre_stop_sleep if pre_stop and self.spec is not None else 0.0)
        self.kubelet.record_pids()
