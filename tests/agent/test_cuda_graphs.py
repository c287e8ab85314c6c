"""The fixed-shape decode path on CPU: padded static-buffer steps equal the normal forward, and who takes which path."""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from llm_helpers import ENGINE_OPTIONS
from runner_helpers import Sequences, make_runner, snapshot, written_elsewhere

from kvfleet_agent import LLM, SamplingParams, cli
from kvfleet_agent.config import EngineConfig
from kvfleet_agent.core.scheduler_output import ScheduledChunk
from kvfleet_agent.layers import gemm_crossover
from kvfleet_agent.llm import TokensPrompt
from kvfleet_agent.worker.cuda_graphs import DecodeGraphRunner, capture_sizes
from kvfleet_agent.worker.device import to_device
from kvfleet_agent.worker.kv_budget import kv_budget_from_profile
from kvfleet_agent.worker.step_batch import plan_batch, profile_batch

GiB = 1 << 30
# Contexts of 1 to 37 tokens: with 4-token blocks the longest spans ten blocks.
LENGTHS = [37, 1, 12, 5, 20, 3, 30, 8, 2]


@pytest.fixture(autouse=True)
def same_kernels_for_every_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every batch here, padded or not (1-16 rows), on the linears' few-row path: a crossover measured by timing had
    put 3 rows on the tiles and their padded 4 on oneDNN in a loaded CI run, and the two agree to rounding, not to
    the 1e-5 these tests hold the padded path to. (Subprocesses inherit it.)"""
    monkeypatch.setenv(gemm_crossover.PIN_ENV, "32")


def test_capture_sizes_follow_vllm() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(5) == [1, 2, 4, 8]  # the largest covers max_num_seqs
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]
    assert capture_sizes(1000) == [1, 2, 4, *range(8, 257, 8)]


def test_a_batch_runs_at_the_smallest_size_that_holds_it() -> None:
    graphs = DecodeGraphRunner(torch.nn.Identity(), 8, torch.float32, torch.device("cpu"), 300, 64, 4)
    assert graphs.sizes[-1] == graphs.max_batch == 256
    expected = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8, 9: 16, 17: 24, 249: 256, 256: 256, 257: None, 1000: None}
    assert {n: graphs.size_for(n) for n in expected} == expected


@pytest.mark.parametrize("rows", [1, 3, 5, 9])
def test_padded_decode_equals_the_normal_forward(ckpt: Path, rows: int) -> None:
    runner = make_runner(ckpt)
    graphs = runner.decode_graphs
    seqs = Sequences(runner, seed=rows)
    names = seqs.prefill(LENGTHS[:rows])
    for step in range(3):  # contexts grow; 12 → 13 crosses into a new block
        batch = seqs.decode_batch(names)
        size = graphs.accepts(batch)
        assert size == {1: 1, 3: 4, 5: 8, 9: 16}[rows]
        eager = runner.forward(batch)
        before = snapshot(runner)
        graphs.activate()
        runs = graphs.runs
        padded = runner.forward(batch)
        graphs.release()
        assert graphs.runs == runs + 1, "the step did not take the padded path"
        assert eager is not None and padded is not None
        torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
        # Padding rows wrote no K/V anywhere: only the real rows' slots may differ.
        assert not written_elsewhere(before, runner, batch.slot_mapping.tolist()), f"step {step}"


def test_padded_decode_does_not_depend_on_what_the_padding_rows_held(ckpt: Path) -> None:
    """A 5-row batch after a 7-row one at the same size (8): the stale rows 5..6 of the buffers must not run."""
    runner = make_runner(ckpt)
    graphs = runner.decode_graphs
    seqs = Sequences(runner, seed=7)
    names = seqs.prefill(LENGTHS[:7])
    graphs.activate()
    runner.forward(seqs.decode_batch(names))
    for name in names[5:]:  # new contents: a stale row re-run now would write K/V that differs from the cache's
        seqs.rewrite(name)
    batch = seqs.decode_batch(names[:5])
    before = snapshot(runner)
    padded = runner.forward(batch)
    graphs.release()
    assert graphs.runs == 2
    assert not written_elsewhere(before, runner, batch.slot_mapping.tolist())
    torch.testing.assert_close(padded, runner.forward(batch), rtol=1e-5, atol=1e-5)


# The same checks through the Triton kernels (the GPU's, interpreted on CPU): negative slots skipped by the
# kernel, contexts bounded by the table width. A child process: Triton's interpreter is chosen before import.
INTERPRETED = f"""
import sys
import torch
from runner_helpers import Sequences, make_runner, snapshot, written_elsewhere
from kvfleet_kernels import dispatch
runner = make_runner(sys.argv[1], max_num_batched_tokens=64)
assert dispatch.backend(runner.attn_layers[0].k_cache) == "interpreter"
for rows in (3, 9):
    seqs = Sequences(runner, seed=rows)
    names = seqs.prefill({LENGTHS!r}[:rows])
    batch = seqs.decode_batch(names)
    eager = runner.forward(batch)
    before = snapshot(runner)
    runner.decode_graphs.activate()
    padded = runner.forward(batch)
    runner.decode_graphs.release()
    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
    assert not written_elsewhere(before, runner, batch.slot_mapping.tolist()), "a padding row wrote K/V"
