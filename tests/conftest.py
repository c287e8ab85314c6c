"""Shared fixtures: tiny random checkpoints (with a locally trained tokenizer), an LLM on one, and GPU skipping."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from llm_helpers import ENGINE_OPTIONS

from kvfleet_agent.llm import LLM
from kvfleet_agent.models.tiny import ARCHS, init_tiny

# No per-example deadline for property tests (Hypothesis' default is 200 ms): on a loaded 2-core CI machine one
# stalled example fails a property that holds, as DeadlineExceeded or Flaky. Speed is the benchmarks' business.
settings.register_profile("kvfleet", deadline=None)
settings.load_profile("kvfleet")

# Asserts in the shared helper modules report their operands too, as the tests' own asserts do.
pytest.register_assert_rewrite("bookkeeping_helpers", "kernel_helpers", "loader_helpers")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` tests on machines without CUDA rather than failing them."""
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """Factory: a tiny random checkpoint of the given architecture, made once per session and arguments."""
    made: dict[tuple[Any, ...], str] = {}

    def make(arch: str = "llama", seed: int = 0, **overrides: Any) -> str:
        key = (arch, seed, tuple(sorted(overrides.items())))
        if key not in made:
            out: Path = tmp_path_factory.mktemp(f"tiny-{arch}")
            made[key] = init_tiny(str(out), arch=arch, seed=seed, **overrides)
        return made[key]

    return make


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint: Callable[..., str]) -> Path:
    """The tiny llama checkpoint; tests that need a variant of it edit a copy."""
    return Path(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def llm(ckpt: Path) -> LLM:
    """An LLM on `ckpt` with llm_helpers.ENGINE_OPTIONS, one per test module."""
    return LLM(model=str(ckpt), **ENGINE_OPTIONS)


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """For the loader tests: a good checkpoint per architecture and a 2-shard llama; tests edit copies, never these."""
    root = tmp_path_factory.mktemp("loader_ckpts")
    out = {arch: Path(init_tiny(str(root / arch), arch, seed=11)) for arch in ARCHS}
    out["llama-sharded"] = Path(init_tiny(str(root / "llama-sharded"), "llama", seed=11, num_shards=2))
    return out


class Processes:
    """Process liveness read from /proc (no psutil): enough to prove that no worker outlives its engine."""

    @staticmethod
    def alive(pid: int) -> bool:
        """Whether pid runs (a zombie has exited: it only waits for its parent to reap it)."""
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        return stat.rpartition(")")[2].split()[0] != "Z"

    @staticmethod
    def children(pid: int) -> set[int]:
        """Live children of pid, leaving out multiprocessing's resource tracker (one per process, by design)."""
        out = set()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:  # exited while we looked
                continue
            state, ppid = stat.rpartition(")")[2].split()[:2]
            if int(ppid) == pid and state != "Z" and b"resource_tracker" not in cmdline:
                out.add(int(entry))
        return out

    def wait_gone(self, pids: set[int], timeout: float = 20.0) -> set[int]:
        """Poll until none of pids runs or the deadline passes; returns the ones still running."""
        deadline = time.monotonic() + timeout
        while (left := {p for p in pids if self.alive(p)}) and time.monotonic() < deadline:
            time.sleep(0.05)
        return left


@pytest.fixture
def no_leftover_children() -> Iterator[Processes]:
    """Fails the test if it leaves child processes of this process running; yields /proc helpers."""
    procs = Processes()
    before = procs.children(os.getpid())
    yield procs
    left = procs.wait_gone(procs.children(os.getpid()) - before)
    assert not left, f"processes left behind: {sorted(left)}"
