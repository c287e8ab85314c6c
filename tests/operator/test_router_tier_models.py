"""spec.tieredModels: the models refuse what the CRD's CEL rules refuse, with the same message, and so does the
router's own parser; the operator's defaults and limits are the router's; the CRD's defaults are the models'."""

from __future__ import annotations

import contextlib
import copy
import json
from typing import Any

import pytest
from pydantic import ValidationError

from kvfleet_operator import router_tier_rules as tr
from kvfleet_operator.crd import router_crd
from kvfleet_operator.router_builders import tiers_json
from kvfleet_operator.router_models import InferenceRouterSpec
from kvfleet_operator.router_tier_models import ClassifierSpec, QualitySpec, TierSpec, default_classes
from kvfleet_operator.rules import Rule
from kvfleet_router import tier_config as rt

TWO = [{"model": "small"}, {"model": "large"}]


def tiered(**fields: Any) -> dict[str, Any]:
    """One valid tiered model, with `fields` replaced (classifier and quality: merged into their defaults)."""
    out: dict[str, Any] = {"name": "chat", "tiers": copy.deepcopy(TWO)}
    for key, value in fields.items():
        out[key] = {**out.get(key, {}), **value} if key in ("classifier", "quality") else value
    return out


def cls(**fields: Any) -> dict[str, Any]:
    return {"classifier": {"classes": [{"name": "simple", "tier": 0, **fields}]}}


# (case, spec.tieredModels, the rule it breaks): one mistake per rule; test_every_rule_has_a_case keeps it complete.
CASES: list[tuple[str, list[dict[str, Any]], Rule]] = [
    ("empty name", [tiered(name="")], tr.TIERED_NAME_RULE),
    ("a name twice", [tiered(), tiered()], tr.TIERED_NAMES_UNIQUE_RULE),
    ("one tier", [tiered(tiers=[{"model": "small"}])], tr.TIERS_COUNT_RULE),
    ("nine tiers", [tiered(tiers=[{"model": f"m{i}"} for i in range(9)])], tr.TIERS_COUNT_RULE),
    ("empty tier model", [tiered(tiers=[{"model": ""}, {"model": "large"}])], tr.TIER_MODEL_RULE),
    ("negative cost", [tiered(tiers=[{"model": "small", "cost": -1}, {"model": "large"}])], tr.TIER_COST_RULE),
    ("huge cost", [tiered(tiers=[{"model": "small"}, {"model": "large", "cost": 2e9}])], tr.TIER_COST_RULE),
    ("a tier twice", [tiered(tiers=[{"model": "small"}, {"model": "small"}])], tr.TIERS_DISTINCT_RULE),
    ("the tiered name as a tier", [tiered(tiers=[{"model": "small"}, {"model": "chat"}])], tr.TIERS_DISTINCT_RULE),
    ("class tier past the top", [tiered(**cls(tier=2))], tr.CLASS_TIER_RULE),
    ("negative class tier", [tiered(**cls(tier=-1))], tr.CLASS_TIER_RULE),
    ("class name with capitals", [tiered(classifier={"classes": [{"name": "Simple"}]})], tr.CLASS_NAME_RULE),
    ("class named unmatched", [tiered(classifier={"classes": [{"name": "unmatched"}]})], tr.CLASS_NAME_RULE),
    ("class name too long", [tiered(classifier={"classes": [{"name": "x" * 33}]})], tr.CLASS_NAME_RULE),
    ("class name ending in -", [tiered(classifier={"classes": [{"name": "easy-"}]})], tr.CLASS_NAME_RULE),
    ("no class", [tiered(classifier={"classes": []})], tr.CLASSES_SIZE_RULE),
    ("a class twice", [tiered(classifier={"classes": [{"name": "a"}, {"name": "a", "tier": 1}]})],
     tr.CLASSES_UNIQUE_RULE),
    ("negative maxPromptTokens", [tiered(**cls(maxPromptTokens=-1))], tr.MAX_PROMPT_TOKENS_RULE),
    ("negative maxOutputTokens", [tiered(**cls(maxOutputTokens=-1))], tr.MAX_OUTPUT_TOKENS_RULE),
    ("negative maxTurns", [tiered(**cls(maxTurns=-1))], tr.MAX_TURNS_RULE),
    ("empty marker", [tiered(classifier={"markers": ["```", ""]})], tr.MARKERS_RULE),
    ("instant classifier timeout", [tiered(classifier={"modelTimeoutSeconds": 0})], tr.MODEL_TIMEOUT_RULE),
    ("slow classifier timeout", [tiered(classifier={"modelTimeoutSeconds": 61})], tr.MODEL_TIMEOUT_RULE),
    ("sample rate above 1", [tiered(quality={"sampleRate": 1.5})], tr.SAMPLE_RATE_RULE),
    ("negative sample rate", [tiered(quality={"sampleRate": -0.1})], tr.SAMPLE_RATE_RULE),
    ("threshold above 1", [tiered(quality={"threshold": 1.1, "hysteresis": 0})], tr.THRESHOLD_RULE),
    ("negative hysteresis", [tiered(quality={"hysteresis": -0.1})], tr.HYSTERESIS_RULE),
    ("threshold + hysteresis above 1", [tiered(quality={"threshold": 0.95})], tr.HYSTERESIS_SUM_RULE),
    ("short window", [tiered(quality={"windowSeconds": 0.5})], tr.WINDOW_RULE),
    ("window over a day", [tiered(quality={"windowSeconds": 86401})], tr.WINDOW_RULE),
    ("no samples", [tiered(quality={"minSamples": 0})], tr.MIN_SAMPLES_RULE),
    ("too many replays at once", [tiered(quality={"maxConcurrentReplays": 65})], tr.MAX_CONCURRENT_RULE),
    ("no replay budget", [tiered(quality={"maxReplaysPerMinute": 0})], tr.MAX_PER_MINUTE_RULE),
]


