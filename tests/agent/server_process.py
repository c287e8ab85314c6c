"""Start and stop a real `kvfleet-agent serve` process on free loopback ports, for integration tests."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

READY = re.compile(r"kvfleet-agent ready: http://([\d.]+):(\d+) grpc=(\S+)")


@dataclass
class AgentProcess:
    """A running agent: its process, HTTP base URL, gRPC port and captured output."""

    proc: subprocess.Popen[str]
    url: str
    grpc_port: int | None
    lines: list[str] = field(default_factory=list)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (a drain), then wait; kills only this pid if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                raise
        return self.proc.returncode


def start_agent(model_dir: str, *flags: str, timeout: float = 120.0, env: dict[str, str] | None = None,
                positional: bool = False, log_level: str = "WARNING") -> AgentProcess:
    """Launch the agent with port 0 (any free port) and wait for its ready line; env adds variables.

    positional: name the model as vLLM does (`serve MODEL`) rather than with --model.
    """
    model = [model_dir] if positional else ["--model", model_dir]
    cmd = [sys.executable, "-m", "kvfleet_agent.cli", "--log-level", log_level, "serve", *model,
           "--host", "127.0.0.1", "--port", "0", "--grpc-port", "0", *flags]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLEET_")} | (env or {})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        line = proc.stdout.readline()  # blocks until the agent prints; the deadline is checked per line
        if not line:
            raise RuntimeError(f"agent exited with {proc.wait()} before it was ready:\n{''.join(lines)}")
        lines.append(line)
        m = READY.search(line)
        if m:
            break
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError("agent not ready in time:\n" + "".join(lines))
    agent = AgentProcess(proc, f"http://{m.group(1)}:{m.group(2)}",
                         None if m.group(3) == "None" else int(m.group(3)), lines)
    # Keep draining stdout so the agent never blocks on a full pipe; keep the lines for failures.
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    return agent


@contextlib.contextmanager
def running_agent(model_dir: str, *flags: str, **options: Any) -> Iterator[AgentProcess]:
    """start_agent() for the length of a with-block; the agent must then exit cleanly (its log is the message)."""
    a = start_agent(model_dir, *flags, **options)
    try:
        yield a
    finally:
        assert a.stop() == 0, "".join(a.lines)
