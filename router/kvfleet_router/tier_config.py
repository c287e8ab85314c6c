"""Tiered models as the router reads them (--tiers JSON, which the operator renders from an InferenceRouter's
spec.tieredModels): one public model name standing for served models ordered cheapest first, the classifier that
assigns each request a class (and the class its base tier), and the quality monitor's settings.

The operator validates the same shape with CEL rules; this parser checks it again (a router run by hand gets the
same messages), naming the field and the fix.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLASS_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?")
UNMATCHED = "unmatched"  # the class of a request no configured class matches: served by the top tier
# Case-insensitive substrings that mark code or multi-step reasoning (the seed's "complex" requests).
DEFAULT_MARKERS = ("```", "def ", "class ", "function", "step by step", "prove", "explain why", "reason",
                   "analyze", "analyse", "derive")


class TierConfigError(ValueError):
    """A tiered-model setting that cannot work; the message names the field (JSON path) and the fix."""


@dataclass(frozen=True)
class Tier:
    """One tier: a model name an InferenceDeployment serves (its spec.model.name), and its relative cost."""

    model: str
    cost: float = 1.0  # per request, relative to the other tiers: the cost proxy's unit


@dataclass(frozen=True)
class RequestClass:
    """A class of requests and the tier that serves it unless the monitor promoted it. A request belongs to the
    first class whose every given limit holds (None: no limit on that feature)."""

    name: str
    tier: int  # index into the tiers, 0 the cheapest
    max_prompt_tokens: int | None = None  # estimated: prompt characters / 4, rounded up
    max_output_tokens: int | None = None  # the request's max_tokens; a request that states none is not limited
    max_turns: int | None = None  # user messages in a chat; a completion is one turn
    markers: bool | None = None  # False: only requests without any marker; True: only requests with one


@dataclass(frozen=True)
class Classifier:
    """Request features → a class. With `model`, a served model labels each request (its answer constrained to
    the class names); the features decide when it fails or takes longer than `model_timeout_s`."""

    classes: tuple[RequestClass, ...]
    markers: tuple[str, ...] = DEFAULT_MARKERS
    model: str | None = None
    model_timeout_s: float = 1.0


@dataclass(frozen=True)
class Quality:
    """The quality monitor: which share of lower-tier answers it replays on the top tier, how it judges them
    (agreement scores in [0, 1], see agreement.py), and its bounds."""

    sample_rate: float = 0.05
    threshold: float = 0.5  # a class is promoted when its window's mean agreement stays below this
    hysteresis: float = 0.1  # ... and demoted when the tier below scores at least threshold + hysteresis
    window_s: float = 300.0
    min_samples: int = 20  # a window with fewer scores decides nothing (it keeps collecting)
    max_concurrent: int = 2  # replays in flight at once, per tiered model
    max_per_minute: int = 60  # replays started per minute, per tiered model (the verification budget)


@dataclass(frozen=True)
class TieredModel:
    """A public model name served by tiers, cheapest first."""

    name: str
    tiers: tuple[Tier, ...]
    classifier: Classifier
    quality: Quality = field(default_factory=Quality)

    @property
    def top(self) -> int:
        """The top tier's index: the reference the monitor verifies against."""
        return len(self.tiers) - 1


def default_classes() -> tuple[RequestClass, ...]:
    """Short, marker-free, shallow requests on the cheapest tier; everything else is unmatched (the top tier)."""
    return (RequestClass("simple", 0, max_prompt_tokens=512, max_output_tokens=256, max_turns=4, markers=False),)


def _get(obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str, default: Any = None) -> Any:
    value = obj.get(key, default)
    if value is None:
        return default
    # bool is an int in Python: a JSON true is no count.
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple)
                                                                                 else (kind,))):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise TierConfigError(f"{where}.{key}: expected {names}, got {json.dumps(value)}")
    return value


def _number(obj: Mapping[str, Any], key: str, where: str, default: float, lo: float, hi: float,
            fix: str) -> float:
    value = float(_get(obj, key, (int, float), where, default))
    if not lo <= value <= hi:
        raise TierConfigError(f"{where}.{key}={value:g} must be between {lo:g} and {hi:g}: {fix}")
    return value


def _limit(obj: Mapping[str, Any], key: str, where: str) -> int | None:
    value = _get(obj, key, int, where)
    if value is not None and value < 0:
        raise TierConfigError(f"{where}.{key}={value} must be >= 0 (or left out for no limit)")
    return int(value) if value is not None else None


def _class(obj: Any, where: str, tiers: int) -> RequestClass:
    if not isinstance(obj, Mapping):
        raise TierConfigError(f"{where}: expected an object with name and tier")
    name = _get(obj, "name", str, where, "")
    if not CLASS_NAME.fullmatch(name) or name == UNMATCHED:
        raise TierConfigError(f"{where}.name={name!r} must be lowercase letters, digits and '-' (at most 32) and not "
                              f"{UNMATCHED!r} (the class of requests no class matches): rename the class")
    tier = _get(obj, "tier", int, where, 0)
    if not 0 <= tier < tiers:
        raise TierConfigError(f"{where}.tier={tier} must index the tiers (0 to {tiers - 1}, cheapest first)")
    return RequestClass(name, tier, _limit(obj, "maxPromptTokens", where), _limit(obj, "maxOutputTokens", where),
                        _limit(obj, "maxTurns", where), _get(obj, "markers", bool, where))


