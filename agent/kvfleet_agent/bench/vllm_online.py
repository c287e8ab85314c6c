"""`python -m kvfleet_agent.bench.vllm_online`: kvfleet's server against vLLM's CPU server under the same Poisson loads.

The two servers run one at a time on the same checkpoint (the shared workload's, ../shared/bench/workload.py), vLLM
with its OpenMP threads bound to every core and none reserved, as the shared harness binds it. Each is driven at
every --rates value by two load generators in turn, vLLM's own `vllm bench serve` (random dataset: fixed prompt and
output lengths, ignore_eos) and kvfleet's `kvfleet-agent bench serve` (synthetic prompts of about the same length),
each load with its own seed (its own prompts, the same against both servers: see load_seeds), after 8 warm-up
requests that are not counted. It prints TTFT and ITL
p50 / p99 per rate and generator, the two servers side by side, and their ratio (vLLM's over kvfleet's: above 1
means kvfleet is lower).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvfleet_agent.bench.decode import find_workload, load_workload
from kvfleet_agent.bench.dtype_agreement import vllm_env

SERVERS = ("kvfleet", "vllm")
GENERATORS = ("vllm bench", "kvfleet bench")
METRICS = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")
READY_S = 600.0  # vLLM compiles the model at start-up: 34-41 s for `tiny` on 2 cores, far more on a loaded machine


def write_tokenizer(model_dir: str) -> None:
    """The tiny checkpoints' BPE, with an added token for every id above its vocabulary up to the model's: a random
    model samples ids anywhere in its vocabulary, and an id without text would stream as an empty chunk, which a
    client's TTFT and ITL (counted on text) do not see."""
    from tokenizers import Tokenizer

    from kvfleet_agent.models.tiny_tokenizer import tiny_tokenizer_json

    tok = Tokenizer.from_str(tiny_tokenizer_json())
    vocab = json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]
    tok.add_tokens([f"<t{i}>" for i in range(tok.get_vocab_size(), vocab)])
    tok.save(str(Path(model_dir, "tokenizer.json")))
    Path(model_dir, "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def free_port() -> int:
    """A port the kernel has just handed out on loopback (vLLM wants a number; kvfleet takes 0 itself)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def load_seeds(seed: int, rates: Sequence[float]) -> dict[str, int]:
    """A seed per load (the warm-up, then every rate x generator), the same for both servers. Both generators draw
    their prompts from the seed alone, and both servers cache prefixes: with one seed for every load, each load after
    the first re-sent the first's prompts, and the later rates measured prefix-cache hits instead of prefills (a
    server's second load at 4 req/s read a TTFT p50 of 34 ms against the first's 286)."""
    keys = ["warm-up", *(f"{gen}@{rate}" for rate in rates for gen in GENERATORS)]
    return {key: seed + i for i, key in enumerate(keys)}


def wait_ready(proc: subprocess.Popen[str], url: str, what: str) -> None:
    """Until GET url/v1/models answers; the server exiting or READY_S passing ends it with the reason."""
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1)  # the pause between polls, cut short if the server exits
    raise SystemExit(f"{what} was not ready within {READY_S:.0f} s")


def start(server: str, model_dir: str, vllm_python: str, workload_py: Path, log: Path) -> tuple[subprocess.Popen[str],
                                                                                                 str]:
    """Start one server in its own process group, its output in `log`; return it and its base URL once ready."""
    port = free_port()
    if server == "kvfleet":
        cmd = [sys.executable, "-m", "kvfleet_agent.cli", "--log-level", "WARNING", "serve", "--model", model_dir,
               "--port", str(port), "--grpc-port", "-1", "--served-model-name", model_dir]
        env = dict(os.environ)
    else:
        cmd = [vllm_python, str(workload_py.parent / "vllm_cli.py"), "serve", model_dir, "--port", str(port),
               "--host", "127.0.0.1", "--dtype", "float32", "--served-model-name", model_dir]
        env = vllm_env(workload_py, vllm_python)
    with log.open("w") as out:  # the server holds its own copy of the file
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url, f"{server} ({' '.join(cmd)}; log {log})")
    return proc, url


def stop(proc: subprocess.Popen[str]) -> None:
    """SIGTERM to the server's own process group (vLLM forks its engine core), SIGKILL after 60 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def drive(generator: str, url: str, model_dir: str, rate: float, a: argparse.Namespace, workload_py: Path,
          tmp: Path) -> dict[str, float]:
    """One load at `rate` requests/s from `generator`; TTFT and ITL percentiles (ms), output tokens/s, completed."""
    out = tmp / f"{generator.split()[0]}-{rate}.json"
    out.unlink(missing_ok=True)
    if generator == "vllm bench":
        cmd = [a.vllm_python, str(workload_py.parent / "vllm_cli.py"), "bench", "serve", "--backend", "openai",
               "--base-url", url, "--model", model_dir, "--tokenizer", model_dir, "--dataset-name", "random",
               "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len), "--ignore-eos",
               "--num-prompts", str(a.num_requests), "--request-rate", str(rate), "--seed", str(a.seed),
               "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,99", "--disable-tqdm",
               "--save-result", "--result-dir", str(tmp), "--result-filename", out.name]
        env = vllm_env(workload_py, a.vllm_python)
    else:
        cmd = [sys.executable, "-m", "kvfleet_agent.cli", "--log-level", "WARNING", "bench", "serve", "--url", url,
               "--request-rate", str(rate), "--num-requests", str(a.num_requests), "--prompt-len", str(a.input_len),
               "--max-tokens", str(a.output_len), "--ignore-eos", "--temperature", "0", "--seed", str(a.seed),
               "--result-json", str(out), "--no-progress"]
        env = dict(os.environ)
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if done.returncode or not out.exists():
        raise SystemExit(f"failed: {' '.join(cmd)}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    r: dict[str, Any] = json.loads(out.read_text())
    if generator == "vllm bench":
        return {"ttft_p50": r["p50_ttft_ms"], "ttft_p99": r["p99_ttft_ms"], "itl_p50": r["p50_itl_ms"],
                "itl_p99": r["p99_itl_ms"], "output_tps": r["output_throughput"], "completed": r["completed"]}
    s = r["summary"]
    return {"ttft_p50": s["ttft_ms"]["p50"], "ttft_p99": s["ttft_ms"]["p99"], "itl_p50": s["itl_ms"]["p50"],
            "itl_p99": s["itl_ms"]["p99"], "output_tps": s["output_token_throughput"], "completed": s["completed"]}


def table(results: dict[str, dict[str, dict[str, float]]], rates: Sequence[float]) -> str:
    """Per rate and generator, each metric for both servers and vLLM / kvfleet (above 1: kvfleet lower)."""
    lines = [f"{'rate':>5} {'generator':13} {'metric':9} {'kvfleet':>9} {'vllm':>9} {'vllm/kvfleet':>12}"]
    for rate in rates:
        for gen in GENERATORS:
            k, v = results["kvfleet"][f"{gen}@{rate}"], results["vllm"][f"{gen}@{rate}"]
            for m in (*METRICS, "output_tps", "completed"):
                ratio = v[m] / k[m] if k[m] else float("nan")
                lines.append(f"{rate:5g} {gen:13} {m:9} {k[m]:9.1f} {v[m]:9.1f} {ratio:11.2f}x")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="a shape of the shared workload (made if missing)")
    p.add_argument("--model-dir", default=None, help="default /tmp/kvfleet-bench/MODEL-online")
    p.add_argument("--workload-py", default=None, help="the shared harness's workload.py (found beside the repo)")
    p.add_argument("--vllm-python", required=True, help="python of vLLM's CPU venv (install_vllm_cpu.sh)")
    p.add_argument("--rates", nargs="+", type=float, default=[1.0, 2.0, 4.0], help="Poisson arrival rates, req/s")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", metavar="OUT", help="also write the figures here")
    a = p.parse_args(argv)
    workload_py = find_workload(a.workload_py)
    model_dir = a.model_dir or f"/tmp/kvfleet-bench/{a.model}-online"
    load_workload(workload_py).make_model(a.model, model_dir, dtype="float32")
    if not Path(model_dir, "tokenizer.json").exists():  # both servers and both generators need one
        write_tokenizer(model_dir)
    results: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvfleet-online-") as tmp_name:
        tmp = Path(tmp_name)
        seeds = load_seeds(a.seed, a.rates)
        for server in SERVERS:
            print(f"{server}: starting ...", file=sys.stderr, flush=True)
            proc, url = start(server, model_dir, a.vllm_python, workload_py, tmp / f"{server}.log")
            try:
                # Not counted: a server's first requests pay for lazy start-up work (both servers have some).
                warm = argparse.Namespace(**{**vars(a), "num_requests": 8, "seed": seeds["warm-up"]})
                drive("kvfleet bench", url, model_dir, a.rates[-1], warm, workload_py, tmp)
                for rate in a.rates:
                    for gen in GENERATORS:
                        print(f"{server}: {gen} at {rate:g} req/s ...", file=sys.stderr, flush=True)
                        load = argparse.Namespace(**{**vars(a), "seed": seeds[f"{gen}@{rate}"]})
                        fig = drive(gen, url, model_dir, rate, load, workload_py, tmp)
                        results.setdefault(server, {})[f"{gen}@{rate}"] = fig
            finally:
                stop(proc)
    print(f"{a.model} ({model_dir}), {a.num_requests} requests a load, prompts {a.input_len} tokens, outputs "
          f"{a.output_len} (ignore_eos), seeds {a.seed}-{max(seeds.values())} (one a load); latencies in ms")
    print(table(results, a.rates))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
