"""Cases (trace × cold start × fault), the suite's matrix, and running cases × policies × seeds in worker processes."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace

from policies import Setup, make_policies
from replica import ReplicaModel
from scoring import Score, combine, rolling_p95, score
from simulator import FAULTS, Autoscaler, Fault, FaultKind, RunResult, simulate
from workload import TRACE_NAMES, Trace, traces

# Cold starts (creation → ready), each drawn within ±20% of its centre; "preset": the replica preset's own range.
COLD_STARTS: dict[str, float | None] = {"30s": 30.0, "2m": 120.0, "5m": 300.0, "preset": None}
SUITE_COLD_STARTS = ("30s", "2m", "5m")
FAULT_TRACES = ("step", "spike")  # the faults run on these, at a 2-minute cold start
FAULT_COLD_START = "2m"
# The suite's traces run at half length: 33 cases × 3 policies × 3 seeds at full length are ~62M simulated requests
# (~26 min on 2 cores); at 0.5 they take about half that. Cold starts and faults keep their durations.
SUITE_SCALE = 0.5


@dataclass(frozen=True)
class Case:
    """One row group of the report: a trace, a cold start (a COLD_STARTS key) and a fault."""

    trace: str
    cold_start: str = "preset"
    fault: FaultKind = "none"

    @property
    def label(self) -> str:
        return f"{self.trace} / {self.cold_start} / {self.fault}"

    @property
    def slug(self) -> str:
        return f"{self.trace}-{self.cold_start}-{self.fault}"

    def model(self, base: ReplicaModel) -> ReplicaModel:
        centre = COLD_STARTS[self.cold_start]
        return base if centre is None else replace(base, startup_min_s=0.8 * centre, startup_max_s=1.2 * centre)


def matrix(trace_names: Iterable[str] = TRACE_NAMES, cold_starts: Iterable[str] = SUITE_COLD_STARTS,
           faults: Iterable[str] = FAULTS) -> list[Case]:
    """Every trace × cold start without a fault, then each fault on step and spike at a 2-minute cold start (9 × 3
    + 3 × 2 = 33 cases unfiltered); the arguments filter."""
    names, colds, kinds = list(trace_names), list(cold_starts), list(faults)
    cases = [Case(t, c, "none") for t in names for c in colds] if "none" in kinds else []
    cases += [Case(t, FAULT_COLD_START, f) for f in FAULTS if f != "none" and f in kinds
              for t in FAULT_TRACES if t in names and FAULT_COLD_START in colds]
    return cases


@dataclass(frozen=True)
class Task:
    """One simulation: a case under one policy (by index into `make_policies`' list) on one seed."""

    case: Case
    policy: int
    seed: int
    keep: bool  # return the run (timeline and rolling p95, without requests) for plots


def expected_requests(trace: Trace) -> float:
    """Roughly how many requests a trace brings (to start the longest simulations first)."""
    step = max(trace.duration_s / 500, 1.0)
    return sum(trace.rate(i * step) * step for i in range(int(trace.duration_s / step)))


@dataclass(frozen=True)
class Runner:
    """What every worker needs to run a Task (picklable: the policies are built inside the worker)."""

    setup: Setup
    scale: float = 1.0

    def trace(self, case: Case, seed: int) -> Trace:
        return traces(self.setup.unit, self.scale, seed, float(self.setup.max_replicas))[case.trace]

    def simulate(self, case: Case, policy: Autoscaler, seed: int) -> RunResult:
        """One case under `policy` on `seed`: the seeded trace, starting at the replicas its initial load needs, with
        the case's cold starts and fault."""
        s = self.setup
        trace = self.trace(case, seed)
        initial = max(s.min_replicas, math.ceil(trace.rate(0.0) / s.unit))
        return simulate(trace, policy, case.model(s.model), initial, None, seed, fault=Fault.of(case.fault, trace))

    def __call__(self, task: Task) -> tuple[Task, str, Score, RunResult | None]:
        policy = make_policies(self.setup)[task.policy]
        run = self.simulate(task.case, policy, task.seed)
        result = score(run, self.setup.ttft_target)
        if task.keep:
            run.p95_series = rolling_p95(run)
        run.requests.clear()  # hundreds of thousands of objects: only the plot's series travel back
        return task, policy.name, result, run if task.keep else None


def run_cases(runner: Runner, cases: Sequence[Case], seeds: Sequence[int], jobs: int = 2, keep_runs: bool = False,
              progress: bool = True) -> dict[Case, list[tuple[Score, RunResult | None]]]:
    """Every case under every policy on every seed, `jobs` simulations at a time; per case, per policy (in the
    policies' order), the score summed over seeds and the first seed's run (if `keep_runs`)."""
    n_policies = len(make_policies(runner.setup))
    tasks = [Task(c, i, seed, keep_runs and seed == seeds[0]) for c in cases for i in range(n_policies)
             for seed in seeds]
    cost = {(c, seed): expected_requests(runner.trace(c, seed)) for c in cases for seed in seeds}
    tasks.sort(key=lambda t: -cost[t.case, t.seed])  # longest first: the pool ends together
    done: list[tuple[Task, str, Score, RunResult | None]] = []
    bar = _progress(len(tasks), progress)
    if jobs <= 1:
        for t in tasks:
            done.append(runner(t))
            bar(done[-1])
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            for fut in as_completed([pool.submit(runner, t) for t in tasks]):
                done.append(fut.result())
                bar(done[-1])
    bar(None)
    out: dict[Case, list[tuple[Score, RunResult | None]]] = {}
    for c in cases:
        out[c] = []
        for i in range(n_policies):
            mine = sorted((d for d in done if d[0].case == c and d[0].policy == i), key=lambda d: d[0].seed)
            first = next((d[3] for d in mine if d[3] is not None), None)
            out[c].append((combine([d[2] for d in mine]), first))
    return out


def _progress(total: int, enabled: bool) -> Callable[[tuple[Task, str, Score, RunResult | None] | None], None]:
    """A tqdm bar on stderr (a line per simulation without tqdm); called with None at the end."""
    if not enabled:
        return lambda item: None
    try:
        from tqdm import tqdm
    except ImportError:
        count = [0]

        def line(item: tuple[Task, str, Score, RunResult | None] | None) -> None:
            if item is not None:
                count[0] += 1
                print(f"[{count[0]}/{total}] {item[0].case.label} {item[1]} seed {item[0].seed}", file=sys.stderr)

        return line
    pbar = tqdm(total=total, unit="sim", file=sys.stderr, dynamic_ncols=True)

    def tick(item: tuple[Task, str, Score, RunResult | None] | None) -> None:
        if item is None:
            pbar.close()
            return
        pbar.set_postfix_str(f"{item[0].case.label} {item[1]}", refresh=False)
        pbar.update(1)

    return tick
