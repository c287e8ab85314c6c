"""The CPUs a process may use: its affinity mask capped by its cgroup's CPU quota, read from cgroup v2 and v1 files."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvfleet_agent import LLM
from kvfleet_agent.worker import cpu_budget, executor
from kvfleet_agent.worker.cpu_budget import quota_cpus, usable_cpus


def tree(tmp_path: Path, files: dict[str, str], proc: str) -> tuple[Path, Path]:
    """A cgroup filesystem of `files` (relative path → content) and a /proc/self/cgroup holding `proc`."""
    for rel, text in files.items():
        (tmp_path / "fs" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / rel).write_text(text + "\n")
    (tmp_path / "cgroup").write_text(proc)
    return tmp_path / "fs", tmp_path / "cgroup"


@pytest.mark.parametrize(("cpu_max", "want"), [("max 100000", None), ("250000 100000", 2.5), ("50000 100000", 0.5)])
def test_cgroup_v2_cpu_max_of_the_process_cgroup(tmp_path: Path, cpu_max: str, want: float | None) -> None:
    files = {"kubepods/pod1/c1/cpu.max": cpu_max, "cpu.max": "max 100000"}  # the root's own limit is not the pod's
    root, proc = tree(tmp_path, files, "0::/kubepods/pod1/c1\n")
    assert quota_cpus(root, proc) == want


def test_cgroup_v2_namespaced_at_the_root(tmp_path: Path) -> None:
    """Inside a cgroup namespace the process's own cgroup is the root: /proc/self/cgroup says "0::/"."""
    root, proc = tree(tmp_path, {"cpu.max": "400000 100000"}, "0::/\n")
    assert quota_cpus(root, proc) == 4.0


@pytest.mark.parametrize(("quota", "want"), [("-1", None), ("300000", 3.0), ("150000", 1.5)])
def test_cgroup_v1_cfs_quota(tmp_path: Path, quota: str, want: float | None) -> None:
    root, proc = tree(tmp_path, {"cpu/cpu.cfs_quota_us": quota, "cpu/cpu.cfs_period_us": "100000"},
                      "4:memory:/x\n1:cpu,cpuacct:/\n0::/\n")
    assert quota_cpus(root, proc) == want


def test_no_cgroup_files_mean_no_quota(tmp_path: Path) -> None:
    assert quota_cpus(tmp_path / "none", tmp_path / "none-either") is None
    root, proc = tree(tmp_path, {"cpu.max": "garbage"}, "0::/\n")
    assert quota_cpus(root, proc) is None


def test_usable_cpus_is_the_quota_rounded_down_within_the_affinity_mask(tmp_path: Path) -> None:
    cpus = len(os.sched_getaffinity(0))
    for quota, want in [("max 100000", cpus), ("50000 100000", 1), (f"{150000 * cpus} 100000", cpus)]:
        root, proc = tree(tmp_path, {"cpu.max": quota}, "0::/\n")
        assert usable_cpus(root, proc) == want
    if cpus >= 2:
        root, proc = tree(tmp_path, {"cpu.max": "150000 100000"}, "0::/\n")
        assert usable_cpus(root, proc) == 1


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one thread already: nothing to cap")
def test_an_engine_on_cpu_runs_as_many_threads_as_its_quota_allows(tiny_checkpoint: Callable[..., str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod limited to one CPU: the engine computes on one thread, whatever torch's default (a process with more
    than one), and gives the process its thread count back when it shuts down."""
    before = torch.get_num_threads()
    monkeypatch.setattr(executor, "usable_cpus", lambda: 1)
    llm = LLM(model=tiny_checkpoint("llama"), dtype="float32")
    assert torch.get_num_threads() == 1
    llm.shutdown()
    assert torch.get_num_threads() == before
    assert cpu_budget.usable_cpus() >= 1  # the real machine's answer, whatever it is
