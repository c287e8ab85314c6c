"""router_tiers, pure: router pods' /metrics texts → status.tieredModels (shares, quality, promotions), and the
TierPromoted / TierDemoted events between two statuses."""

from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest

from kvfleet_operator.config import OperatorConfig
from kvfleet_operator.router_models import InferenceRouter, InferenceRouterSpec, InferenceRouterStatus
from kvfleet_operator.router_plan import RouterPlan, RouterRead, child_keys, make_plan
from kvfleet_operator.router_tier_models import TieredModelSpec
from kvfleet_operator.router_tiers import DEMOTED, PROMOTED, TierEvent, tier_events, tier_status
from kvfleet_router.metrics import RouterMetrics

NOW = "2026-01-01T00:00:00Z"
CFG = OperatorConfig(router_image="router:test")
CHAT = {"name": "chat", "tiers": [{"model": "chat-small"}, {"model": "chat-large", "cost": 4}]}
THREE = {"name": "code", "tiers": [{"model": "s"}, {"model": "m"}, {"model": "l"}],
         "classifier": {"classes": [{"name": "easy", "tier": 0}, {"name": "mid", "tier": 1}]},
         "quality": {"threshold": 0.6}}


def specs(*tiered: dict[str, Any]) -> list[TieredModelSpec]:
    return InferenceRouterSpec.model_validate({"tieredModels": list(tiered)}).tiered_models


def exposition(requests: dict[tuple[str, str, str], float] | None = None,
               promotion: dict[tuple[str, str], float] | None = None,
               quality: dict[tuple[str, str, str], float] | None = None) -> str:
    """A router's /metrics text with the three tier families (and the held gauge beside them), written by hand."""
    lines = ["# HELP kvfleet_router_held_requests Requests held.", "# TYPE kvfleet_router_held_requests gauge",
             "# HELP kvfleet_router_tier_requests_total Requests of tiered models.",
             "# TYPE kvfleet_router_tier_requests_total counter"]
    for (model, tier, cls), n in (requests or {}).items():
        labels = f'model="{model}",tier="{tier}",class="{cls}"'
        lines += [f"kvfleet_router_tier_requests_total{{{labels}}} {n}",
                  f"kvfleet_router_tier_requests_created{{{labels}}} 1.7e9"]  # a timestamp, not a count
    lines += ["# HELP kvfleet_router_tier_promotion Tiers above the base.",
              "# TYPE kvfleet_router_tier_promotion gauge"]
    lines += [f'kvfleet_router_tier_promotion{{model="{m}",class="{c}"}} {v}' for (m, c), v in
              (promotion or {}).items()]
    lines += ["# HELP kvfleet_router_tier_window_quality Mean agreement.",
              "# TYPE kvfleet_router_tier_window_quality gauge"]
    lines += [f'kvfleet_router_tier_window_quality{{model="{m}",tier="{t}",class="{c}"}} {v}' for (m, t, c), v in
              (quality or {}).items()]
    return "\n".join(lines) + "\n"


def test_two_pods_that_disagree_a_garbled_one_and_an_old_one() -> None:
    texts = {
        "ns/r-a": exposition({("chat", "chat-small", "simple"): 30, ("chat", "chat-large", "unmatched"): 10,
                              ("chat", "chat-large", "simple"): 5, ("other", "x", "simple"): 99},
                             {("chat", "simple"): 1, ("chat", "unmatched"): 0},
                             {("chat", "chat-small", "simple"): 0.4213}),
        "ns/r-b": exposition({("chat", "chat-small", "simple"): 10, ("chat", "chat-large", "unmatched"): 20},
                             {("chat", "simple"): 0}, {("chat", "chat-small", "simple"): 0.8}),
        # Garbled after good lines: the whole text is skipped, not what came before the bad line.
        "ns/r-c": exposition({("chat", "chat-small", "simple"): 1000}) + 'kvfleet_router_tier_promotion{model=" 7\n',
        "ns/r-d": "# TYPE kvfleet_router_held_requests gauge\n",  # a router older than the tier metrics
    }
    [chat] = tier_status(specs(CHAT), texts)
    assert chat == {"name": "chat", "routerPods": 2,
                    "tiers": [{"model": "chat-small", "requests": 40, "share": 0.533, "quality": 0.421},
                              {"model": "chat-large", "requests": 35, "share": 0.467}],
                    "promotions": [{"class": "simple", "from": "chat-small", "to": "chat-large", "routerPods": 1}]}


