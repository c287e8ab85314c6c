"""`kvfleet-agent serve --tensor-parallel-size 2`, a real process: it serves, a dead worker ends it, no orphans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from conftest import Processes
from server_process import READY

from kvfleet_agent import LLM, SamplingParams


def get_status(url: str) -> int | None:
    """HTTP status of a GET, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def complete(url: str, prompt: str, max_tokens: int) -> str:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return str(json.load(r)["choices"][0]["text"])


def launch(model_dir: str, env: dict[str, str], *flags: str) -> tuple[subprocess.Popen[str], str, list[int]]:
    """Start the agent on a free port; returns the process, its URL and its worker pids (from its output)."""
    cmd = [sys.executable, "-m", "kvfleet_agent.cli", "--log-level", "WARNING", "serve", "--model", model_dir,
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", "0", "--grpc-port", "-1", *flags]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVFLEET_")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**clean, **env})
    assert proc.stdout is not None
    lines: list[str] = []
    pids: list[int] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("kvfleet-agent workers:"):
            pids = [int(p) for p in line.split(":", 1)[1].split()]
        m = READY.search(line)
        if m:
            # Keep the pipe drained so the agent never blocks on a full pipe.
            threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
            return proc, f"http://{m.group(1)}:{m.group(2)}", pids
    proc.kill()
    proc.wait(10)
    raise RuntimeError("agent not ready:\n" + "".join(lines))


def test_serves_then_a_killed_worker_fails_health_and_the_process_exits_non_zero(
        tiny_checkpoint: Callable[..., str], no_leftover_children: Processes) -> None:
    model = tiny_checkpoint("llama")
    proc, url, pids = launch(model, {}, "--tensor-parallel-size", "2")
    try:
        assert len(pids) == 1 and no_leftover_children.alive(pids[0])
        offline = LLM(model=model).generate(["hello tensor parallel"], SamplingParams(max_tokens=12, temperature=0,
                                                                                     ignore_eos=True),
                                            use_tqdm=False)[0].outputs[0].text
        assert complete(url, "hello tensor parallel", 12) == offline
        assert get_status(url + "/health") == 200
        family = no_leftover_children.children(proc.pid)
        assert set(pids) <= family

        os.kill(pids[0], signal.SIGKILL)
        killed = time.monotonic()
        while (status := get_status(url + "/health")) == 200 and time.monotonic() - killed < 20:
            time.sleep(0.02)
        assert status != 200, "/health stayed 200 after a worker died"  # 503, or nothing once the process is gone
        assert proc.wait(30) == 1
        assert time.monotonic() - killed < 30
        assert not no_leftover_children.wait_gone(family)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_sigterm_leaves_no_worker_behind_and_the_env_var_sets_the_size(
        tiny_checkpoint: Callable[..., str], no_leftover_children: Processes) -> None:
    proc, url, pids = launch(tiny_checkpoint("llama"), {"KVFLEET_TENSOR_PARALLEL_SIZE": "2"})
    try:
        assert len(pids) == 1, "KVFLEET_TENSOR_PARALLEL_SIZE=2 starts one worker"
        assert complete(url, "one more", 4)
        family = no_leftover_children.children(proc.pid)
        assert set(pids) <= family
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert not no_leftover_children.wait_gone(family)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_workers_exit_when_the_server_is_killed_outright(tiny_checkpoint: Callable[..., str],
                                                        no_leftover_children: Processes) -> None:
    """No handler runs on SIGKILL: a worker notices its pipe to rank 0 closing and exits by itself."""
    proc, _, pids = launch(tiny_checkpoint("llama"), {}, "--tensor-parallel-size", "2")
    try:
        assert pids and all(no_leftover_children.alive(p) for p in pids)
        proc.kill()
        assert proc.wait(10) == -signal.SIGKILL
        assert not no_leftover_children.wait_gone(set(pids))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
