"""One case on one seed, minute by minute: `python bench/autoscale/trace_case.py spike 5m none 2 --decisions 700 1700`.

Prints, for each 1-minute window of arrivals, the offered load and every policy's TTFT p95 (marked `x` over the
target) with its replicas (spec / ready) at the window's end; then each policy's scale events; then kvfleet's
decisions with their reasons within `--decisions FROM TO` (seconds). This is how the suite's misses were read: a
lost window, what each policy had ready for it, and what kvfleet decided and why.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: the sibling modules are top-level

from policies import Kvfleet, Setup, make_policies
from replica import PRESETS
from scoring import WINDOW_S, window_p95s
from simulator import FAULTS, RunResult, fault_kind
from suite import COLD_STARTS, SUITE_SCALE, Case, Runner
from workload import TRACE_NAMES


def replicas_at(run: RunResult, t: float) -> tuple[int, int]:
    """(spec, ready) replicas at time `t`, from the run's timeline."""
    out = (0, 0)
    for time, spec, ready in run.timeline:
        if time > t:
            break
        out = (spec, ready)
    return out


def report(case: Case, seed: int, setup: Setup, scale: float, decisions: tuple[float, float] | None) -> str:
    """The minute-by-minute table, the events and kvfleet's decisions, as text."""
    runner = Runner(setup, scale)
    trace = runner.trace(case, seed)
    policies = make_policies(setup)
    runs = [runner.simulate(case, p, seed) for p in policies]
    p95s = [window_p95s(r.requests) for r in runs]  # as the score judges each window
    lines = [f"{case.label}, seed {seed}: per 1-minute window, TTFT p95 s (x: over {setup.ttft_target:g} s) and "
             "replicas spec/ready at its end",
             "min  load | " + " | ".join(f"{r.policy:>16}" for r in runs)]
    for m in sorted(p95s[0]):
        cells = []
        for run, by in zip(runs, p95s, strict=True):
            v = by.get(m, math.nan)
            spec, ready = replicas_at(run, (m + 1) * WINDOW_S - 1e-6)
            cells.append(f"{v:8.2f}{'x' if v > setup.ttft_target else ' '} {spec:2d}/{ready:2d}")
        lines.append(f"{m:3d} {trace.rate((m + 0.5) * WINDOW_S) / setup.unit:5.2f} | " + " | ".join(cells))
    for run in runs:
        lines.append(f"{run.policy} events (s, change): " + ", ".join(f"{t:.0f} {c:+d}" for t, c in run.events))
    kv = next(p for p in policies if isinstance(p, Kvfleet))
    if decisions is not None:
        lo, hi = decisions
        lines += [f"{d.time:6.0f} {d.current_replicas:2d} ({d.ready_replicas} ready, {d.starting_replicas} starting)"
                  f" -> {d.desired_replicas:2d} [{d.limited_by}] {d.reason}"
                  for d in kv.decisions if lo <= d.time <= hi]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", choices=TRACE_NAMES)
    ap.add_argument("cold_start", choices=sorted(COLD_STARTS))
    ap.add_argument("fault", choices=FAULTS)
    ap.add_argument("seed", type=int)
    ap.add_argument("--decisions", type=float, nargs=2, metavar=("FROM", "TO"),
                    help="print kvfleet's decisions between these times (seconds)")
    ap.add_argument("--scale", type=float, default=SUITE_SCALE, help=f"trace length factor (the suite's: "
                    f"{SUITE_SCALE:g})")
    ap.add_argument("--model", choices=sorted(PRESETS), default="gpu-8b")
    args = ap.parse_args(argv)
    case = Case(args.trace, args.cold_start, fault_kind(args.fault))
    span = (args.decisions[0], args.decisions[1]) if args.decisions else None
    print(report(case, args.seed, Setup(PRESETS[args.model]), args.scale, span))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