def _classifier(obj: Mapping[str, Any], where: str, tiers: int) -> Classifier:
    raw = _get(obj, "classes", list, where)
    classes = default_classes() if raw is None else tuple(_class(c, f"{where}.classes[{i}]", tiers)
                                                           for i, c in enumerate(raw))
    if not classes:
        raise TierConfigError(f"{where}.classes is empty: give at least one class, or leave it out for the default")
    names = [c.name for c in classes]
    if len(set(names)) != len(names):
        raise TierConfigError(f"{where}.classes names a class twice: give each class its own name")
    markers = _get(obj, "markers", list, where)
    if markers is not None and not all(isinstance(m, str) and m for m in markers):
        raise TierConfigError(f"{where}.markers must be non-empty strings (matched case-insensitively)")
    model = _get(obj, "model", str, where)
    return Classifier(classes, DEFAULT_MARKERS if markers is None else tuple(m.lower() for m in markers),
                      model or None, _number(obj, "modelTimeoutSeconds", where, 1.0, 0.01, 60.0,
                                             "the classifier model's answer is awaited this long, e.g. 1"))


def _count(obj: Mapping[str, Any], key: str, where: str, default: int, lo: int, hi: int) -> int:
    value = int(_get(obj, key, int, where, default))
    if not lo <= value <= hi:
        raise TierConfigError(f"{where}.{key}={value} must be an integer from {lo} to {hi}: e.g. {default}")
    return value


def _quality(obj: Mapping[str, Any], where: str) -> Quality:
    threshold = _number(obj, "threshold", where, 0.5, 0.0, 1.0, "agreement is a score in [0, 1]")
    hysteresis = _number(obj, "hysteresis", where, 0.1, 0.0, 1.0, "e.g. 0.1")
    if threshold + hysteresis > 1.0:  # the sum, as the CRD's CEL rule computes it
        raise TierConfigError(f"{where}: threshold + hysteresis = {threshold + hysteresis:g} is the score a demotion "
                              "needs and must be at most 1: lower hysteresis or threshold")
    return Quality(
        sample_rate=_number(obj, "sampleRate", where, 0.05, 0.0, 1.0, "the share of lower-tier answers replayed"),
        threshold=threshold, hysteresis=hysteresis,
        window_s=_number(obj, "windowSeconds", where, 300.0, 1.0, 86400.0, "e.g. 300"),
        min_samples=_count(obj, "minSamples", where, 20, 1, 100000),
        max_concurrent=_count(obj, "maxConcurrentReplays", where, 2, 1, 64),
        max_per_minute=_count(obj, "maxReplaysPerMinute", where, 60, 1, 100000))


def _tiered(obj: Any, where: str) -> TieredModel:
    if not isinstance(obj, Mapping):
        raise TierConfigError(f"{where}: expected an object with name and tiers")
    name = _get(obj, "name", str, where, "")
    if not name:
        raise TierConfigError(f"{where}.name: give the model name clients send")
    raw = _get(obj, "tiers", list, where, [])
    if not 2 <= len(raw) <= 8:
        raise TierConfigError(f"{where}.tiers has {len(raw)} entries: give 2 to 8 served model names, cheapest first")
    tiers = []
    for i, t in enumerate(raw):
        w = f"{where}.tiers[{i}]"
        if not isinstance(t, Mapping) or not _get(t, "model", str, w, ""):
            raise TierConfigError(f"{w}.model: give the model name an InferenceDeployment serves (spec.model.name)")
        tiers.append(Tier(t["model"], _number(t, "cost", w, 1.0, 0.0, 1e9, "a relative cost per request")))
    models = [t.model for t in tiers]
    if len(set(models)) != len(models) or name in models:
        raise TierConfigError(f"{where}.tiers: every tier must be another served model, and none may be {name!r} "
                              "itself: list each once")
    return TieredModel(name, tuple(tiers), _classifier(_get(obj, "classifier", Mapping, where, {}), f"{where}."
                                                      "classifier", len(tiers)),
                       _quality(_get(obj, "quality", Mapping, where, {}), f"{where}.quality"))


def parse_tiers(raw: Any, where: str = "tieredModels") -> dict[str, TieredModel]:
    """A list of tiered models (the CRD's spec.tieredModels, camelCase) → by public name."""
    if not isinstance(raw, list):
        raise TierConfigError(f"{where}: expected a list of tiered models")
    out: dict[str, TieredModel] = {}
    for i, obj in enumerate(raw):
        tm = _tiered(obj, f"{where}[{i}]")
        if tm.name in out:
            raise TierConfigError(f"{where}[{i}].name={tm.name!r} is given twice: one entry per model name")
        out[tm.name] = tm
    return out


def load_tiers(value: str) -> dict[str, TieredModel]:
    """--tiers: JSON text, or @PATH of a JSON (or YAML) file."""
    if value.startswith("@"):
        import yaml

        try:
            raw = yaml.safe_load(Path(value[1:]).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise TierConfigError(f"--tiers {value}: cannot read it: {e}") from e
    else:
        try:
            raw = json.loads(value)
        except json.JSONDecodeError as e:
            raise TierConfigError(f"--tiers: not JSON ({e}); give the list inline or @PATH") from e
    return parse_tiers(raw)
