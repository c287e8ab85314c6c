"""Scores of a run (SLO windows and requests, replica-seconds, scale events, flaps), the bar, the table and the plot."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from replica import Request
from simulator import RunResult

FLAP_WINDOW_S = 300.0  # a reversal of direction less than 5 minutes after the previous scale event
WINDOW_S = 60.0  # the SLO is judged per 1-minute window of arrivals


@dataclass(frozen=True)
class Score:
    """One case × policy (totals over seeds once combined)."""

    policy: str
    trace: str
    requests: int
    slo_share: float  # fraction of requests whose TTFT <= the target (secondary)
    ttft_p95: float  # over the whole run, from the requests themselves (not from histograms); worst seed
    replica_seconds: float
    scale_events: int
    flaps: int
    windows: int = 0  # 1-minute windows (by arrival) with at least one arrival
    windows_met: int = 0  # of those, windows whose arrivals' TTFT p95 <= the target

    @property
    def window_share(self) -> float:
        """The SLO attainment the bar checks: the share of 1-minute windows whose TTFT p95 met the target."""
        return self.windows_met / self.windows if self.windows else math.nan


def flaps(events: Sequence[tuple[float, int]], window: float = FLAP_WINDOW_S) -> int:
    """Scale events whose direction reverses the previous event's, less than `window` seconds after it."""
    return sum(1 for (t0, c0), (t1, c1) in itertools.pairwise(events)
               if (c0 > 0) != (c1 > 0) and t1 - t0 < window)


def p95(values: Sequence[float]) -> float:
    """Nearest-rank 95th percentile of sorted values (NaN if none)."""
    return values[min(len(values) - 1, math.ceil(0.95 * len(values)) - 1)] if values else math.nan


def window_p95s(requests: Iterable[Request], window: float = WINDOW_S) -> dict[int, float]:
    """TTFT p95 of each `window`-second window of arrivals that has any (keyed by the window's index); a request
    never served counts as an infinite TTFT."""
    by_window: dict[int, list[float]] = {}
    for r in requests:
        ttft = math.inf if r.first_token is None else r.first_token - r.arrival
        by_window.setdefault(int(r.arrival // window), []).append(ttft)
    return {k: p95(sorted(ttfts)) for k, ttfts in by_window.items()}


def window_slo(requests: Iterable[Request], ttft_target: float, window: float = WINDOW_S) -> tuple[int, int]:
    """(windows met, windows): each window of arrivals meets the SLO when its TTFT p95 is within the target."""
    p95s = window_p95s(requests, window)
    return sum(1 for v in p95s.values() if v <= ttft_target), len(p95s)


def score(run: RunResult, ttft_target: float) -> Score:
    """Every request that arrived during the trace counts; the simulation served them all to the end."""
    ttfts = sorted((r.first_token - r.arrival) for r in run.requests if r.first_token is not None)
    met = sum(1 for x in ttfts if x <= ttft_target)
    n = len(run.requests)
    w_met, windows = window_slo(run.requests, ttft_target)
    return Score(run.policy, run.trace, n, met / n if n else math.nan, p95(ttfts), run.pod_seconds,
                 len(run.events), flaps(run.events), windows, w_met)


def combine(scores: Sequence[Score]) -> Score:
    """One score for several seeds of the same case × policy: totals, and shares over all their requests and
    windows."""
    n = sum(s.requests for s in scores)
    return Score(scores[0].policy, scores[0].trace, n, sum(s.slo_share * s.requests for s in scores) / n,
                 max(s.ttft_p95 for s in scores), sum(s.replica_seconds for s in scores),
                 sum(s.scale_events for s in scores), sum(s.flaps for s in scores),
                 sum(s.windows for s in scores), sum(s.windows_met for s in scores))


def better_baseline(scores: Sequence[Score]) -> Score:
    """The baseline meeting the SLO in the most windows; on a tie, the cheaper one."""
    return max((s for s in scores if s.policy != "kvfleet"), key=lambda s: (s.window_share, -s.replica_seconds))


def bar(scores: Sequence[Score]) -> tuple[bool, str]:
    """kvfleet meets the SLO in at least as many 1-minute windows (as a share) as the better baseline, within +10%
    of its replica-seconds, and never flaps."""
    kv = next(s for s in scores if s.policy == "kvfleet")
    best = better_baseline(scores)
    checks = [(kv.window_share >= best.window_share,
               f"SLO windows {kv.window_share:.2%} vs {best.policy} {best.window_share:.2%}"),
              (kv.replica_seconds <= 1.1 * best.replica_seconds,
               f"replica-s {kv.replica_seconds / best.replica_seconds:.3f}x {best.policy}"),
              (kv.flaps == 0, f"{kv.flaps} flaps")]
    ok = all(c for c, _ in checks)
    return ok, "; ".join(("" if c else "FAIL ") + text for c, text in checks)


def table(by_case: Mapping[str, Sequence[Score]]) -> str:
    """Markdown: one row per case × policy, the bar's verdict per case, and how many cases held it."""
    lines = ["| case | policy | requests | SLO windows | TTFT <= target | TTFT p95 (s) | replica-hours | scale events "
             "| flaps |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    verdicts = []
    held = 0
    for case, scores in by_case.items():
        for s in scores:
            lines.append(f"| {case} | {s.policy} | {s.requests} | {s.window_share:.2%} | {s.slo_share:.2%} | "
                         f"{s.ttft_p95:.2f} | {s.replica_seconds / 3600:.2f} | {s.scale_events} | {s.flaps} |")
        ok, why = bar(scores)
        held += ok
        verdicts.append(f"- {case}: {'meets the bar' if ok else 'MISSES the bar'} ({why})")
    return ("\n".join(lines) + "\n\n" + "\n".join(verdicts) + f"\n\nbar held in {held} of {len(by_case)} cases\n")


def rolling_p95(run: RunResult, window: float = 60.0, step: float = 15.0) -> tuple[list[float], list[float]]:
    """TTFT p95 of requests whose first token came in the trailing window, every `step` seconds (ground truth)."""
    firsts = sorted((r.first_token, r.first_token - r.arrival) for r in run.requests if r.first_token is not None)
    end = run.timeline[-1][0] if run.timeline else 0.0
    xs, ys, lo, hi = [], [], 0, 0
    t = window
    while t <= end:
        while hi < len(firsts) and firsts[hi][0] <= t:
            hi += 1
        while lo < hi and firsts[lo][0] <= t - window:
            lo += 1
        xs.append(t)
        ys.append(p95(sorted(v for _, v in firsts[lo:hi])))
        t += step
    return xs, ys


def plot(runs: Sequence[RunResult], ttft_target: float, path: Path, title: str | None = None) -> None:
    """Replicas and rolling TTFT p95 over time, one line per policy (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for run in runs:
        ax1.step([t / 60 for t, _, _ in run.timeline], [n for _, n, _ in run.timeline], where="post",
                 label=run.policy)
        xs, ys = run.p95_series if run.p95_series[0] else rolling_p95(run)
        ax2.plot([x / 60 for x in xs], ys, label=run.policy, linewidth=1)
    ax2.axhline(ttft_target, color="grey", linestyle="--", label="target")
    ax1.set_ylabel("replicas (spec)")
    ax2.set_ylabel("TTFT p95, 60 s (s)")
    ax2.set_yscale("log")
    ax2.set_xlabel("minutes")
    ax1.set_title(title or (runs[0].trace if runs else ""))
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