def test_before_any_request_shares_and_quality_are_absent() -> None:
    [chat] = tier_status(specs(CHAT), {"ns/r-a": exposition()})
    assert chat == {"name": "chat", "routerPods": 1, "promotions": [],
                    "tiers": [{"model": "chat-small", "requests": 0}, {"model": "chat-large", "requests": 0}]}
    [none] = tier_status(specs(CHAT), {"ns/r-a": "not an exposition {"})
    assert none["routerPods"] == 0 and none["promotions"] == []


def test_promotions_per_target_tier_capped_at_the_top_and_only_of_known_classes() -> None:
    texts = {f"ns/r-{i}": exposition(promotion={("code", "easy"): p, ("code", "mid"): 5, ("code", "gone"): 1,
                                                ("code", "unmatched"): 1})
             for i, p in enumerate((1, 2, 2))}
    [code] = tier_status(specs(THREE), texts)
    assert code["promotions"] == [{"class": "easy", "from": "s", "to": "m", "routerPods": 1},
                                  {"class": "easy", "from": "s", "to": "l", "routerPods": 2},
                                  {"class": "mid", "from": "m", "to": "l", "routerPods": 3}]


def test_the_routers_own_exposition_reads() -> None:
    m = RouterMetrics()
    m.tiers.requests.labels("chat", "chat-small", "simple").inc(3)
    m.tiers.requests.labels("chat", "chat-large", "unmatched").inc(1)
    m.tiers.promotion.labels("chat", "simple").set(1)
    m.tiers.window_quality.labels("chat", "chat-small", "simple").set(0.25)
    [chat] = tier_status(specs(CHAT), {"ns/r": generate_latest(m.registry).decode()})
    assert chat["routerPods"] == 1 and [(t["requests"], t["share"]) for t in chat["tiers"]] == [(3, 0.75), (1, 0.25)]
    assert chat["tiers"][0]["quality"] == 0.25 and "quality" not in chat["tiers"][1]
    assert chat["promotions"] == [{"class": "simple", "from": "chat-small", "to": "chat-large", "routerPods": 1}]


def status(name: str, *promotions: tuple[str, str, int], pods: int = 1) -> list[dict[str, Any]]:
    return [{"name": name, "routerPods": pods, "tiers": [],
             "promotions": [{"class": c, "from": "?", "to": to, "routerPods": n} for c, to, n in promotions]}]


def test_a_promotion_and_its_demotion() -> None:
    promoted = status("chat", ("simple", "chat-large", 1))
    assert tier_events(specs(CHAT), None, promoted) == [TierEvent(
        PROMOTED, "chat: class simple now served by chat-large instead of chat-small (quality below the threshold 0.5 "
                  "in 1 of 1 router pod(s))")]
    assert tier_events(specs(CHAT), promoted, status("chat")) == [
        TierEvent(DEMOTED, "chat: class simple back on chat-small (quality recovered)")]
    assert tier_events(specs(CHAT), promoted, promoted) == []
    # More pods with the same promotion: the set of (model, class, to) is the same, so no event.
    assert tier_events(specs(CHAT), promoted, status("chat", ("simple", "chat-large", 2), pods=2)) == []


