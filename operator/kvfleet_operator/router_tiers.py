"""Pure: the router pods' tier metrics → an InferenceRouter's status.tieredModels, and the promotion events between
the status as read and the new one."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvfleet_contract import metrics as contract
from kvfleet_operator.router_tier_models import TieredModelSpec
from kvfleet_operator.router_tier_rules import UNMATCHED

PROMOTED, DEMOTED = "TierPromoted", "TierDemoted"


@dataclass(frozen=True)
class TierEvent:
    """A kopf event to post on the InferenceRouter (type Normal)."""

    reason: str
    message: str


@dataclass
class _Pod:
    """One router pod's tier families: requests by (model, tier, class), promotion by (model, class), last window
    quality by (model, tier, class)."""

    requests: dict[tuple[str, str, str], float] = field(default_factory=dict)
    promotion: dict[tuple[str, str], float] = field(default_factory=dict)
    quality: dict[tuple[str, str, str], float] = field(default_factory=dict)


def _read(text: str) -> _Pod | None:
    """One pod's exposition; None when it does not parse, or has no tier families (a router older than them)."""
    pod, seen = _Pod(), False
    total = f"{contract.ROUTER_TIER_REQUESTS}_total"  # a counter's count (its _created sample is a timestamp)
    try:
        for fam in text_string_to_metric_families(text):
            # The requests' TYPE line is there before any request; the parser names a counter without _total.
            seen = seen or fam.name in (contract.ROUTER_TIER_REQUESTS, total)
            for s in fam.samples:
                model, tier = s.labels.get(contract.TIERED_MODEL_LABEL, ""), s.labels.get(contract.TIER_LABEL, "")
                cls = s.labels.get(contract.CLASS_LABEL, "")
                if not math.isfinite(s.value):
                    continue
                if s.name == total:
                    pod.requests[model, tier, cls] = pod.requests.get((model, tier, cls), 0.0) + s.value
                elif s.name == contract.ROUTER_TIER_PROMOTION:
                    pod.promotion[model, cls] = s.value
                elif s.name == contract.ROUTER_TIER_WINDOW_QUALITY:
                    pod.quality[model, tier, cls] = s.value
    except (ValueError, KeyError, IndexError):  # the parser raises ValueError on any malformed line
        return None
    return pod if seen else None


def _base(tm: TieredModelSpec, cls: str) -> int | None:
    """The tier index a class is served by unless promoted; None for a class the spec does not name."""
    if cls == UNMATCHED:
        return len(tm.tiers) - 1
    return next((c.tier for c in tm.classifier.classes if c.name == cls), None)


def _classes(tm: TieredModelSpec) -> list[str]:
    return [*(c.name for c in tm.classifier.classes), UNMATCHED]


def _one(tm: TieredModelSpec, pods: Sequence[_Pod]) -> dict[str, Any]:
    models = [t.model for t in tm.tiers]
    requests = {m: sum(v for p in pods for (n, t, _), v in p.requests.items() if n == tm.name and t == m)
                for m in models}
    total = sum(requests.values())
    tiers = []
    for m in models:
        entry: dict[str, Any] = {"model": m, "requests": round(requests[m])}
        if total > 0:
            entry["share"] = round(requests[m] / total, 3)
        scores = [v for p in pods for (n, t, _), v in p.quality.items() if n == tm.name and t == m]
        if scores:
            entry["quality"] = round(min(scores), 3)
        tiers.append(entry)
    promotions = []
    for cls in _classes(tm):
        base = _base(tm, cls)
        if base is None:
            continue
        at: dict[int, int] = {}  # tier index serving the class now → pods
        for p in pods:
            steps = round(p.promotion.get((tm.name, cls), 0.0))
            to = min(base + steps, len(models) - 1)
            if to > base:
                at[to] = at.get(to, 0) + 1
        promotions += [{"class": cls, "from": models[base], "to": models[to], "routerPods": n}
                       for to, n in sorted(at.items())]
    return {"name": tm.name, "routerPods": len(pods), "tiers": tiers, "promotions": promotions}


def tier_status(specs: Sequence[TieredModelSpec], texts: Mapping[str, str]) -> list[dict[str, Any]]:
    """status.tieredModels (camelCase, as written) from the spec's tiered models and each router pod's /metrics
    text (by pod name). Texts that do not parse, or lack the tier families, are skipped: routerPods counts the
    others. Requests are summed over the pods; quality is the lowest last-window mean over classes and pods."""
    pods = [p for p in (_read(texts[name]) for name in sorted(texts)) if p is not None]
    return [_one(tm, pods) for tm in specs]


def _promotions(status: Sequence[Mapping[str, Any]] | None, name: str) -> tuple[dict[str, dict[str, int]], int]:
    """A status's promotions of one tiered model: class → {to → router pods}; and its routerPods."""
    out: dict[str, dict[str, int]] = {}
    for entry in status or ():
        if entry.get("name") == name:
            for p in entry.get("promotions") or ():
                out.setdefault(str(p.get("class")), {})[str(p.get("to"))] = int(p.get("routerPods") or 0)
            return out, int(entry.get("routerPods") or 0)
    return out, 0


def _class_events(tm: TieredModelSpec, cls: str, old: Mapping[str, int], new: Mapping[str, int],
                  pods: int) -> list[TierEvent]:
    models = [t.model for t in tm.tiers]
    base = _base(tm, cls)
    if base is None:
        return []
    # Tier indices of the promotions (one per `to`: pods may disagree); one the tiers no longer list is left out.
    was = {models.index(m) for m in old if m in models}
    now = {models.index(m) for m in new if m in models}
    added, removed = sorted(now - was), sorted(was - now)
    events = []
    for a in added:
        if any(r > a for r in removed):  # pods that served the class higher now serve it from this lower tier
            events.append(TierEvent(DEMOTED, f"{tm.name}: class {cls} back on {models[a]} (quality recovered)"))
        else:
            prev = max((w for w in was if w < a), default=base)
            events.append(TierEvent(PROMOTED, f"{tm.name}: class {cls} now served by {models[a]} instead of "
                                              f"{models[prev]} (quality below the threshold "
                                              f"{tm.quality.threshold:g} in {new[models[a]]} of {pods} router "
                                              "pod(s))"))
    if not added:  # only removals: those pods serve the class from the next promotion below, or its own tier
        for to in sorted({max((n for n in now if n < r), default=base) for r in removed}):
            events.append(TierEvent(DEMOTED, f"{tm.name}: class {cls} back on {models[to]} (quality recovered)"))
    return events


def tier_events(specs: Sequence[TieredModelSpec], old: Sequence[Mapping[str, Any]] | None,
                new: Sequence[Mapping[str, Any]] | None) -> list[TierEvent]:
    """The events for the change from status.tieredModels `old` (as read) to `new` (as written): TierPromoted for
    each class served by a new or higher tier, TierDemoted for each one back on a lower tier. A removed tiered
    model, or a class the spec no longer names, gets none."""
    events = []
    for tm in specs:
        was, _ = _promotions(old, tm.name)
        now, pods = _promotions(new, tm.name)
        for cls in _classes(tm):
            if was.get(cls, {}).keys() != now.get(cls, {}).keys():
                events += _class_events(tm, cls, was.get(cls, {}), now.get(cls, {}), pods)
    return events
