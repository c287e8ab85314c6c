"""`python -m kvfleet_agent.bench.dtype_agreement`: how far bfloat16 greedy outputs stray from float32's, beside vLLM's.

Runs the shared workload (../shared/bench/workload.py: same checkpoint, same prompt ids, greedy, ignore_eos)
through kvfleet in float32 and in bfloat16 from the same float32 checkpoint, each in its own process, and
with --vllm-python through vLLM's CPU build the same two ways (vllm_peer.py --dump). It prints, per pair, the
share of tokens equal up to each request's first difference and the share of requests equal throughout:
bfloat16 against float32 within each engine, and the two engines against each other in each dtype.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvfleet_agent.bench.decode import find_workload, load_workload
from kvfleet_agent.bench.quant import agreement

DTYPES = ("float32", "bfloat16")


def kvfleet_tokens(model_dir: str, workload_py: str, workload: str, dtype: str) -> list[list[int]]:
    """The workload's greedy outputs from kvfleet in `dtype` (this process: the child's entry point)."""
    from kvfleet_agent import LLM, SamplingParams

    reqs = load_workload(Path(workload_py)).requests(workload)
    llm = LLM(model=model_dir, dtype=dtype, seed=0)
    outs = llm.generate([{"prompt_token_ids": r["prompt_ids"]} for r in reqs],
                        [SamplingParams(max_tokens=r["max_new_tokens"], temperature=0.0, ignore_eos=True)
                         for r in reqs], use_tqdm=False)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def run_child(cmd: list[str], env: dict[str, str] | None = None) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if done.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{done.stderr[-3000:]}")


def vllm_env(workload_py: Path, python: str) -> dict[str, str]:
    """vLLM's environment as the shared harness sets it (its compare_throughput.vllm_env)."""
    sys.path.insert(0, str(workload_py.parent))
    import compare_throughput  # type: ignore[import-not-found]

    return dict(compare_throughput.vllm_env(python))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="a shape of the shared workload (made if missing)")
    p.add_argument("--model-dir", default=None, help="default /tmp/kvfleet-bench/MODEL")
    p.add_argument("--workload", default="cpu-mix")
    p.add_argument("--workload-py", default=None, help="the shared harness's workload.py (found beside the repo)")
    p.add_argument("--vllm-python", default=None, help="python of vLLM's CPU venv (install_vllm_cpu.sh)")
    p.add_argument("--json", metavar="OUT", help="also write the figures here")
    p.add_argument("--one", nargs=2, metavar=("DTYPE", "OUT"), help=argparse.SUPPRESS)  # the child
    a = p.parse_args(argv)
    workload_py = find_workload(a.workload_py)
    model_dir = a.model_dir or f"/tmp/kvfleet-bench/{a.model}"
    if a.one:
        Path(a.one[1]).write_text(json.dumps(kvfleet_tokens(model_dir, str(workload_py), a.workload, a.one[0])))
        return 0
    load_workload(workload_py).make_model(a.model, model_dir, dtype="float32")
    tokens: dict[str, list[list[int]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in DTYPES:
            out = f"{tmp}/kvfleet-{dtype}.json"
            print(f"kvfleet {dtype} ...", file=sys.stderr, flush=True)
            run_child([sys.executable, "-m", "kvfleet_agent.bench.dtype_agreement", "--model", a.model, "--model-dir",
                       model_dir, "--workload", a.workload, "--workload-py", str(workload_py), "--one", dtype, out])
            tokens[f"kvfleet {dtype}"] = json.loads(Path(out).read_text())
            if a.vllm_python:
                out = f"{tmp}/vllm-{dtype}.json"
                print(f"vllm {dtype} ...", file=sys.stderr, flush=True)
                run_child([a.vllm_python, str(workload_py.parent / "vllm_peer.py"), "--model-dir", model_dir,
                           "--workload", a.workload, "--dtype", dtype, "--dump", out],
                          vllm_env(workload_py, a.vllm_python))
                tokens[f"vllm {dtype}"] = json.loads(Path(out).read_text())
    pairs = [("kvfleet bfloat16", "kvfleet float32")]
    if a.vllm_python:
        pairs += [("vllm bfloat16", "vllm float32"), ("kvfleet float32", "vllm float32"),
                  ("kvfleet bfloat16", "vllm bfloat16")]
    rows: list[dict[str, Any]] = []
    print(f"{a.model}, {a.workload}: {len(tokens['kvfleet float32'])} requests, greedy")
    print(f"{'outputs':<20} {'against':<20} {'tokens agree':>12} {'requests agree':>14}")
    for got, ref in pairs:
        tok, seq = agreement(tokens[ref], tokens[got])
        rows.append({"outputs": got, "against": ref, "tokens": tok, "requests": seq})
        print(f"{got:<20} {ref:<20} {tok * 100:>11.1f}% {seq * 100:>13.1f}%")
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "workload": a.workload, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
