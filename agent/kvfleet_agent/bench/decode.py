"""Decode benchmark: tokens/s of pure decode steps per batch size, and each one's share of the memory roofline."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import numpy as np
import torch

from kvfleet_agent.config import KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig
from kvfleet_agent.core.scheduler_output import ScheduledChunk
from kvfleet_agent.models.config import ModelConfig
from kvfleet_agent.sampling_params import SamplingParams
from kvfleet_agent.worker.device import rank_device
from kvfleet_agent.worker.model_runner import ModelRunner
from kvfleet_agent.worker.step_batch import StepBatch, plan_batch
from kvfleet_kernels import kv_quant

# python -m kvfleet_agent.bench.decode --model DIR [--make llama3-8b|tiny] --batch 1 8 32 128 --context 1024 \
#     --dtype bfloat16 [--enforce-eager] [--steps N] [--warmup N] [--json OUT]
#
# The checkpoint shapes live in the shared harness beside the repository (../shared/bench/workload.py), so
# that this figure and the throughput comparison run the very same random model. A GPU machine gets a copy
# of the repository alone, without its siblings: there a shared/ inside it, or --workload, stands in.
REPO = Path(__file__).resolve().parents[3]
SHARED_BENCH_DIRS = (REPO.parent / "shared" / "bench", REPO / "shared" / "bench")
GREEDY = SamplingParams(temperature=0.0, max_tokens=1)
# Large enough to overflow every cache level (an H200's L2 is 60 MiB, a server CPU's L3 up to a few hundred
# MiB) yet quick to copy; the GPU size is the kernel bench's (kvfleet_kernels.bench), so the figures agree.
COPY_BYTES = {"cuda": 2 << 30, "cpu": 256 << 20}
Progress = Callable[[str], None]


@dataclass
class Row:
    """One batch size's figures (also the --json rows)."""

    batch: int
    context: int
    steps: int
    step_ms: float  # median wall time of one step: host work, the forward pass and the greedy pick
    tokens_per_s: float  # batch / median step time
    weight_bytes: int  # parameters read per step: all but the untouched rows of an untied embedding table
    kv_bytes: int  # K and V read per step: batch × the timed steps' mean context, over every layer
    bytes_per_step: int
    ideal_ms: float  # bytes_per_step at the measured copy bandwidth
    roofline_share: float  # ideal_ms / step_ms
    cuda_graphs: bool  # whether every timed step replayed a captured CUDA graph


def fail(message: str) -> NoReturn:
    """Stop with a one-line reason naming the flag at fault (SystemExit prints it; no traceback)."""
    raise SystemExit(f"decode bench: error: {message}")


def stderr_progress(message: str) -> None:
    """Progress goes to stderr, so that stdout carries only the report."""
    print(f"[decode-bench] {message}", file=sys.stderr, flush=True)


def find_workload(explicit: str | None) -> Path:
    """The shared harness's workload.py: --workload, else the first of SHARED_BENCH_DIRS that holds one."""
    if explicit is not None:
        if not Path(explicit).is_file():
            fail(f"--workload {explicit}: no such file (give the path of the shared harness's workload.py)")
        return Path(explicit)
    for folder in SHARED_BENCH_DIRS:
        if (folder / "workload.py").is_file():
            return folder / "workload.py"
    tried = " or ".join(str(folder / "workload.py") for folder in SHARED_BENCH_DIRS)
    fail(f"--make needs the shared benchmark harness, but {tried} is missing; copy "
         "../shared/bench/workload.py somewhere and pass --workload PATH, or make the checkpoint another way "
         "and drop --make")


def load_workload(path: Path) -> ModuleType:
    """workload.py imported by path: it belongs to no package of this repository."""
    spec = importlib.util.spec_from_file_location("kvfleet_shared_workload", path)
    assert spec is not None and spec.loader is not None  # a .py file always has a source loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ensure_checkpoint(model: str, name: str, dtype: str, workload_path: str | None, progress: Progress) -> None:
    """Write the shared harness's random `name` checkpoint into `model` unless one is there already."""
    path = find_workload(workload_path)
    workload = load_workload(path)
    if name not in workload.MODELS:
        fail(f"--make {name}: unknown model; {path} defines {', '.join(sorted(workload.MODELS))}")
    if (Path(model) / "config.json").exists():
        progress(f"{model} already holds a checkpoint: using it as it is (delete it to remake it)")
        return
    progress(f"writing a random {name} checkpoint ({dtype}) to {model} with {path}")
    start = time.perf_counter()
    try:
        workload.make_model(name, model, dtype=dtype)
    except ImportError as e:  # make_model builds the model with transformers, a dev extra
        fail(f"--make needs transformers beside the project (pip install -e '.[dev]'): {e}")
    progress(f"checkpoint written in {time.perf_counter() - start:.0f} s")


