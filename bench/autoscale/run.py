"""Compare kvfleet's autoscaler with HPA and KubeAI on simulated traces: `python bench/autoscale/run.py --out DIR`."""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: the sibling modules are top-level

from policies import Setup, make_policies
from replica import PRESETS, ReplicaModel
from scoring import Score, combine, plot, rolling_p95, score, table
from simulator import FAULTS, Autoscaler, Fleet, RunResult, fault_kind, simulate
from suite import COLD_STARTS, SUITE_COLD_STARTS, SUITE_SCALE, Case, Runner, matrix, run_cases
from workload import TRACE_NAMES, RequestMix, Trace

__all__ = ["Setup", "calibrate", "compare", "main", "policies"]


def policies(s: Setup) -> list[Autoscaler]:
    """kvfleet, HPA and KubeAI for this setup (policies.make_policies)."""
    return make_policies(s)


def compare(setup: Setup, chosen: Sequence[Trace], seeds: Sequence[int] = (1,),
            mix: RequestMix | None = None) -> dict[str, list[tuple[Score, RunResult]]]:
    """Every chosen trace under every policy, from the same arrivals, starting at the replicas the trace's
    initial load needs, in this process; per trace × policy, the score summed over the seeds and the first seed's
    run. (The suite, with cold starts, faults and seeded traces, is suite.run_cases.)"""
    out: dict[str, list[tuple[Score, RunResult]]] = {}
    for trace in chosen:
        initial = max(setup.min_replicas, math.ceil(trace.rate(0.0) / setup.unit))
        out[trace.name] = []
        for i in range(len(policies(setup))):
            scores, first = [], None
            for seed in seeds:
                run = simulate(trace, policies(setup)[i], setup.model, initial, mix, seed)
                scores.append(score(run, setup.ttft_target))
                if first is None:
                    first = run
                    run.p95_series = rolling_p95(run)
                run.requests.clear()  # hundreds of thousands of objects: keep only what the plot needs
            assert first is not None
            out[trace.name].append((combine(scores), first))
    return out


class _Fixed:
    """No autoscaling: for calibration."""

    def __init__(self) -> None:
        self.name, self.interval = "fixed", 3600.0

    def tick(self, now: float, fleet: Fleet) -> int:
        return fleet.spec


def _constant(rate: float) -> Callable[[float], float]:
    return lambda t: rate


def calibrate(model: ReplicaModel, mix: RequestMix, rates: Sequence[float], seconds: float = 1200.0) -> str:
    """One replica at constant rates: TTFT percentiles and the mean requests it holds (Little's law)."""
    lines = ["| req/s | TTFT p50 (s) | TTFT p95 (s) | held (waiting + running) |", "|---:|---:|---:|---:|"]
    for rate in rates:
        trace = Trace(f"const-{rate:g}", seconds, _constant(rate), rate)
        run = simulate(trace, _Fixed(), model, 1, mix, seed=7)
        done = [r for r in run.requests if r.finish is not None and r.first_token is not None]
        ttft = sorted(r.first_token - r.arrival for r in done if r.first_token is not None)
        held = sum(r.finish - r.arrival for r in done if r.finish is not None) / seconds
        lines.append(f"| {rate:g} | {ttft[len(ttft) // 2]:.3f} | {ttft[int(0.95 * len(ttft))]:.3f} | {held:.1f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", choices=sorted(PRESETS), default="gpu-8b")
    ap.add_argument("--suite", action="store_true",
                    help="the matrix: every trace × the 30s/2m/5m cold starts, plus each fault on step and spike "
                         "at 2m (--traces, --cold-starts and --faults filter it)")
    ap.add_argument("--traces", nargs="+", choices=TRACE_NAMES,
                    help="default: step ramp burst wave (all nine with --suite)")
    ap.add_argument("--cold-starts", nargs="+", choices=sorted(COLD_STARTS),
                    help="startup time, ±20%%; preset: the model's own range (default: preset; 30s 2m 5m with "
                         "--suite)")
    ap.add_argument("--faults", nargs="+", choices=FAULTS, help="default: none (all with --suite)")
    ap.add_argument("--scale", type=float,
                    help=f"shorten every trace by this factor (default 1; {SUITE_SCALE:g} with --suite)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3],
                    help="arrival, trace-noise and startup-time seeds; scores are totals over them")
    ap.add_argument("--jobs", type=int, default=2, help="simulations run in parallel (worker processes)")
    ap.add_argument("--unit", type=float, default=Setup.unit, help="requests/s of one replica's worth of load")
    ap.add_argument("--queue-target", type=float, default=Setup.queue_target)
    ap.add_argument("--ttft-target", type=float, default=Setup.ttft_target)
    ap.add_argument("--max-replicas", type=int, default=Setup.max_replicas)
    ap.add_argument("--out", type=Path, help="write results.md and one PNG per case here")
    ap.add_argument("--calibrate", action="store_true", help="print one replica's latency against load, and stop")
    ap.add_argument("--rates", type=float, nargs="+", default=[2, 4, 6, 8, 10, 12, 14, 16],
                    help="requests/s for --calibrate")
    args = ap.parse_args(argv)
    model = PRESETS[args.model]
    if args.calibrate:
        print(calibrate(model, RequestMix(), args.rates))
        return 0
    setup = Setup(model, args.unit, args.queue_target, args.ttft_target, max_replicas=args.max_replicas)
    seeds = args.seeds
    if args.suite:
        cases = matrix(args.traces or TRACE_NAMES, args.cold_starts or SUITE_COLD_STARTS, args.faults or FAULTS)
    else:
        cases = [Case(t, c, fault_kind(f)) for t in args.traces or ("step", "ramp", "burst", "wave")
                 for c in args.cold_starts or ("preset",) for f in args.faults or ("none",)]
    if not cases:
        ap.error("the filters leave no case")
    scale = args.scale if args.scale is not None else SUITE_SCALE if args.suite else 1.0
    started = time.perf_counter()
    results = run_cases(Runner(setup, scale), cases, seeds, args.jobs, keep_runs=args.out is not None,
                        progress=sys.stderr.isatty() or args.suite)
    report = table({c.label: [s for s, _ in runs] for c, runs in results.items()})
    print(report)
    print(f"({time.perf_counter() - started:.0f} s with {args.jobs} jobs; {len(cases)} cases; model {args.model}, "
          f"unit {args.unit:g} req/s, queue target {args.queue_target:g}, TTFT p95 target {args.ttft_target:g} s, "
          f"scale {scale:g}, seeds {' '.join(map(str, seeds))})")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text(report)
        for case, runs in results.items():
            try:
                plot([r for _, r in runs if r is not None], args.ttft_target, args.out / f"{case.slug}.png",
                     case.label)
            except ImportError:
                print("matplotlib is not installed: no plots", file=sys.stderr)
                break
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
