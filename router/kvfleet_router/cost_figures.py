"""The cost report's figures from its two runs (tiered, then the top tier alone), and the table that prints them."""

from __future__ import annotations

import argparse
import collections
import json
import sys
from typing import Any

from kvfleet_router.agreement import agreement
from kvfleet_router.cost_workload import EXPECTED, LARGE, MIX, SMALL, TIERED, Request, quotas
from kvfleet_router.tier_config import UNMATCHED

Z95 = 1.959964
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]  # a /metrics page: (sample name, labels) → value


def total(s: Samples, name: str, **labels: str) -> float:
    """The sum of one sample name over the label sets that contain `labels`."""
    return sum(v for (n, ls), v in s.items() if n == name and all((k, x) in ls for k, x in labels.items()))


def wilson(k: int, n: int) -> list[float] | None:
    """The 95% Wilson score interval of k successes in n trials."""
    if not n:
        return None
    p, z2 = k / n, Z95 * Z95
    mid, half = (p + z2 / (2 * n)) / (1 + z2 / n), Z95 * (p * (1 - p) / n + z2 / (4 * n * n)) ** 0.5 / (1 + z2 / n)
    return [max(0.0, mid - half), min(1.0, mid + half)]


def share(k: int, n: int) -> dict[str, Any]:
    """k of n, their share and its 95% Wilson interval (None for n = 0)."""
    return {"n": n, "k": k, "share": k / n if n else None, "wilson95": wilson(k, n)}


def classes(a: argparse.Namespace, reqs: list[Request], tiered: list[dict[str, Any]], top: list[dict[str, Any]],
            r: Samples) -> dict[str, Any]:
    """Per generated class: how the router classified and served it; the monitor's scores (histogram: k answers of
    n scored at or below the threshold); and every lower-tier answer scored here against the top-only run's."""
    out: dict[str, Any] = {}
    for cls in MIX:
        idx = [i for i, q in enumerate(reqs) if q.cls == cls]
        scores = [agreement(tiered[i]["text"], top[i]["text"]) for i in idx if tiered[i].get("tier") == SMALL]
        out[cls] = {"requests": len(idx),
                    "assigned": dict(collections.Counter(tiered[i].get("class", "none") for i in idx)),
                    "served_by": dict(collections.Counter(tiered[i].get("tier", "none") for i in idx)),
                    "recomputed_below": share(sum(x < a.threshold for x in scores), len(scores)),
                    "recomputed_mean": sum(scores) / len(scores) if scores else None}
        if EXPECTED[cls] != UNMATCHED:
            labels = {"model": TIERED, "tier": SMALL, "class": cls}
            scored = round(total(r, "kvfleet_router_tier_quality_count", **labels))
            out[cls]["monitor_at_or_below"] = share(
                round(total(r, "kvfleet_router_tier_quality_bucket", le=repr(float(a.threshold)), **labels)), scored)
            mean = total(r, "kvfleet_router_tier_quality_sum", **labels) / scored if scored else None
            out[cls]["monitor_mean"] = mean
    return out


def figures(a: argparse.Namespace, reqs: list[Request], runs: dict[str, Any], costs: dict[str, float],
            params: dict[str, int], tiers: list[dict[str, Any]]) -> dict[str, Any]:
    """Every figure of the report, from the two runs."""
    t, o, k = runs["tiered"], runs["top_only"], 1000 / len(reqs)
    r = t["router"]
    per_k: dict[str, dict[str, Any]] = {"busy_s": {}, "cpu_s": {}}
    for measure, run in ((x, y) for x in per_k for y in runs):
        if None in (seconds := runs[run][measure]).values():
            continue  # no /proc: no CPU seconds
        # Everything on the top tier is a fleet without code-small: its CPU then is only the polls it answered.
        row = {m: seconds[m] * k for m in ((SMALL, LARGE) if run == "tiered" else (LARGE,))}
        per_k[measure][run] = {**row, "total": sum(row.values()), "cost_weighted": sum(row[m] * costs[m] for m in row)}
    per_class = classes(a, reqs, t["answers"], o["answers"], r)
    monitored = [per_class[c]["monitor_at_or_below"] for c in per_class if EXPECTED[c] != UNMATCHED]
    promotions = {c: total(r, "kvfleet_router_tier_promotions_total", model=TIERED, **{"class": c})
                  for c in ("simple", "medium")}
    outcomes = {dict(ls)["outcome"] for (name, ls) in r if name == "kvfleet_router_tier_verifications_total"}
    return {
        "command": ["python", "-m", "kvfleet_router.cost_report", *sys.argv[1:]],
        "models": {m: {"dir": d, "parameters": params[m], "cost": costs[m]} for m, d in ((SMALL, a.small),
                                                                                       (LARGE, a.large))},
        "large_cost_source": "--large-cost" if a.large_cost is not None else "parameter ratio",
        "settings": {x: getattr(a, x) for x in ("requests", "seed", "concurrency", "sample_rate", "threshold",
                                                "window", "min_samples", "length_scale", "poll_interval",
                                                "agent_threads")},
        "tiers": tiers, "mix": MIX,
        "requests_per_class": quotas(len(reqs)),
        "busy_method": "wall time while kvfleet_requests_running > 0, polled (a left Riemann sum)",
        "errors": {run: sum(x["status"] != 200 for x in runs[run]["answers"]) for run in runs},
        "runs": {run: {x: runs[run][x] for x in ("wall_s", "busy_s", "cpu_s", "agent_requests",
                                                 "agent_generation_tokens")} for run in runs},
        "replica_seconds_per_1000": per_k["busy_s"],
        "ratio": {x: per_k["busy_s"]["tiered"][x] / per_k["busy_s"]["top_only"][x] for x in ("total", "cost_weighted")},
        "cpu_seconds_per_1000": per_k["cpu_s"],
        "cpu_ratio": {x: per_k["cpu_s"]["tiered"][x] / per_k["cpu_s"]["top_only"][x]
                      for x in ("total", "cost_weighted")} if per_k["cpu_s"] else None,
        # An idle agent's CPU answering the busy-time polls (code-small during the top-only run), per second.
        "idle_poll_cpu_share": None if o["cpu_s"][SMALL] is None else o["cpu_s"][SMALL] / o["wall_s"],
        "router_cost_units_per_1000": {
            "tiered_served": total(r, "kvfleet_router_tier_cost_units_total", model=TIERED) * k,
            "tiered_replays": total(r, "kvfleet_router_tier_replay_cost_units_total", model=TIERED) * k,
            "top_only": costs[LARGE] * 1000},
        "router_tier_requests": {c: {m: total(r, "kvfleet_router_tier_requests_total", model=TIERED, tier=m,
                                              **{"class": c}) for m in (SMALL, LARGE)}
                                 for c in ("simple", "medium", UNMATCHED)},
        "replays": total(r, "kvfleet_router_tier_replays_total", model=TIERED),
        # Replays the tiered run's drain missed would land here, during the top-only run: 0 says the drain held.
        "late_replays": total(o["router"], "kvfleet_router_tier_replays_total")
        - total(r, "kvfleet_router_tier_replays_total"),
        "verifications": {x: total(r, "kvfleet_router_tier_verifications_total", outcome=x) for x in sorted(outcomes)},
        "classes": per_class,
        "monitor_at_or_below": share(sum(m["k"] for m in monitored), sum(m["n"] for m in monitored)),
        "recomputed_below": share(sum(c["recomputed_below"]["k"] for c in per_class.values()),
                                  sum(c["recomputed_below"]["n"] for c in per_class.values())),
        "promotions": promotions, "promoted": any(promotions.values()),
        "promoted_requests": sum("promoted-from" in x for x in t["answers"]),
    }


