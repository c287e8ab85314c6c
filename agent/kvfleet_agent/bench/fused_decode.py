"""`python -m kvfleet_agent.bench.fused_decode`: decode steps with the one-call stack against the layers' modules.

One engine decodes `--batch` greedy requests and alternates, step by step, between its decoder stack in one C++ call
(models/fused_decode.py) and the layers' modules one op at a time: both compute the same bits, so the requests do
not notice, and the machine's drift (its speed moves by tens of percent within minutes) falls on both alike. Each
step is timed whole (LLMEngine.step); the figures are medians per path and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any


def ab_steps(llm: Any, batch: int, prompt_len: int, new_tokens: int) -> dict[str, list[float]]:
    """Add `batch` requests, run their prefill untimed, then time every decode step, alternating the paths."""
    from kvfleet_agent import SamplingParams

    engine = llm.engine
    model = engine.runner.model
    stack = model.fused_decode
    if stack is None:
        raise SystemExit("this model's decode steps cannot run the one-call stack here (see the engine's log)")
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"ab{i}-{time.monotonic_ns()}", [(7 * i + j) % 200 + 4 for j in range(prompt_len)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    times: dict[str, list[float]] = {"one call": [], "modules": []}
    step = 0
    try:
        while engine.has_unfinished():
            # ABBA order: neither path always runs right after the other.
            path = "one call" if step % 4 in (0, 3) else "modules"
            model.fused_decode = stack if path == "one call" else None
            start = time.perf_counter()
            engine.step()
            times[path].append(time.perf_counter() - start)
            step += 1
    finally:
        model.fused_decode = stack
    return times


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64], help="concurrent requests (one run each)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128, help="decode steps per run")
    p.add_argument("--dtype", default="auto")
    a = p.parse_args(argv)
    from kvfleet_agent import LLM

    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=a.prompt_len + a.new_tokens + 16,
              max_num_seqs=max(a.batch), enable_prefix_caching=False)
    print(f"{a.model} ({llm.engine.runner.dtype}): decode step, medians (ms), paths alternated step by step")
    print(f"{'batch':>5} {'one call':>9} {'modules':>9} {'speedup':>8}")
    for b in a.batch:
        ab_steps(llm, b, a.prompt_len, 8)  # warm-up: this batch size's shapes once on both paths
        t = ab_steps(llm, b, a.prompt_len, a.new_tokens)
        fused, modules = statistics.median(t["one call"]), statistics.median(t["modules"])
        print(f"{b:>5} {fused * 1e3:>9.3f} {modules * 1e3:>9.3f} {modules / fused:>7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
