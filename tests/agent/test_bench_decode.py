"""The decode bench on a tiny checkpoint: its rows, byte accounting and errors, and that it times real decoding."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path
from typing import Any

import pytest
from llm_helpers import ENGINE_OPTIONS, greedy
from safetensors import safe_open

from kvfleet_agent.bench import decode
from kvfleet_agent.llm import LLM
from kvfleet_agent.models.config import ModelConfig

FAST = ["--dtype", "float32", "--device", "cpu", "--steps", "3", "--warmup", "1"]


@pytest.fixture(autouse=True)
def small_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 16 MiB bandwidth probe: the figure only has to be positive here, not cache-proof."""
    monkeypatch.setitem(decode.COPY_BYTES, "cpu", 16 << 20)


def bench(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[dict[str, Any], str]:
    """Run the CLI with --json; returns the parsed report and what it printed on stdout."""
    out = tmp_path / f"report-{len(list(tmp_path.iterdir()))}.json"
    assert decode.main([*args, "--json", str(out)]) == 0
    report: dict[str, Any] = json.loads(out.read_text())
    return report, capsys.readouterr().out


def kv_bytes_per_token(ckpt: Path) -> int:
    """K and V of one token over every layer, in float32, from config.json by hand."""
    cfg = ModelConfig.from_dir(str(ckpt))
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4


def checkpoint_bytes(ckpt: Path) -> int:
    """Float32 bytes of every tensor in the checkpoint's safetensors files."""
    total = 0
    for path in ckpt.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            names = f.keys()
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in names) * 4
    return total