def model_len_limit(cfg: ModelConfig) -> int:
    """The longest sequence the engine accepts for this model (LLMEngine._max_model_len's rule)."""
    limit = cfg.max_position_embeddings
    return min(limit, cfg.sliding_window) if cfg.sliding_window else limit


def build_runner(model: str, dtype: str, device: str, max_num_seqs: int, max_model_len: int,
                 blocks_per_seq: int, enforce_eager: bool, quantization: str | None = None,
                 kv_cache_dtype: str = "auto") -> ModelRunner:
    """A runner as LLMEngine builds one, but with a pool of exactly max_num_seqs full sequences.

    Same order as the engine: allocate the pool, warm up, then capture the decode graphs (they read the pool).
    """
    config = EngineConfig(model=model, dtype=dtype, device=device, max_model_len=max_model_len,
                          max_num_seqs=max_num_seqs, enforce_eager=enforce_eager, quantization=quantization,
                          kv_cache_dtype=kv_cache_dtype)
    config.resolve(rank_device(config, 0).type, max_model_len)
    runner = ModelRunner(config, ModelConfig.from_dir(model), max_model_len)
    runner.allocate_kv_cache(max_num_seqs * blocks_per_seq)
    runner.warmup()
    runner.capture_decode_graphs()
    return runner


def block_tables(num_seqs: int, blocks_per_seq: int) -> np.ndarray:
    """[num_seqs, blocks_per_seq]: each sequence owns a run of blocks of its own, as the allocator would give."""
    return np.arange(num_seqs * blocks_per_seq, dtype=np.int64).reshape(num_seqs, blocks_per_seq)