@pytest.mark.parametrize(("tiers", "rule"), [(t, r) for _, t, r in CASES], ids=[c[0] for c in CASES])
def test_rule_rejects_with_its_message_and_the_router_refuses_too(tiers: list[dict[str, Any]], rule: Rule) -> None:
    with pytest.raises(ValidationError) as e:
        InferenceRouterSpec.model_validate({"tieredModels": tiers})
    assert rule.message in str(e.value)
    with pytest.raises(rt.TierConfigError):
        rt.parse_tiers(tiers)


def _validations(node: Any) -> list[dict[str, str]]:
    if isinstance(node, dict):
        return [*node.get("x-kubernetes-validations", []), *(v for x in node.values() for v in _validations(x))]
    if isinstance(node, list):
        return [v for x in node for v in _validations(x)]
    return []


def test_every_rule_has_a_case_and_sits_in_the_crd() -> None:
    ours = {v for v in vars(tr).values() if isinstance(v, Rule)}
    assert ours == {r for _, _, r in CASES}
    in_crd = {(v["rule"], v["message"]) for v in _validations(router_crd())}
    assert {(r.rule, r.message) for r in ours} <= in_crd


# Valid specs at the edges the rules allow: the models and the router accept them, and the router reads the
# operator's rendering (every default written out) as it reads the spec itself (its own defaults filled in).
EDGES: list[list[dict[str, Any]]] = [
    [tiered()],
    [tiered(tiers=[{"model": f"m{i}", "cost": float(i)} for i in range(8)], **cls(tier=7, maxPromptTokens=0,
                                                                                  maxOutputTokens=0, maxTurns=0))],
    [tiered(classifier={"classes": [{"name": "a"}, {"name": "x" * 32, "tier": 1, "markers": True}],
                        "markers": ["TODO"], "model": "classifier", "modelTimeoutSeconds": 0.01}),
     tiered(name="code", tiers=[{"model": "small", "cost": 0}, {"model": "large", "cost": 1e9}])],
    [tiered(classifier={"markers": [], "modelTimeoutSeconds": 60},
            quality={"sampleRate": 0, "threshold": 0, "hysteresis": 1, "windowSeconds": 1, "minSamples": 1,
                     "maxConcurrentReplays": 1, "maxReplaysPerMinute": 1})],
    [tiered(quality={"sampleRate": 1, "threshold": 1, "hysteresis": 0, "windowSeconds": 86400,
                     "minSamples": 100000, "maxConcurrentReplays": 64, "maxReplaysPerMinute": 100000})],
    [tiered(quality={"threshold": 0.7, "hysteresis": 0.3})],
]


@pytest.mark.parametrize("tiers", EDGES)
def test_edges_are_accepted_and_the_rendering_reads_as_the_spec(tiers: list[dict[str, Any]]) -> None:
    spec = InferenceRouterSpec.model_validate({"tieredModels": tiers})
    assert rt.parse_tiers(json.loads(tiers_json(spec))) == rt.parse_tiers(tiers)


def test_threshold_and_hysteresis_draw_the_routers_line_in_doubles() -> None:
    # The sum, in doubles, on all three sides (CEL, pydantic, the router): 0.9 + 0.1 is 1.0 and is accepted, while
    # 1.0 - 0.9 < 0.1 would have refused it. The CRD must never admit what a router would not start with.
    assert rt.parse_tiers([tiered(quality={"threshold": 0.9, "hysteresis": 0.1})])
    for threshold in (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0):
        for hysteresis in (0.0, 0.1, 0.3, 0.5, 0.7, 1.0):
            tiers = [tiered(quality={"threshold": threshold, "hysteresis": hysteresis})]
            try:
                rt.parse_tiers(tiers)
                router = True
            except rt.TierConfigError:
                router = False
            try:
                InferenceRouterSpec.model_validate({"tieredModels": tiers})
                models = True
            except ValidationError:
                models = False
            assert router == models, (threshold, hysteresis)