def test_steps_between_three_tiers_and_pods_that_disagree() -> None:
    s = specs(THREE)
    on_m = status("code", ("easy", "m", 1), pods=2)
    on_l = status("code", ("easy", "l", 1), pods=2)
    split = status("code", ("easy", "m", 1), ("easy", "l", 1), pods=2)
    assert [e.reason for e in tier_events(s, [], on_m)] == [PROMOTED]
    assert tier_events(s, on_m, on_l) == [TierEvent(
        PROMOTED, "code: class easy now served by l instead of m (quality below the threshold 0.6 in 1 of 2 router "
                  "pod(s))")]
    assert tier_events(s, on_l, on_m) == [TierEvent(DEMOTED, "code: class easy back on m (quality recovered)")]
    assert tier_events(s, on_m, split) == [TierEvent(
        PROMOTED, "code: class easy now served by l instead of m (quality below the threshold 0.6 in 1 of 2 router "
                  "pod(s))")]
    assert tier_events(s, split, on_m) == [TierEvent(DEMOTED, "code: class easy back on m (quality recovered)")]
    assert tier_events(s, split, []) == [TierEvent(DEMOTED, "code: class easy back on s (quality recovered)")]
    both = tier_events(s, [], split)
    assert [e.reason for e in both] == [PROMOTED, PROMOTED] and all("instead of s " in e.message for e in both)


def test_no_events_for_models_or_classes_the_spec_no_longer_names() -> None:
    assert tier_events(specs(CHAT), status("gone", ("simple", "x", 1)), []) == []
    assert tier_events(specs(CHAT), status("chat", ("renamed", "chat-large", 1)), status("chat")) == []
    assert tier_events(specs(CHAT), status("chat", ("simple", "retired-tier", 1)), status("chat")) == []


def plan_for(spec: dict[str, Any], texts: dict[str, str] | None, current: dict[str, Any] | None = None) -> RouterPlan:
    body = {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceRouter",
            "metadata": {"name": "r", "namespace": "ns", "uid": "u1", "generation": 1}, "spec": spec,
            "status": current or {}}
    cr = InferenceRouter.model_validate(body)
    return make_plan(body, RouterRead({key: None for key in child_keys(cr)}, (), {}, None, texts), CFG)


def test_the_plan_reports_the_tiers_and_keeps_them_while_no_router_pod_answers() -> None:
    spec = {"tieredModels": [CHAT]}
    texts = {"ns/r-0": exposition({("chat", "chat-small", "simple"): 3}, {("chat", "simple"): 1})}
    first = plan_for(spec, texts).status_to_write(deployment=None, errors=(), now=NOW)
    assert first is not None and first["tieredModels"] == tier_status(specs(CHAT), texts)
    assert [e.reason for e in plan_for(spec, texts).events(first)] == [PROMOTED]
    # No router pod answered, or none with tier metrics: the status as read stays (no zeros nobody measured).
    for nothing in (None, {}, {"ns/r-0": "# TYPE kvfleet_router_held_requests gauge\n"}):
        kept = plan_for(spec, nothing, first)
        assert kept.status_to_write(deployment=None, errors=(), now=NOW) is None
        assert kept.status(deployment=None, errors=(), now=NOW)["tieredModels"] == first["tieredModels"]
        assert kept.events(first) == []
    # A tiered model added meanwhile is not reported until measured; one removed is no longer kept.
    added = plan_for({"tieredModels": [CHAT, THREE]}, None, first).status(deployment=None, errors=(), now=NOW)
    assert [m["name"] for m in added["tieredModels"]] == ["chat"]
    assert "tieredModels" not in plan_for({"tieredModels": [THREE]}, None, first).status(
        deployment=None, errors=(), now=NOW)


def test_without_tiered_models_the_status_has_no_tiers_and_losing_them_is_written() -> None:
    texts = {"ns/r-0": exposition({("chat", "chat-small", "simple"): 3})}
    assert "tieredModels" not in plan_for({}, texts).status(deployment=None, errors=(), now=NOW)
    measured = plan_for({"tieredModels": [CHAT]}, texts).status_to_write(deployment=None, errors=(), now=NOW)
    assert measured is not None
    dropped = plan_for({}, texts, measured).status_to_write(deployment=None, errors=(), now=NOW)
    assert dropped is not None and "tieredModels" not in dropped
    InferenceRouterStatus.model_validate(measured)