def prefill(runner: ModelRunner, prompts: Sequence[Sequence[int]], tables: np.ndarray,
            progress: Progress) -> np.ndarray:
    """Write every prompt's K/V into its blocks through the engine's own (chunked) prefill; returns the
    greedy first token of each, as the engine's prefill step would sample it.

    Steps hold at most max_num_batched_tokens tokens, as the scheduler would send them.
    """
    budget = runner.config.max_num_batched_tokens or 1024
    steps: list[list[ScheduledChunk]] = [[]]
    room = budget
    for i, prompt in enumerate(prompts):
        table = tables[i].tolist()
        start = 0
        while start < len(prompt):
            if room == 0:
                steps.append([])
                room = budget
            n = min(room, len(prompt) - start)
            last = start + n == len(prompt)
            steps[-1].append(ScheduledChunk(f"seq{i}", list(prompt[start:start + n]), start, table, last, GREEDY))
            start += n
            room -= n
    first: dict[str, int] = {}
    began = time.perf_counter()
    for k, chunks in enumerate(steps):
        batch, samplers = plan_batch(chunks, runner.block_size)
        logits = runner.forward(batch)
        if logits is not None:
            picked = logits.float().argmax(dim=-1).tolist()
            first.update(zip((c.request_id for c in samplers), picked, strict=True))
        if len(steps) > 1 and (k + 1) % max(1, len(steps) // 10) == 0:
            progress(f"  prefill step {k + 1}/{len(steps)} ({time.perf_counter() - began:.1f} s)")
    return np.asarray([first[f"seq{i}"] for i in range(len(prompts))], dtype=np.int64)


def decode_step(runner: ModelRunner, tables: np.ndarray, position: int, tokens: np.ndarray) -> np.ndarray:
    """One pure decode step of every row (each feeds `tokens` at `position`); returns the greedy next tokens.

    The batch is what plan_batch makes of these decode chunks, built vectorised; the pick is the sampler's
    greedy path (argmax of the float logits), read back to the host as every real step's is.
    """
    n, bs = len(tokens), runner.block_size
    positions = np.full(n, position, dtype=np.int64)
    slots = tables[:, position // bs] * bs + position % bs
    batch = StepBatch(tokens, positions, slots, tables, [], np.arange(n, dtype=np.int64))
    logits = runner.forward(batch)
    assert logits is not None  # every row samples
    out: np.ndarray = logits.float().argmax(dim=-1).cpu().numpy()
    return out


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU, where every op has finished on return)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_decode(runner: ModelRunner, tables: np.ndarray, first: np.ndarray, context: int, steps: int,
                warmup: int) -> tuple[list[float], bool]:
    """Seconds of each timed step (after `warmup` untimed ones), decoding from position `context` on, and
    whether every timed step replayed a CUDA graph.

    Wall clock around a synchronized step: a decode step's cost to a user includes its host work (batch
    staging, the token read back), which device events alone would leave out.
    """
    graphs = runner.decode_graphs
    tokens = first
    times: list[float] = []
    runs_before = 0
    for i in range(warmup + steps):
        if i == warmup:
            runs_before = graphs.runs
        sync(runner.device)
        start = time.perf_counter()
        tokens = decode_step(runner, tables, context + i, tokens)
        sync(runner.device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    replayed = graphs.captured and graphs.runs - runs_before == steps
    return times, replayed


def copy_seconds(device: torch.device, nbytes: int) -> float:
    """Median seconds of copying nbytes between two device buffers, after warm-up copies."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    if device.type == "cuda":
        from kvfleet_kernels.bench import time_ms  # CUDA events; the module only defines things on import

        return time_ms(lambda: dst.copy_(src), 3, 20) / 1e3
    times = []
    for i in range(8):
        start = time.perf_counter()
        dst.copy_(src)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read plus written (as
    kvfleet_kernels.bench measures its ceiling)."""
    n = nbytes or COPY_BYTES.get(device.type, COPY_BYTES["cpu"])
    seconds = copy_seconds(device, n)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # hand the buffers' memory back before the model and pool are placed
    return 2 * n / seconds


def kv_bytes_per_step(runner: ModelRunner, batch: int, context: int) -> int:
    """K and V a decode step must read: batch × context tokens × layers × 2 × kv_heads × a row's bytes (head_dim
    elements, and an int8/fp8 cache's scale)."""
    layer = runner.attn_layers[0]
    row = kv_quant.bytes_per_row(layer.head_dim, layer.k_cache.dtype)
    return batch * context * len(runner.attn_layers) * 2 * layer.num_kv_heads * row


def weight_bytes_per_step(runner: ModelRunner, batch: int) -> int:
    """Parameter bytes a decode step must read: all of them, except that an embedding table not shared with
    the LM head is read only at the batch's rows (counting it whole would flatter the share at batch 1)."""
    embed = runner.model.embed_tokens.weight
    if embed is runner.model.lm_head.weight:
        return runner.param_bytes()
    row = embed.shape[1] * embed.element_size()
    return runner.param_bytes() - embed.numel() * embed.element_size() + min(batch, embed.shape[0]) * row


def mean_context(context: int, warmup: int, steps: int) -> float:
    """Tokens each timed step attends to, on average: the step at position p reads p + 1 (its own too), and the
    timed steps sit at positions context + warmup ... context + warmup + steps - 1."""
    return context + warmup + (steps + 1) / 2


def machine(device: torch.device) -> dict[str, str]:
    """Where the figures come from: device name, torch and triton versions."""
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = "not installed"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} torch threads)"
    return {"device": name, "torch": torch.__version__, "triton": triton_version, "python": platform.python_version()}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, with every bound checked before anything loads."""
    p = argparse.ArgumentParser(prog="python -m kvfleet_agent.bench.decode", description=__doc__)
    p.add_argument("--model", required=True, help="checkpoint directory (Hugging Face format)")
    p.add_argument("--make", metavar="NAME", help="first write the shared harness's random NAME checkpoint "
                   "(llama3-8b, tiny) into --model, unless it holds one already")
    p.add_argument("--workload", metavar="PATH", help="the shared harness's workload.py for --make (default: "
                   "../shared/bench/workload.py beside the repository, else shared/bench/workload.py in it)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128], help="decode batch sizes")
    p.add_argument("--context", type=int, default=1024, help="cached tokens per sequence before the timed steps")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (every kernel launched per step)")
    p.add_argument("--quantization", choices=list(QUANTIZATIONS), default=None,
                   help="as the engine's flag: int8/int4 quantize on load; the roofline counts the bytes held")
    p.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                   help="as the engine's flag; the roofline counts the cache's bytes (scales included)")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps per batch size")
    p.add_argument("--warmup", type=int, default=8, help="untimed decode steps before them")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt tokens")
    p.add_argument("--json", metavar="OUT", help="also write the figures to this JSON file")
    a = p.parse_args(argv)
    for flag, value, least in (("--context", a.context, 1), ("--steps", a.steps, 1), ("--warmup", a.warmup, 0)):
        if value < least:
            p.error(f"{flag} {value}: must be at least {least}")
    bad = [b for b in a.batch if b < 1]
    if bad:
        p.error(f"--batch {bad[0]}: every batch size must be at least 1")
    return a


def run(a: argparse.Namespace, argv: Sequence[str], progress: Progress = stderr_progress) -> dict[str, object]:
    """Build the runner, measure the copy bandwidth, then time each batch size; returns the whole report."""
    if a.make:
        ensure_checkpoint(a.model, a.make, a.dtype, a.workload, progress)
    try:
        cfg = ModelConfig.from_dir(a.model)
    except (OSError, ValueError) as e:
        fail(f"--model {a.model}: {e}")
    max_model_len = a.context + a.warmup + a.steps  # the last timed step attends over this many tokens
    limit = model_len_limit(cfg)
    if max_model_len > limit:
        fail(f"--context {a.context} plus --warmup {a.warmup} and --steps {a.steps} decoded tokens make "
             f"{max_model_len} tokens a sequence, more than {a.model} supports ({limit}, from config.json "
             "max_position_embeddings / sliding_window): lower --context or --steps")
    max_batch = max(a.batch)
    try:
        device = rank_device(EngineConfig(model=a.model, device=a.device), 0)  # where the runner will be
    except ValueError as e:
        fail(f"--device {a.device}: {e}")
    progress(f"measuring the copy bandwidth of {device}")
    bandwidth = copy_bandwidth(device)
    progress(f"loading {a.model} ({a.dtype}) on {device}, pool for {max_batch} x {max_model_len} tokens")
    start = time.perf_counter()
    blocks_per_seq = -(-max_model_len // EngineConfig(model=a.model).block_size)  # the engine's default
    runner = build_runner(a.model, a.dtype, a.device, max_batch, max_model_len, blocks_per_seq, a.enforce_eager,
                          a.quantization, a.kv_cache_dtype)
    progress(f"runner ready in {time.perf_counter() - start:.1f} s; CUDA graphs captured: "
             f"{runner.decode_graphs.captured}")
    tables = block_tables(max_batch, blocks_per_seq)
    rng = np.random.default_rng(a.seed)
    # Token ids above the usual special ones (BOS/EOS/pad sit low in every vocabulary here).
    prompts = rng.integers(4, cfg.vocab_size, size=(max_batch, a.context)).tolist()
    # One prefill for the largest batch; each batch size decodes its first B sequences from position `context`,
    # overwriting the previous batch size's decoded K/V, so every row starts from the same cache.
    progress(f"prefilling {max_batch} sequences of {a.context} tokens")
    first = prefill(runner, prompts, tables, progress)
    rows: list[Row] = []
    for b in a.batch:
        progress(f"batch {b}: {a.warmup} warm-up + {a.steps} timed decode steps")
        times, graphs = time_decode(runner, tables[:b], first[:b], a.context, a.steps, a.warmup)
        step = statistics.median(times)
        weights = weight_bytes_per_step(runner, b)
        kv = round(kv_bytes_per_step(runner, b, 1) * mean_context(a.context, a.warmup, a.steps))
        ideal = (weights + kv) / bandwidth
        rows.append(Row(b, a.context, a.steps, step * 1e3, b / step, weights, kv, weights + kv, ideal * 1e3,
                        ideal / step, graphs))
        progress(f"batch {b}: {step * 1e3:.2f} ms a step, {b / step:.1f} tokens/s")
    return {"machine": machine(device), "command": command_line(argv), "model": a.model,
            "dtype": str(runner.dtype).removeprefix("torch."), "quantization": a.quantization,
            "kv_cache_dtype": a.kv_cache_dtype, "copy_bandwidth_gbs": bandwidth / 1e9,
            "rows": [asdict(r) for r in rows]}


def command_line(argv: Sequence[str]) -> str:
    """The exact invocation, ready to paste."""
    return shlex.join(["python", "-m", "kvfleet_agent.bench.decode", *argv])


def format_report(report: dict[str, object]) -> str:
    """The header lines and one table row per batch size."""
    m = report["machine"]
    assert isinstance(m, dict)
    rows = report["rows"]
    assert isinstance(rows, list)
    lines = [f"machine: {m['device']}; torch {m['torch']}, triton {m['triton']}, python {m['python']}",
             f"command: {report['command']}",
             f"dtype: {report['dtype']}, quantization {report.get('quantization') or 'none'}, "
             f"KV cache {report.get('kv_cache_dtype', 'auto')}; "
             f"copy bandwidth {report['copy_bandwidth_gbs']:.1f} GB/s (read + write); "
             "roofline: (weights + K/V of batch x context tokens) / copy bandwidth",
             f"{'batch':>6} {'context':>8} {'step ms':>9} {'tokens/s':>10} {'GB/step':>8} {'roofline':>9} "
             f"{'graphs':>7}"]
    for r in rows:
        lines.append(f"{r['batch']:>6} {r['context']:>8} {r['step_ms']:>9.3f} {r['tokens_per_s']:>10.1f} "
                     f"{r['bytes_per_step'] / 1e9:>8.4g} {r['roofline_share'] * 100:>8.3g}% "
                     f"{'yes' if r['cuda_graphs'] else 'no':>7}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, run, print the table (and write --json)."""
    args = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(args)
    report = run(a, args)
    print(format_report(report))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