def test_one_row_per_batch_with_consistent_figures(ckpt: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model", str(ckpt), "--batch", "1", "3", "--context", "16", *FAST]
    report, stdout = bench(tmp_path, capsys, *args)
    rows = report["rows"]
    assert [r["batch"] for r in rows] == [1, 3]
    per_token = kv_bytes_per_token(ckpt)
    cfg = ModelConfig.from_dir(str(ckpt))
    assert not cfg.tie_word_embeddings
    embed_row = cfg.hidden_size * 4
    for r in rows:
        assert r["context"] == 16 and r["steps"] == 3
        assert r["tokens_per_s"] == pytest.approx(r["batch"] / (r["step_ms"] / 1e3))
        # Every parameter once, except the embedding table: only the batch's rows of it are read.
        assert r["weight_bytes"] == checkpoint_bytes(ckpt) - cfg.vocab_size * embed_row + r["batch"] * embed_row
        # The timed steps sit at positions 17, 18 and 19 (after 16 prefilled and 1 warm-up): 18, 19 and 20
        # tokens attended, 19 on average.
        assert r["kv_bytes"] == r["batch"] * 19 * per_token
        assert r["bytes_per_step"] == r["weight_bytes"] + r["kv_bytes"]
        assert r["ideal_ms"] == pytest.approx(r["bytes_per_step"] / (report["copy_bandwidth_gbs"] * 1e9) * 1e3)
        assert r["roofline_share"] == pytest.approx(r["ideal_ms"] / r["step_ms"])
        assert r["roofline_share"] > 0 and math.isfinite(r["roofline_share"])
        assert r["cuda_graphs"] is False  # nothing is captured on a CPU
    assert rows[1]["bytes_per_step"] - rows[0]["bytes_per_step"] == 2 * 19 * per_token + 2 * embed_row
    assert report["dtype"] == "float32"
    command = shlex.split(report["command"])
    assert command[:3] == ["python", "-m", "kvfleet_agent.bench.decode"] and command[3:-2] == args
    # stdout is the report alone (progress goes to stderr): header lines, then one row per batch size.
    lines = stdout.strip().splitlines()
    assert lines[0].startswith("machine: CPU") and lines[1] == f"command: {report['command']}"
    assert [line.split()[:2] for line in lines[-2:]] == [["1", "16"], ["3", "16"]]


def test_kv_bytes_grow_with_context(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    short, _ = bench(tmp_path, capsys, "--model", str(ckpt), "--batch", "2", "--context", "8", *FAST)
    long, _ = bench(tmp_path, capsys, "--model", str(ckpt), "--batch", "2", "--context", "40", *FAST)
    grown = long["rows"][0]["bytes_per_step"] - short["rows"][0]["bytes_per_step"]
    assert grown == 2 * (40 - 8) * kv_bytes_per_token(ckpt)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_a_one_byte_kv_cache_counts_its_codes_and_scales(ckpt: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str], kv_dtype: str) -> None:
    args = ["--model", str(ckpt), "--batch", "2", *FAST, "--kv-cache-dtype", kv_dtype]
    short, _ = bench(tmp_path, capsys, *args, "--context", "8")
    long, out = bench(tmp_path, capsys, *args, "--context", "40")
    grown = long["rows"][0]["bytes_per_step"] - short["rows"][0]["bytes_per_step"]
    head_dim = ModelConfig.from_dir(str(ckpt)).head_dim
    # A row of head_dim float32 values becomes head_dim one-byte codes and one float32 scale.
    assert grown == 2 * (40 - 8) * kv_bytes_per_token(ckpt) * (head_dim + 4) // (4 * head_dim)
    assert long["kv_cache_dtype"] == kv_dtype and f"KV cache {kv_dtype}" in out


def test_decode_step_generates_what_the_engine_generates(ckpt: Path) -> None:
    """Greedy tokens through the bench's prefill and decode_step equal LLM.generate's, row by row: the bench
    times real decoding over each row's own cached context, not some cheaper stand-in."""
    prompts = [[(7 * i + 3 * j) % 700 + 4 for j in range(n)] for i, n in enumerate((20, 20, 20))]
    new_tokens = 6
    max_len = 20 + new_tokens + 1
    blocks = -(-max_len // 16)
    runner = decode.build_runner(str(ckpt), "float32", "cpu", len(prompts), max_len, blocks, enforce_eager=False)
    tables = decode.block_tables(len(prompts), blocks)
    tokens = decode.prefill(runner, prompts, tables, lambda _: None)
    got = [[int(t)] for t in tokens]
    for i in range(new_tokens):
        tokens = decode.decode_step(runner, tables, 20 + i, tokens)
        for row, t in zip(got, tokens, strict=True):
            row.append(int(t))
    with LLM(model=str(ckpt), **ENGINE_OPTIONS) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(new_tokens + 1), use_tqdm=False)
    assert got == [list(o.outputs[0].token_ids) for o in outs]


def test_prefill_splits_prompts_over_the_token_budget(ckpt: Path) -> None:
    """Prompts longer than a step's budget go in chunks, yet yield the same first tokens as one whole step."""
    prompts = [[(5 * j) % 600 + 4 for j in range(40)], [(11 * j) % 600 + 4 for j in range(30)]]
    runners = [decode.build_runner(str(ckpt), "float32", "cpu", 2, 48, 3, enforce_eager=False) for _ in range(2)]
    assert runners[0].config.max_num_batched_tokens is not None
    runners[1].config.max_num_batched_tokens = 16  # 70 tokens: five steps, prompts split mid-way
    steps: list[str] = []
    tables = decode.block_tables(2, 3)
    whole = decode.prefill(runners[0], prompts, tables, steps.append)
    chunked = decode.prefill(runners[1], prompts, tables, steps.append)
    assert whole.tolist() == chunked.tolist()
    assert any("prefill step 5/5" in s for s in steps)


@pytest.mark.parametrize(("args", "flag"), [
    (["--batch", "1", "0"], "--batch 0"),
    (["--batch", "-2"], "--batch -2"),
    (["--context", "0"], "--context 0"),
    (["--steps", "0"], "--steps 0"),
])
def test_bad_sizes_name_their_flag(ckpt: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                   flag: str) -> None:
    with pytest.raises(SystemExit) as e:
        decode.main(["--model", str(ckpt), *args])
    assert e.value.code == 2  # argparse's usage error, before anything is loaded
    assert flag in capsys.readouterr().err


def test_context_beyond_the_model_names_the_flag(ckpt: Path) -> None:
    limit = ModelConfig.from_dir(str(ckpt)).max_position_embeddings
    with pytest.raises(SystemExit) as e:
        decode.main(["--model", str(ckpt), "--context", str(limit), *FAST])
    message = str(e.value.code)
    assert f"--context {limit}" in message and f"({limit}," in message and "lower --context" in message


def test_unknown_device_names_the_flag(ckpt: Path) -> None:
    with pytest.raises(SystemExit) as e:
        decode.main(["--model", str(ckpt), "--device", "tpu", "--context", "8"])
    assert str(e.value.code).startswith("decode bench: error: --device tpu:")


def test_make_without_the_shared_harness_names_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    places = (tmp_path / "beside" / "bench", tmp_path / "inside" / "bench")
    monkeypatch.setattr(decode, "SHARED_BENCH_DIRS", places)
    with pytest.raises(SystemExit) as e:
        decode.main(["--model", str(tmp_path / "ckpt"), "--make", "tiny", *FAST])
    assert all(str(p / "workload.py") in str(e.value.code) for p in places) and "--workload" in str(e.value.code)
    with pytest.raises(SystemExit) as e:
        decode.main(["--model", str(tmp_path / "ckpt"), "--make", "tiny", "--workload", str(tmp_path / "w.py")])
    assert f"--workload {tmp_path / 'w.py'}: no such file" in str(e.value.code)
    assert not (tmp_path / "ckpt").exists()


def test_make_writes_the_checkpoint_once_in_the_asked_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """--make goes through the shared harness's make_model (a stand-in here, writing a tiny checkpoint), found
    in the second place looked at (a shared/ inside the repository, as on a GPU machine)."""
    shared = tmp_path / "inside"
    shared.mkdir()
    (shared / "workload.py").write_text(
        "import json, pathlib\n"
        "from kvfleet_agent.models.tiny import init_tiny\n"
        "MODELS = {'tiny': {}, 'llama3-8b': {}}\n"
        "def make_model(name, out_dir, seed=0, dtype='float32'):\n"
        "    init_tiny(out_dir)\n"
        "    log = pathlib.Path(out_dir).parent / 'made.json'\n"
        "    calls = json.loads(log.read_text()) if log.exists() else []\n"
        "    log.write_text(json.dumps(calls + [[name, dtype]]))\n"
        "    return out_dir\n")
    monkeypatch.setattr(decode, "SHARED_BENCH_DIRS", (tmp_path / "beside", shared))
    model = tmp_path / "ckpt"
    args = ["--model", str(model), "--make", "tiny", "--batch", "1", "--context", "4", *FAST]
    first, _ = bench(tmp_path, capsys, *args)
    again, _ = bench(tmp_path, capsys, *args)
    assert json.loads((tmp_path / "made.json").read_text()) == [["tiny", "float32"]]  # the second run reused it
    assert [r["batch"] for r in first["rows"]] == [r["batch"] for r in again["rows"]] == [1]
    with pytest.raises(SystemExit) as e:
        decode.main(["--model", str(tmp_path / "other"), "--make", "llama3-70b", *FAST])
    assert "--make llama3-70b" in str(e.value.code) and "llama3-8b, tiny" in str(e.value.code)
    # --workload names the file outright, wherever it is.
    third, _ = bench(tmp_path, capsys, *args[:4], "--workload", str(shared / "workload.py"), *args[4:])
    assert [r["batch"] for r in third["rows"]] == [1]


@pytest.mark.gpu
def test_graphs_replay_unless_eager_on_gpu(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--model", str(ckpt), "--device", "cuda", "--dtype", "bfloat16", "--batch", "1", "8",
              "--context", "64", "--steps", "5", "--warmup", "2"]
    graphed, _ = bench(tmp_path, capsys, *common)
    eager, _ = bench(tmp_path, capsys, *common, "--enforce-eager")
    assert [r["cuda_graphs"] for r in graphed["rows"]] == [True, True]
    assert [r["cuda_graphs"] for r in eager["rows"]] == [False, False]
    assert all(0 < r["roofline_share"] <= 1.2 for r in graphed["rows"])  # a step cannot beat the copy by much