def pct(s: dict[str, Any], mean: float | None = None) -> str:
    """k/n share [95% interval] (and the mean score), or a dash for none."""
    if not s["n"]:
        return "-"
    lo, hi = s["wilson95"]
    return f"{s['k']}/{s['n']} = {s['share']:.0%} [{lo:.0%}, {hi:.0%}]" + ("" if mean is None else f", mean {mean:.2f}")


def table(f: dict[str, Any]) -> str:
    """The report as text."""
    m, thr = f["models"], f["settings"]["threshold"]
    mix = ", ".join(f"{c} {k}" for c, k in f["requests_per_class"].items())
    cu = f["router_cost_units_per_1000"]
    lines = [f"{f['settings']['requests']} requests ({mix}), greedy, concurrency {f['settings']['concurrency']}",
             f"{SMALL}: {m[SMALL]['parameters']:,} parameters, cost 1; {LARGE}: {m[LARGE]['parameters']:,} "
             f"parameters, cost {m[LARGE]['cost']:.2f} ({f['large_cost_source']})", "",
             f"{'per 1,000 requests':<32}{SMALL:>11}{LARGE:>11}{'total':>9}{'x cost':>9}"]
    for title, per_k, ratio in (("replica-seconds (busy time)", f["replica_seconds_per_1000"], f["ratio"]),
                                ("agent CPU-seconds (/proc)", f["cpu_seconds_per_1000"], f["cpu_ratio"])):
        if not per_k:
            continue
        lines.append(title)
        for run, label in (("tiered", f"tiered ({f['replays']:.0f} replays on top)"), ("top_only", "top tier only")):
            x = per_k[run]
            small = f"{x[SMALL]:>11.1f}" if SMALL in x else f"{'-':>11}"
            lines.append(f"  {label:<30}{small}{x[LARGE]:>11.1f}{x['total']:>9.1f}{x['cost_weighted']:>9.1f}")
        lines.append(f"  {'tiered / top tier only':<52}{ratio['total']:>9.2f}{ratio['cost_weighted']:>9.2f}")
    lines += [f"router cost units per 1,000 requests: tiered {cu['tiered_served']:.0f} served + "
              f"{cu['tiered_replays']:.0f} replays; top tier only {cu['top_only']:.0f}", "",
              f"agreement with {LARGE} (ROUGE-L F1), 95% Wilson intervals",
              f"{'class':<9}{'served by':<17}{'monitor: scored <= ' + str(thr):<42}every lower-tier answer < {thr}"]
    for cls, c in f["classes"].items():
        served = ", ".join(f"{k} {v}" for k, v in sorted(c["served_by"].items()))
        monitor = pct(c["monitor_at_or_below"], c["monitor_mean"]) if "monitor_at_or_below" in c else "-"
        lines.append(f"{cls:<9}{served:<17}{monitor:<42}{pct(c['recomputed_below'], c['recomputed_mean'])}")
    promoted = ", ".join(f"{c} {n:.0f}" for c, n in f["promotions"].items() if n) or "none"
    lines += [f"{'all':<26}{pct(f['monitor_at_or_below']):<42}{pct(f['recomputed_below'])}", "",
              f"verifications: {json.dumps(f['verifications'])}; promotions: {promoted}; late replays: "
              f"{f['late_replays']:.0f}; errors: {json.dumps(f['errors'])}"]
    return "\n".join(lines)
