"""Per-request records, latency statistics, goodput, the summary table and the latency plot of a load test."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Status = Literal["pending", "ok", "failed", "rejected", "cancelled"]
PERCENTILES: tuple[int, ...] = (50, 90, 95, 99)


@dataclass
class RequestRecord:
    """What one request did. Times are perf_counter seconds (start, end) or seconds relative to start.

    The runner owns index, scheduled_s, start, end and cancellation; the sender fills in the rest as
    the response streams in, so a request cancelled halfway still reports what it had received.
    """

    index: int
    scheduled_s: float  # when it was due, from the beginning of the run
    prompt_words: int | None = None  # synthetic prompts: their length in words (about one token each)
    max_tokens: int | None = None
    start: float | None = None
    end: float | None = None
    status: Status = "pending"
    http_status: int | None = None
    error: str | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None  # as the server reported in usage
    finish_reason: str | None = None
    retry_after_s: float | None = None

    @property
    def e2e_s(self) -> float | None:
        return None if self.start is None or self.end is None else self.end - self.start

    @property
    def mean_itl_s(self) -> float | None:
        return sum(self.itl_s) / len(self.itl_s) if self.itl_s else None

    def to_json(self, t0: float, slo: Slo) -> dict[str, Any]:
        """JSON-ready form; t0 is the run's start (perf_counter), latencies in milliseconds."""
        return {
            "index": self.index,
            "status": self.status,
            "http_status": self.http_status,
            "error": self.error,
            "scheduled_s": self.scheduled_s,
            "start_s": None if self.start is None else self.start - t0,
            "ttft_ms": _ms(self.ttft_s),
            "e2e_ms": _ms(self.e2e_s),
            "mean_itl_ms": _ms(self.mean_itl_s),
            # Rounded to 0.1 µs, far below what the clock resolves: long runs hold millions of gaps.
            "itl_ms": [round(x * 1e3, 4) for x in self.itl_s],
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "prompt_words": self.prompt_words,
            "max_tokens": self.max_tokens,
            "finish_reason": self.finish_reason,
            "retry_after_s": self.retry_after_s,
            "good": is_good(self, slo) if slo.given else None,
        }


@dataclass(frozen=True)
class Slo:
    """Service-level objectives for goodput, in seconds; None means that objective is not checked."""

    ttft_s: float | None = None
    itl_s: float | None = None

    @property
    def given(self) -> bool:
        return self.ttft_s is not None or self.itl_s is not None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), interpolating linearly between order statistics like numpy's default."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    h = (q / 100.0) * (len(xs) - 1)
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    t = h - lo
    a, b = xs[lo], xs[hi]
    # Interpolate from the nearer end so that the result is exact at both ends and monotonic in q.
    return a + (b - a) * t if t < 0.5 else b - (b - a) * (1.0 - t)


def distribution(values: Sequence[float], scale: float = 1.0) -> dict[str, float | None]:
    """Mean and the standard percentiles of values times scale; all None for no values."""
    keys = ["mean"] + [f"p{p}" for p in PERCENTILES]
    if not values:
        return dict.fromkeys(keys)
    out: dict[str, float | None] = {"mean": scale * sum(values) / len(values)}
    for p in PERCENTILES:
        out[f"p{p}"] = scale * percentile(values, p)
    return out


def is_good(rec: RequestRecord, slo: Slo) -> bool:
    """A successful request whose TTFT and mean ITL are within the SLOs.

    A request with no inter-token gap (one output chunk) has nothing that can miss the ITL objective;
    one that produced no text at all has no TTFT and misses a TTFT objective.
    """
    if rec.status != "ok":
        return False
    if slo.ttft_s is not None and (rec.ttft_s is None or rec.ttft_s > slo.ttft_s):
        return False
    mean_itl = rec.mean_itl_s
    return not (slo.itl_s is not None and mean_itl is not None and mean_itl > slo.itl_s)


def count_good(records: Iterable[RequestRecord], slo: Slo) -> int:
    return sum(1 for r in records if is_good(r, slo))


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: Slo, stop_reason: str) -> dict[str, Any]:
    """The run's summary: counts, throughputs over the run's wall time, goodput, and latency distributions in ms.

    Throughputs and latencies count successful requests only, so a failing server cannot look fast.
    """
    ok = [r for r in records if r.status == "ok"]
    counts = {s: sum(1 for r in records if r.status == s) for s in ("ok", "failed", "rejected", "cancelled")}
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(_input_tokens(r) for r in ok)
    per_s = (1.0 / duration_s) if duration_s > 0 else 0.0
    good = count_good(records, slo) if slo.given else None
    return {
        "stop_reason": stop_reason,
        "duration_s": duration_s,
        "requests": len(records),
        "completed": counts["ok"],
        "failed": counts["failed"],
        "rejected": counts["rejected"],
        "cancelled": counts["cancelled"],
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": counts["ok"] * per_s,
        "output_token_throughput": out_tokens * per_s,
        "total_token_throughput": (in_tokens + out_tokens) * per_s,
        "slo": {"ttft_ms": _ms(slo.ttft_s), "itl_ms": _ms(slo.itl_s)},
        "good_requests": good,
        "goodput": None if good is None else good * per_s,
        "ttft_ms": distribution([r.ttft_s for r in ok if r.ttft_s is not None], 1e3),
        "itl_ms": distribution([x for r in ok for x in r.itl_s], 1e3),
        "e2e_ms": distribution([e for r in ok if (e := r.e2e_s) is not None], 1e3),
    }