def test_the_defaults_are_the_routers() -> None:
    assert tr.DEFAULT_MARKERS == rt.DEFAULT_MARKERS and tr.UNMATCHED == rt.UNMATCHED
    assert f"^{rt.CLASS_NAME.pattern}$" == tr.CLASS_NAME_PATTERN
    assert [rt.RequestClass(c.name, c.tier, c.max_prompt_tokens, c.max_output_tokens, c.max_turns, c.markers)
            for c in default_classes()] == list(rt.default_classes())
    classifier, router_classifier = ClassifierSpec(), rt.Classifier(rt.default_classes())
    assert tuple(classifier.markers) == router_classifier.markers and classifier.model is router_classifier.model
    assert classifier.model_timeout_seconds == router_classifier.model_timeout_s
    q, router_q = QualitySpec(), rt.Quality()
    assert (q.sample_rate, q.threshold, q.hysteresis, q.window_seconds, q.min_samples, q.max_concurrent_replays,
            q.max_replays_per_minute) == (router_q.sample_rate, router_q.threshold, router_q.hysteresis,
                                          router_q.window_s, router_q.min_samples, router_q.max_concurrent,
                                          router_q.max_per_minute)
    assert TierSpec(model="m").cost == rt.Tier("m").cost


# (where in a tiered model, lowest allowed, highest allowed, a step past either end)
LIMITS: list[tuple[tuple[str, ...], float, float, float]] = [
    (("tiers", "0", "cost"), 0.0, tr.COST_MAX, 1.0),
    (("classifier", "modelTimeoutSeconds"), tr.MODEL_TIMEOUT_MIN, tr.MODEL_TIMEOUT_MAX, 0.001),
    (("quality", "sampleRate"), 0.0, 1.0, 0.001),
    (("quality", "windowSeconds"), tr.WINDOW_MIN, tr.WINDOW_MAX, 0.5),
    (("quality", "minSamples"), 1, tr.MIN_SAMPLES_MAX, 1),
    (("quality", "maxConcurrentReplays"), 1, tr.MAX_CONCURRENT_MAX, 1),
    (("quality", "maxReplaysPerMinute"), 1, tr.MAX_PER_MINUTE_MAX, 1),
    (("classifier", "classes", "0", "maxPromptTokens"), 0, 0, 1),  # no upper limit: checked below only
]


def _set(obj: dict[str, Any], where: tuple[str, ...], value: float) -> dict[str, Any]:
    node: Any = obj
    for key in where[:-1]:
        node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
    node[where[-1]] = value
    return obj


@pytest.mark.parametrize(("where", "lo", "hi", "step"), LIMITS, ids=[".".join(w) for w, *_ in LIMITS])
def test_the_limits_are_the_routers(where: tuple[str, ...], lo: float, hi: float, step: float) -> None:
    def both(value: float) -> tuple[bool, bool]:
        tiers = [_set(tiered(**cls()), where, value)]
        try:
            rt.parse_tiers(tiers)
            router = True
        except rt.TierConfigError:
            router = False
        try:
            InferenceRouterSpec.model_validate({"tieredModels": tiers})
            models = True
        except ValidationError:
            models = False
        return router, models

    assert both(lo) == (True, True) and both(lo - step) == (False, False)
    if where[-1] != "maxPromptTokens":
        assert both(hi) == (True, True) and both(hi + step) == (False, False)


@pytest.mark.parametrize("n", [1, tr.MIN_TIERS, tr.MAX_TIERS, tr.MAX_TIERS + 1])
def test_the_number_of_tiers_is_the_routers(n: int) -> None:
    tiers = [tiered(tiers=[{"model": f"m{i}"} for i in range(n)])]
    ok = tr.MIN_TIERS <= n <= tr.MAX_TIERS
    with contextlib.nullcontext() if ok else pytest.raises(rt.TierConfigError):
        rt.parse_tiers(tiers)
    with contextlib.nullcontext() if ok else pytest.raises(ValidationError):
        InferenceRouterSpec.model_validate({"tieredModels": tiers})


def _apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """What the apiserver stores for `value`: each absent property with a default gets it, recursively."""
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_apply_defaults(schema["items"], v) for v in value]
    if not isinstance(value, dict):
        return value
    out = dict(value)
    for key, prop in (schema.get("properties") or {}).items():
        if key not in out and "default" in prop:
            out[key] = copy.deepcopy(prop["default"])
        if key in out:
            out[key] = _apply_defaults(prop, out[key])
    return out


def test_the_crd_defaults_a_tiered_model_as_the_models_do() -> None:
    spec = router_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for given in ([tiered()], [tiered(classifier={"model": "cls"}, quality={"threshold": 0.6})]):
        stored = _apply_defaults(spec, {"tieredModels": given})
        assert InferenceRouterSpec.model_validate(stored) == InferenceRouterSpec.model_validate({"tieredModels": given})
        assert json.loads(tiers_json(InferenceRouterSpec.model_validate(stored))) == stored["tieredModels"]
