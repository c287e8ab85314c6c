"""Compare kvfleet's autoscaler with HPA and KubeAI on simulated traces: `python bench/autoscale/run.py --out DIR`."""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: the sibling modules are top-level

from policies import Hpa, KubeAI, Kvfleet
from replica import PRESETS, ReplicaModel
from scoring import Score, combine, plot, rolling_p95, score, table
from simulator import Autoscaler, Fleet, RunResult, simulate
from workload import RequestMix, Trace, traces

from kvfleet_operator.autoscaling.decide import AutoscalingPolicy, LatencyTarget


@dataclass(frozen=True)
class Setup:
    """What every policy shares: the replica, the load unit, the SLO and the per-replica queue target.

    From `--calibrate` on gpu-8b with the default request mix, one replica alone: TTFT p95 0.16 s at 4
    requests/s, 0.28 s at 8 (holding 43 requests, waiting + running), 0.51 s at 10, 3.7 s at 12, and it
    saturates past ~12.5. The unit is 8 requests/s; the queue target every policy gets (the number a user
    would write: HPA averageValue, KubeAI targetRequests, kvfleet queueDepthPerReplica) is what a replica
    holds there, 45; kvfleet alone also gets the SLO itself, TTFT p95 <= 0.5 s.
    """

    model: ReplicaModel
    unit: float = 8.0  # requests/s one replica serves comfortably within the SLO
    queue_target: float = 45.0
    ttft_target: float = 0.5
    min_replicas: int = 1
    max_replicas: int = 20


def policies(s: Setup) -> list[Autoscaler]:
    """kvfleet with the shipped defaults (tolerance, behavior) plus the two targets; the baselines' defaults."""
    kv = AutoscalingPolicy(min_replicas=s.min_replicas, max_replicas=s.max_replicas,
                           queue_depth_per_replica=s.queue_target,
                           latency_targets=(LatencyTarget("ttft", 95, s.ttft_target),))
    return [Kvfleet(kv), Hpa(s.queue_target, s.min_replicas, s.max_replicas),
            KubeAI(s.queue_target, s.min_replicas, s.max_replicas)]


def compare(setup: Setup, chosen: Sequence[Trace], seeds: Sequence[int] = (1,),
            mix: RequestMix | None = None) -> dict[str, list[tuple[Score, RunResult]]]:
    """Every chosen trace under every policy, from the same arrivals, starting at the replicas the trace's
    initial load needs; per trace × policy, the score summed over the seeds and the first seed's run."""
    mix = mix or RequestMix()
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
    ap.add_argument("--traces", nargs="+", default=["step", "ramp", "burst", "wave"])
    ap.add_argument("--scale", type=float, default=1.0, help="shorten every trace by this factor")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3],
                    help="arrival and startup-time seeds; scores are totals over them")
    ap.add_argument("--unit", type=float, default=Setup.unit, help="requests/s of one replica's worth of load")
    ap.add_argument("--queue-target", type=float, default=Setup.queue_target)
    ap.add_argument("--ttft-target", type=float, default=Setup.ttft_target)
    ap.add_argument("--max-replicas", type=int, default=Setup.max_replicas)
    ap.add_argument("--out", type=Path, help="write results.md and one PNG per trace here")
    ap.add_argument("--calibrate", action="store_true", help="print one replica's latency against load, and stop")
    ap.add_argument("--rates", type=float, nargs="+", default=[2, 4, 6, 8, 10, 12, 14, 16],
                    help="requests/s for --calibrate")
    args = ap.parse_args(argv)
    model = PRESETS[args.model]
    if args.calibrate:
        print(calibrate(model, RequestMix(), args.rates))
        return 0
    setup = Setup(model, args.unit, args.queue_target, args.ttft_target, max_replicas=args.max_replicas)
    chosen = [traces(args.unit, args.scale)[name] for name in args.traces]
    started = time.perf_counter()
    results = compare(setup, chosen, args.seeds)
    report = table({name: [s for s, _ in runs] for name, runs in results.items()})
    print(report)
    print(f"({time.perf_counter() - started:.0f} s; model {args.model}, unit {args.unit:g} req/s, queue target "
          f"{args.queue_target:g}, TTFT p95 target {args.ttft_target:g} s, seeds {' '.join(map(str, args.seeds))})")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text(report)
        for name, runs in results.items():
            try:
                plot([r for _, r in runs], args.ttft_target, args.out / f"{name}.png")
            except ImportError:
                print("matplotlib is not installed: no plots", file=sys.stderr)
                break
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
