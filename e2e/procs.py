"""Control-plane processes: spawning, pid files, liveness checks, readiness polling, free ports, log tails, teardown."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from errors import ClusterError

LOG_TAIL_LINES = 40


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def private_dir(path: Path) -> Path:
    """Create path (0700) or accept it only if it is ours; tighten it to 0700 (it will hold keys and tokens)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_uid != os.getuid():
        raise ClusterError(f"{path} belongs to another user; choose another run dir")
    path.chmod(0o700)
    return path


def write_secret(path: Path, text: str) -> None:
    """Write a file readable only by us from its first byte (no window at the umask's mode)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of a log file, or a note that it does not exist."""
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(text.splitlines()[-lines:])


def pid_alive(pid: int) -> bool:
    """Whether pid is a live (non-zombie) process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, /proc/PID/stat field 22): with the pid, a unique key."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[-1].split()[19])


def pid_runs(pid: int, exe: str, started: int | None = None) -> bool:
    """Whether pid is alive and still the process we started: same argv[0] and, when recorded, same start time.

    argv[0] alone is not enough for our Python helpers (they all run the same interpreter).
    """
    if not pid_alive(pid):
        return False
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        return False
    return argv0 == exe and (started is None or start_ticks(pid) == started)


@dataclass
class Proc:
    """One control-plane process we started."""

    name: str
    argv: list[str]
    log: Path
    pid: int
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    started: int | None = None  # start_ticks(pid), to tell it from a later process with the same pid

    def alive(self) -> bool:
        """Whether it still runs (reaping it if it is our child)."""
        if self.popen is not None:
            return self.popen.poll() is None
        return pid_runs(self.pid, self.argv[0], self.started)


def spawn(run_dir: Path, name: str, argv: list[str], env: dict[str, str] | None = None,
          record_argv: list[str] | None = None) -> Proc:
    """Start one component in run_dir with its output in run_dir/logs/NAME.log.

    record_argv is what the process runs once a wrapper (unshare, nsenter) has exec'd it: pids.json
    records its argv[0], which `down` checks against /proc/PID/cmdline.
    """
    log = run_dir / "logs" / f"{name}.log"
    with log.open("ab") as out:
        out.write(f"# {' '.join(argv)}\n".encode())
        out.flush()
        # Own session: Ctrl-C in the terminal of `cluster.py up` does not reach the components.
        popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 cwd=run_dir, start_new_session=True, env=env)
    return Proc(name, record_argv or argv, log, popen.pid, popen, start_ticks(popen.pid))


def write_pids(path: Path, procs: Sequence[Proc]) -> None:
    """Record procs (name, pid, argv0, log) in a pids.json file, for `cluster.py down` in another process."""
    entries = [{"name": p.name, "pid": p.pid, "argv0": p.argv[0], "started": p.started, "log": str(p.log)}
               for p in procs]
    path.write_text(json.dumps(entries, indent=1) + "\n")


def read_pids(path: Path) -> list[dict[str, Any]]:
    """Entries of a pids.json file (name, pid, argv0, log)."""
    try:
        entries: list[dict[str, Any]] = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return entries


def wait_until(what: str, proc: Proc, check: Callable[[], bool], timeout: float) -> None:
    """Poll check() until it is true; fail fast if proc dies, or at the deadline, with its log tail."""
    deadline = time.monotonic() + timeout
    last = "not checked yet"
    while True:
        if not proc.alive():
            rc = proc.popen.returncode if proc.popen is not None else "?"
            raise ClusterError(
                f"{proc.name} exited (code {rc}) while waiting for {what}\n"
                f"--- last lines of {proc.log} ---\n{tail(proc.log)}"
            )
        try:
            if check():
                return
            last = "check returned false"
        except (OSError, ValueError, ClusterError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            raise ClusterError(
                f"timed out after {timeout:.0f}s waiting for {what} (last: {last})\n"
                f"--- last lines of {proc.log} ---\n{tail(proc.log)}"
            )
        time.sleep(0.2)


def terminate_all(procs: Sequence[Proc], grace: float) -> None:
    """SIGTERM each process in reverse order and wait up to grace for it; SIGKILL it if it is still there."""
    for proc in reversed(procs):
        if not proc.alive():
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while proc.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            kill_deadline = time.monotonic() + 5.0
            while proc.alive() and time.monotonic() < kill_deadline:
                time.sleep(0.05)
        if proc.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=1.0)


def stop_run_dir(run_dir: Path, keep: bool = False, grace: float = 10.0) -> list[str]:
    """Stop the processes recorded in run_dir/pids.json (only those still running their binary); returns names."""
    pids_file = run_dir / "pids.json"
    procs = [Proc(e["name"], [e["argv0"]], Path(e.get("log", "")), int(e["pid"]), started=e.get("started"))
             for e in read_pids(pids_file)]
    live = [p for p in procs if p.alive()]
    terminate_all(live, grace)
    if pids_file.exists():
        pids_file.unlink()
    if not keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return [p.name for p in live]
