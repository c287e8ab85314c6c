"""`python -m kvfleet_agent.bench.overhead`: where a decode step's time goes, against the model's forward alone.

One engine decodes `--batch` greedy requests; every decode step is timed whole (LLMEngine.step) and in its
parts, by timers wrapped around this engine's own objects (nothing is changed for other engines):
- schedule: the scheduler's plan; update: advancing the requests and building outputs (the rest of step);
- plan: the executor's batch planning (numpy) and checks; inputs: step_inputs, the batch's tensors;
- model: the decoder layers; logits: the LM head over the sampled rows; sample: the sampler;
- glue: the rest of the runner's step (gathering sampled rows, packing results).
Then the same batch's forward (model and logits) is re-run alone on prepared inputs: the floor a step could
reach with no host work at all. The ratio of the median step to that floor is the host overhead.
With --profile, torch.profiler records the decode run and its top operators by self CPU time are printed.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

PHASES = ("schedule", "plan", "inputs", "model", "logits", "sample", "glue", "update")
RUNNER_PARTS = ("inputs", "model", "logits", "sample")


class Timers:
    """Seconds per phase for the step being run; closed steps move to `steps`."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def wrap(self, obj: Any, name: str, phase: str) -> None:
        """Time obj.name (an instance attribute: this object only) into `phase`."""
        fn: Callable[..., Any] = getattr(obj, name)

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[phase] += time.perf_counter() - start

        setattr(obj, name, timed)

    def close(self, total: float) -> None:
        """End a step that took `total` seconds. The executor's and the runner's whole calls (timed as `executor`
        and `runner`) give plan and glue by difference; what no timer saw is the engine's bookkeeping (update)."""
        cur = self.current
        step = {ph: cur.get(ph, 0.0) for ph in ("schedule", *RUNNER_PARTS)}
        step["plan"] = cur.get("executor", 0.0) - cur.get("runner", 0.0)
        step["glue"] = cur.get("runner", 0.0) - sum(cur.get(ph, 0.0) for ph in RUNNER_PARTS)
        step["update"] = total - cur.get("schedule", 0.0) - cur.get("executor", 0.0)
        step["total"] = total
        self.steps.append(step)
        self.current = defaultdict(float)


def instrument(llm: Any, timers: Timers) -> None:
    """Wrap the engine's parts (their instance attributes: this engine's alone) in timers."""
    engine = llm.engine
    runner = engine.runner
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(engine.executor, "execute", "executor")
    timers.wrap(runner, "execute", "runner")
    timers.wrap(runner, "step_inputs", "inputs")
    timers.wrap(runner.model, "forward", "model")
    timers.wrap(runner.model, "compute_logits", "logits")
    timers.wrap(runner.sampler, "sample", "sample")


def decode_steps(llm: Any, batch: int, prompt_len: int, new_tokens: int, timers: Timers) -> Any:
    """Add `batch` requests, run their prefill untimed, then time every decode step; returns the last batch run."""
    from kvfleet_agent import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [(7 * i + j) % 200 + 4 for j in range(prompt_len)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    timers.current.clear()
    last: list[Any] = []
    run = engine.runner.execute

    def keep(b: Any, samplers: Any, *rest: Any) -> Any:
        last[:] = [b]
        return run(b, samplers, *rest)

    engine.runner.execute = keep
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step(finished_only=True)
        timers.close(time.perf_counter() - start)
    engine.runner.execute = run
    return last[0]


def forward_alone(llm: Any, batch: Any, repeats: int) -> list[float]:
    """Seconds of the model and LM head on the batch's prepared inputs, `repeats` times (no host work between)."""
    runner = llm.engine.runner
    with torch.inference_mode():
        ids, positions, rows, meta = runner.step_inputs(batch)
        out = []
        for _ in range(repeats):
            start = time.perf_counter()
            hidden = runner.model(ids, positions, meta)
            runner.model.compute_logits(hidden.index_select(0, rows))
            out.append(time.perf_counter() - start)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="concurrent requests (one run each)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128, help="decode steps per run")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--profile", action="store_true", help="torch.profiler over the decode run: top operators")
    p.add_argument("--json", metavar="OUT", help="also write the figures here")
    a = p.parse_args(argv)
    from kvfleet_agent import LLM

    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=a.prompt_len + a.new_tokens + 16,
              max_num_seqs=max(a.batch), enable_prefix_caching=False, kv_cache_memory_bytes=256 << 20)
    timers = Timers()
    instrument(llm, timers)
    report: dict[str, Any] = {"model": a.model, "dtype": a.dtype, "threads": torch.get_num_threads(), "rows": []}
    print(f"{'batch':>5} {'step ms':>8} {'forward ms':>10} {'overhead':>8}  " +
          " ".join(f"{ph:>8}" for ph in PHASES) + "   (medians, ms)")
    for b in a.batch:
        timers.steps.clear()
        if a.profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                last = decode_steps(llm, b, a.prompt_len, a.new_tokens, timers)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
        else:
            last = decode_steps(llm, b, a.prompt_len, a.new_tokens, timers)
        floor = statistics.median(forward_alone(llm, last, max(16, a.new_tokens // 2)))
        med = {ph: statistics.median(s.get(ph, 0.0) for s in timers.steps) for ph in (*PHASES, "total")}
        row = {"batch": b, "steps": len(timers.steps), "step_ms": med["total"] * 1e3, "forward_ms": floor * 1e3,
               "overhead": med["total"] / floor - 1, **{f"{ph}_ms": med[ph] * 1e3 for ph in PHASES}}
        report["rows"].append(row)
        print(f"{b:>5} {row['step_ms']:>8.2f} {row['forward_ms']:>10.2f} {row['overhead'] * 100:>+7.0f}%  " +
              " ".join(f"{med[ph] * 1e3:>8.2f}" for ph in PHASES))
    llm.shutdown()
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