def _input_tokens(rec: RequestRecord) -> int:
    # The server's count when it reports usage; otherwise the synthetic prompt's word count, which the
    # word list keeps close to one token per word. Prompts from a file without usage count as zero.
    if rec.prompt_tokens is not None:
        return rec.prompt_tokens
    return rec.prompt_words or 0


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


def format_table(summary: dict[str, Any]) -> str:
    """The summary as a fixed-width text table for stdout."""
    w = 44
    slo = summary["slo"]
    slo_text = ", ".join(f"{k.split('_')[0].upper()} <= {v:g} ms" for k, v in slo.items() if v is not None)
    lines = [
        " Serving benchmark result ".center(w + 16, "="),
        f"{'Stop reason:':<{w}}{summary['stop_reason']:>16}",
        f"{'Duration (s):':<{w}}{summary['duration_s']:>16.2f}",
        f"{'Requests issued:':<{w}}{summary['requests']:>16}",
        f"{'Successful:':<{w}}{summary['completed']:>16}",
        f"{'Failed:':<{w}}{summary['failed']:>16}",
        f"{'Rejected (429):':<{w}}{summary['rejected']:>16}",
        f"{'Cancelled at the time bound:':<{w}}{summary['cancelled']:>16}",
        f"{'Total input tokens:':<{w}}{summary['total_input_tokens']:>16}",
        f"{'Total output tokens:':<{w}}{summary['total_output_tokens']:>16}",
        f"{'Request throughput (req/s):':<{w}}{summary['request_throughput']:>16.2f}",
        f"{'Output token throughput (tok/s):':<{w}}{summary['output_token_throughput']:>16.2f}",
        f"{'Total token throughput (tok/s):':<{w}}{summary['total_token_throughput']:>16.2f}",
    ]
    if summary["goodput"] is None:
        lines.append(f"{'Goodput (req/s):':<{w}}{'n/a (no SLO)':>16}")
    else:
        lines.append(f"{'Goodput (req/s):':<{w}}{summary['goodput']:>16.2f}")
        lines.append(f"{'Good requests (' + slo_text + '):':<{w}}{summary['good_requests']:>16}")
    cols = ["mean"] + [f"p{p}" for p in PERCENTILES]
    lines.append("-" * (w + 16))
    lines.append(f"{'(ms)':<12}" + "".join(f"{c:>10}" for c in cols))
    for key, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        lines.append(f"{label:<12}" + "".join(f"{_num(summary[key][c]):>10}" for c in cols))
    lines.append("=" * (w + 16))
    return "\n".join(lines)


def write_plot(path: str, records: Sequence[RequestRecord], t0: float, summary: dict[str, Any]) -> None:
    """PNG: TTFT and E2E of each successful request against its start time, and the ITL percentiles.

    matplotlib is imported here, not at module level, so the load generator runs where it is missing;
    the Figure/Agg objects are used directly so no global pyplot backend is switched in the caller's process.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_t, ax_i = fig.subplots(1, 2, width_ratios=[2.2, 1])
    ok = [r for r in records if r.status == "ok" and r.start is not None]
    starts = [r.start - t0 for r in ok if r.start is not None]
    ax_t.scatter(starts, [(r.e2e_s or 0.0) * 1e3 for r in ok], s=8, label="E2E", color="tab:blue")
    with_ttft = [r for r in ok if r.ttft_s is not None and r.start is not None]
    ax_t.scatter([r.start - t0 for r in with_ttft if r.start is not None], [(r.ttft_s or 0.0) * 1e3 for r in with_ttft],
                 s=8, label="TTFT", color="tab:orange")
    bad = [r for r in records if r.status in ("failed", "rejected", "cancelled") and r.start is not None]
    if bad:
        ax_t.scatter([r.start - t0 for r in bad if r.start is not None], [0.0] * len(bad), marker="x", s=14,
                     color="tab:red", label="failed / rejected / cancelled")
    if summary["slo"]["ttft_ms"] is not None:
        ax_t.axhline(summary["slo"]["ttft_ms"], color="tab:orange", linestyle="--", linewidth=1, label="TTFT SLO")
    ax_t.set_xlabel("request start (s)")
    ax_t.set_ylabel("latency (ms)")
    ax_t.set_title("TTFT and E2E per request")
    ax_t.legend(loc="best", fontsize="small")
    ax_t.grid(True, alpha=0.3)

    itl = summary["itl_ms"]
    names = [f"p{p}" for p in PERCENTILES] + ["mean"]
    ax_i.bar(names, [itl[n] or 0.0 for n in names], color="tab:green")
    if summary["slo"]["itl_ms"] is not None:
        ax_i.axhline(summary["slo"]["itl_ms"], color="tab:red", linestyle="--", linewidth=1, label="ITL SLO")
        ax_i.legend(loc="upper left", fontsize="small")
    ax_i.set_ylabel("inter-token latency (ms)")
    ax_i.set_title("ITL percentiles")
    ax_i.grid(True, axis="y", alpha=0.3)
    fig.savefig(path, format="png", dpi=110)
