"""The runner's GPU path: captured decode graphs replay the eager logits, the profiled KV budget, pinned staging."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from llm_helpers import ENGINE_OPTIONS
from runner_helpers import Sequences, make_runner

from kvfleet_agent import LLM, SamplingParams
from kvfleet_agent.llm import TokensPrompt
from kvfleet_agent.worker.device import host_buffer, to_device
from kvfleet_agent.worker.model_runner import ModelRunner
from kvfleet_agent.worker.step_batch import StepBatch

pytestmark = pytest.mark.gpu  # conftest skips these without CUDA ("needs a CUDA GPU")

LENGTHS = [37, 1, 12, 5, 20, 3, 30, 8, 2]
TOL = 1e-4  # float32 (rtol and atol); eager and graph batches differ in size, so may their GEMM kernels


@pytest.fixture
def runner(ckpt: Path) -> Iterator[ModelRunner]:
    """A runner on the GPU with a small pool and its decode graphs captured (sizes 1, 2, 4, 8, 16)."""
    r = make_runner(ckpt, device="cuda")
    r.capture_decode_graphs()
    assert r.decode_graphs.captured and r.decode_graphs.active
    assert sorted(r.decode_graphs.graphs) == [1, 2, 4, 8, 16]
    yield r
    r.decode_graphs.release()
    torch.cuda.empty_cache()


def eager_logits(runner: ModelRunner, batch: StepBatch) -> torch.Tensor:
    """The same step through the normal eager forward (the graphs stay captured)."""
    runner.decode_graphs.active = False
    try:
        logits = runner.forward(batch)
    finally:
        runner.decode_graphs.active = True
    assert logits is not None
    return logits


@pytest.mark.parametrize("rows", [1, 3, 5, 9])
def test_replayed_graphs_give_the_eager_logits(runner: ModelRunner, rows: int) -> None:
    graphs = runner.decode_graphs
    seqs = Sequences(runner, seed=rows)
    names = seqs.prefill(LENGTHS[:rows])
    for _ in range(3):  # contexts grow; 12 → 13 crosses into a new block
        batch = seqs.decode_batch(names)
        runs = graphs.runs
        replayed = runner.forward(batch)
        assert graphs.runs == runs + 1, "the step did not replay a graph"
        assert replayed is not None and torch.isfinite(replayed).all()
        torch.testing.assert_close(replayed, eager_logits(runner, batch), rtol=TOL, atol=TOL)


def test_graphs_read_the_live_cache(runner: ModelRunner) -> None:
    seqs = Sequences(runner, seed=11)
    names = seqs.prefill([20, 7, 33])
    batch = seqs.decode_batch(names)
    first = runner.forward(batch)
    for name in names:  # new tokens, so new K/V, in the same blocks
        seqs.rewrite(name)
    second = runner.forward(batch)
    assert first is not None and second is not None
    assert (second - first).abs().max() > 1e-3, "the replay did not see the new cache contents"
    torch.testing.assert_close(second, eager_logits(runner, batch), rtol=TOL, atol=TOL)
    runner.attn_layers[0].k_cache.zero_()  # in place: the graphs hold this very tensor
    third = runner.forward(batch)
    assert third is not None and (third - second).abs().max() > 1e-3
    torch.testing.assert_close(third, eager_logits(runner, batch), rtol=TOL, atol=TOL)


def test_greedy_generation_with_graphs_equals_enforce_eager(ckpt: Path) -> None:
    rng = random.Random(0)
    prompts: list[TokensPrompt] = [{"prompt_token_ids": [rng.randrange(4, 500) for _ in range(rng.randint(1, 60))]}
                                   for _ in range(13)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    options = {**ENGINE_OPTIONS, "device": "cuda", "dtype": "float32"}
    eager = LLM(model=str(ckpt), enforce_eager=True, **options)
    assert not eager.engine.runner.decode_graphs.captured and not eager.engine.runner.decode_graphs.active
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    del eager
    graphed = LLM(model=str(ckpt), **options)
    graphs = graphed.engine.runner.decode_graphs
    assert graphs.captured
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert graphs.runs >= 15, f"only {graphs.runs} steps replayed a graph"


def test_the_profiled_kv_budget_is_positive_and_fits_in_free_memory(ckpt: Path) -> None:
    runner = make_runner(ckpt, device="cuda", num_blocks=None, kv_cache_memory_bytes=None,
                         gpu_memory_utilization=0.5, max_num_batched_tokens=2048)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    budget = runner.kv_budget_bytes()
    assert 0 < budget < free
    assert budget <= total * 0.5
    assert runner.num_blocks == 0, "profiling allocated the pool"


def test_an_engine_sizes_its_pool_by_profiling_then_captures(ckpt: Path) -> None:
    options = {k: v for k, v in ENGINE_OPTIONS.items() if k != "kv_cache_memory_bytes"}
    llm = LLM(model=str(ckpt), device="cuda", dtype="float32", gpu_memory_utilization=0.05, **options)
    runner = llm.engine.runner
    total = torch.cuda.mem_get_info()[1]
    assert 0 < runner.num_blocks * runner.bytes_per_block() <= total * 0.05
    assert runner.decode_graphs.captured
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=8,
                                                                         ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


def test_step_metadata_is_staged_in_pinned_memory() -> None:
    cuda = torch.device("cuda")
    assert host_buffer(16, cuda).is_pinned()
    a, b = np.arange(12, dtype=np.int64).reshape(3, 4), np.array([7, 8], dtype=np.int64)
    ta, tb = to_device([a, b], cuda)
    torch.cuda.synchronize()
    assert ta.is_cuda and tb.is_cuda
    assert ta.cpu().numpy().tolist() == a.tolist() and tb.cpu().numpy().tolist() == b.tolist()