before = snapshot(runner)
assert runner.profile_run() == 64
assert not written_elsewhere(before, runner, []), "the profiling pass wrote K/V"
print("checked", runner.decode_graphs.runs, "padded steps")
"""


@pytest.mark.slow
def test_padded_decode_through_the_triton_kernels_in_the_interpreter(ckpt: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "KVFLEET_FORCE_TRITON": "1",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run([sys.executable, "-c", INTERPRETED, str(ckpt)], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "checked 2 padded steps" in proc.stdout


def test_only_a_pure_decode_batch_that_fits_takes_the_padded_path(ckpt: Path) -> None:
    runner = make_runner(ckpt, max_num_seqs=4)
    graphs = runner.decode_graphs
    assert graphs.sizes == [1, 2, 4]
    seqs = Sequences(runner, seed=3)
    names = seqs.prefill(LENGTHS[:5])
    graphs.activate()
    too_many = seqs.decode_batch(names)
    table = list(range(seqs.next_block, seqs.next_block + 2))  # blocks no sequence holds
    prefill = ScheduledChunk("new", [5, 6, 7], 0, table, True, SamplingParams(temperature=0.0))
    mixed = plan_batch([*seqs.decode_chunks(names[:2]), prefill], runner.block_size)[0]
    assert graphs.accepts(too_many) is None  # 5 rows, above the largest size
    assert graphs.accepts(mixed) is None  # a prefill inside
    for batch in (too_many, mixed):
        logits = runner.forward(batch)
        assert logits is not None and logits.shape[0] == len(batch.sample_rows)
    assert graphs.runs == 0, "a batch went through the padded path that cannot hold it"
    assert graphs.accepts(seqs.decode_batch(names[:3])) == 4


def test_an_engine_decoding_through_the_padded_path_generates_the_same_tokens(ckpt: Path) -> None:
    rng = random.Random(0)
    prompts: list[TokensPrompt] = [{"prompt_token_ids": [rng.randrange(4, 500) for _ in range(rng.randint(1, 40))]}
                                   for _ in range(11)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = LLM(model=str(ckpt), dtype="float32", **ENGINE_OPTIONS)
    padded = LLM(model=str(ckpt), dtype="float32", **ENGINE_OPTIONS)
    graphs = padded.engine.runner.decode_graphs
    assert not graphs.active and not graphs.captured, "nothing is captured or routed on CPU"
    graphs.activate()  # what capture does on a GPU, here without graphs: the same padded forward, eagerly
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in padded.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert graphs.runs >= 10, f"only {graphs.runs} steps took the padded path"


def test_kv_budget_from_profile_arithmetic() -> None:
    # 80 GiB card, 0.9 of it ours: 1 GiB outside torch (context), 16 GiB weights, a 6 GiB activation peak.
    free = 80 * GiB - 1 * GiB - 16 * GiB
    assert kv_budget_from_profile(80 * GiB, free, 16 * GiB, 22 * GiB, 0.9) == int(72 * GiB) - 23 * GiB
    assert kv_budget_from_profile(80 * GiB, free, 16 * GiB, 22 * GiB, 0.9, reserve=GiB) == int(72 * GiB) - 24 * GiB
    # Another process's 10 GiB counts against the share too.
    assert kv_budget_from_profile(80 * GiB, free - 10 * GiB, 16 * GiB, 22 * GiB, 0.9) == int(72 * GiB) - 33 * GiB
    # Torch's cached-but-free blocks: only the peak counts, not what the pass left cached.
    assert kv_budget_from_profile(80 * GiB, free - 2 * GiB, 18 * GiB, 22 * GiB, 0.9) == int(72 * GiB) - 23 * GiB
    assert kv_budget_from_profile(80 * GiB, free, 16 * GiB, 22 * GiB, 0.2) == 0  # never negative


@pytest.mark.parametrize(("tokens", "seqs", "max_len"), [(1024, 16, 128), (1000, 3, 512), (8, 16, 64),
                                                         (1000, 3, 128)])
def test_profile_batch_is_the_largest_step_and_writes_nothing(tokens: int, seqs: int, max_len: int) -> None:
    batch = profile_batch(tokens, seqs, max_len)
    lens = [n for _, n, _, _ in batch.prefills]
    assert len(lens) == min(seqs, tokens) and max(lens) - min(lens) <= 1 and max(lens) <= max_len
    assert len(batch.input_ids) == sum(lens) == min(tokens, seqs * max_len)
    assert (batch.slot_mapping == -1).all() and batch.decode_tables.shape[0] == 0
    assert all(ctx == 0 for _, _, ctx, _ in batch.prefills)
    assert batch.positions.tolist() == [p for n in lens for p in range(n)]
    assert batch.sample_rows.tolist() == [s + n - 1 for s, n, _, _ in batch.prefills]


def test_profile_run_on_cpu_leaves_the_pool_untouched(ckpt: Path) -> None:
    runner = make_runner(ckpt, max_num_batched_tokens=100, max_num_seqs=3)
    Sequences(runner, seed=1).prefill([9, 20])
    before = snapshot(runner)
    assert runner.profile_run() == 100
    assert not written_elsewhere(before, runner, [])
    assert not runner.sampler.generators, "the profiling rows' generators were kept"


def test_to_device_on_cpu_shares_the_numpy_memory() -> None:
    a, b = np.arange(6, dtype=np.int64).reshape(2, 3), np.zeros(0, dtype=np.int64)
    ta, tb = to_device([a, b], torch.device("cpu"))
    a[0, 0] = 42
    assert ta.shape == (2, 3) and int(ta[0, 0]) == 42 and tb.shape == (0,)


def test_enforce_eager_is_validated_and_reaches_the_engine_config(tiny_checkpoint: Callable[..., str]) -> None:
    assert EngineConfig(model="m").enforce_eager is False
    assert EngineConfig.from_kwargs("m", enforce_eager=True).enforce_eager is True
    with pytest.raises(ValueError, match=r"engine option enforce_eager='yes' is invalid: use true or false"):
        EngineConfig(model="m", enforce_eager="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="enforce_eager=1 is invalid"):
        EngineConfig(model="m", enforce_eager=1)  # type: ignore[arg-type]
    parser = argparse.ArgumentParser()
    cli._engine_flags(parser)
    assert cli._engine_options(parser.parse_args([]))["enforce_eager"] is False
    assert cli._engine_options(parser.parse_args(["--enforce-eager"]))["enforce_eager"] is True


def test_the_cli_runs_with_enforce_eager(tiny_checkpoint: Callable[..., str], capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    code = cli.main(["generate", "--model", tiny_checkpoint("llama"), "--prompt", "hello", "--max-tokens", "3",
                     "--max-model-len", "64", "--enforce-eager", "--ignore-eos"])
    assert code == 0
    assert "[3 tokens, length]" in capsys.readouterr().out
