"""Tensor parallelism under failure: start-up errors name their rank, dead workers are noticed, none is left behind."""

from __future__ import annotations

import gc
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import Processes
from loader_helpers import copy_of
from safetensors.torch import load_file, save_file

from kvfleet_agent import LLM, SamplingParams
from kvfleet_agent.layers import tp_group as group
from kvfleet_agent.worker.executor import RankError

OPTIONS = {"kv_cache_memory_bytes": 2 << 20, "tensor_parallel_size": 2}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

# Loaded by every Python process started while it is on PYTHONPATH, so only by processes spawned
# during the test (the workers): their checkpoint reads fail, rank 0's (this process) succeed.
BREAK_LOADING = '''
import safetensors

def _unreadable(path, *args, **kwargs):
    raise OSError(f"simulated unreadable checkpoint file {path}")

safetensors.safe_open = _unreadable
'''


def test_a_start_up_error_on_a_worker_surfaces_with_its_rank_and_message(
        tiny_checkpoint: Callable[..., str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        no_leftover_children: Processes) -> None:
    (tmp_path / "sitecustomize.py").write_text(BREAK_LOADING, encoding="utf-8")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    with pytest.raises(RankError, match=r"rank 1 \(pid \d+\) failed during start-up: OSError: simulated "
                                        r"unreadable checkpoint file .*model\.safetensors"):
        LLM(model=tiny_checkpoint("llama"), **OPTIONS)


def test_a_bad_checkpoint_fails_on_rank_0_with_its_own_error(
        tiny_checkpoint: Callable[..., str], tmp_path: Path, no_leftover_children: Processes) -> None:
    d = copy_of(Path(tiny_checkpoint("llama")), tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks tensors for: layers\.1\.mlp\.down_proj\.weight$"):
        LLM(model=str(d), **OPTIONS)


def test_a_killed_worker_fails_the_next_step_with_its_rank(tiny_checkpoint: Callable[..., str],
                                                          no_leftover_children: Processes) -> None:
    with LLM(model=tiny_checkpoint("llama"), **OPTIONS) as llm:
        assert len(llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8
        (pid,) = llm.engine.executor.worker_pids()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while llm.engine.executor.failure is None and time.monotonic() < deadline:  # the supervisor's verdict
            time.sleep(0.02)
        assert llm.engine.executor.failure == f"tensor-parallel rank 1 (pid {pid}) was killed by SIGKILL"
        with pytest.raises(RankError, match=f"rank 1 \\(pid {pid}\\) was killed by SIGKILL"):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
        assert not llm.engine.has_unfinished(), "the failed call left requests behind"


def test_a_worker_dying_mid_step_breaks_the_step_not_the_process(tiny_checkpoint: Callable[..., str],
                                                                no_leftover_children: Processes) -> None:
    """The collective notices before the supervisor can: the step raises RankError, it does not hang."""
    with LLM(model=tiny_checkpoint("llama"), **OPTIONS) as llm:
        (pid,) = llm.engine.executor.worker_pids()
        engine = llm.engine
        real = engine.executor._publish

        def publish_then_kill(batch: object) -> None:
            os.kill(pid, signal.SIGKILL)  # rank 1 dies before it can read this step
            real(batch)  # type: ignore[arg-type]

        engine.executor._publish = publish_then_kill  # type: ignore[method-assign]
        start = time.monotonic()
        with pytest.raises(RankError, match=r"rank 1 \(pid \d+\)"):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 30


def test_workers_stop_when_the_llm_is_dropped_without_shutdown(tiny_checkpoint: Callable[..., str],
                                                              no_leftover_children: Processes) -> None:
    threads = torch.get_num_threads()
    llm = LLM(model=tiny_checkpoint("llama"), **OPTIONS)
    pids = set(llm.engine.executor.worker_pids())
    assert pids and all(no_leftover_children.alive(p) for p in pids)
    del llm
    gc.collect()
    assert not no_leftover_children.wait_gone(pids)
    assert torch.get_num_threads() == threads, "rank 0's share of the cores was not given back"


def test_a_stalled_worker_times_the_step_out_instead_of_hanging(
        tiny_checkpoint: Callable[..., str], monkeypatch: pytest.MonkeyPatch, no_leftover_children: Processes) -> None:
    """A live but stuck rank (SIGSTOP) sends no error and closes no socket: only the collective's timeout saves us."""
    monkeypatch.setattr(group, "COLLECTIVE_TIMEOUT_S", 2.0)
    with LLM(model=tiny_checkpoint("llama"), **OPTIONS) as llm:
        (pid,) = llm.engine.executor.worker_pids()
        os.kill(pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(RankError, match="rank 0"):
                llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
            assert time.monotonic() - start < 20
        finally:
            os.kill(pid, signal.SIGKILL)  # a stopped process would only take SIGKILL anyway
