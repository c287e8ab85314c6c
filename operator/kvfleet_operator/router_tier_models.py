"""An InferenceRouter's complexity tiers (spec.tieredModels and status.tieredModels), as pydantic models."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic.alias_generators import to_camel

from kvfleet_operator.core_types import SpecModel
from kvfleet_operator.router_tier_rules import (
    CLASS_NAME_PATTERN,
    CLASS_NAME_RULE,
    CLASS_TIER_RULE,
    CLASSES_SIZE_RULE,
    CLASSES_UNIQUE_RULE,
    COST_MAX,
    DEFAULT_MARKERS,
    HYSTERESIS_RULE,
    HYSTERESIS_SUM_RULE,
    MARKERS_RULE,
    MAX_CLASSES,
    MAX_CONCURRENT_MAX,
    MAX_CONCURRENT_RULE,
    MAX_MARKER_LENGTH,
    MAX_MARKERS,
    MAX_NAME_LENGTH,
    MAX_OUTPUT_TOKENS_RULE,
    MAX_PER_MINUTE_MAX,
    MAX_PER_MINUTE_RULE,
    MAX_PROMPT_TOKENS_RULE,
    MAX_TIERS,
    MAX_TURNS_RULE,
    MIN_SAMPLES_MAX,
    MIN_SAMPLES_RULE,
    MIN_TIERS,
    MODEL_TIMEOUT_MAX,
    MODEL_TIMEOUT_MIN,
    MODEL_TIMEOUT_RULE,
    SAMPLE_RATE_RULE,
    THRESHOLD_RULE,
    TIER_COST_RULE,
    TIER_MODEL_RULE,
    TIERED_NAME_RULE,
    TIERS_COUNT_RULE,
    TIERS_DISTINCT_RULE,
    UNMATCHED,
    WINDOW_MAX,
    WINDOW_MIN,
    WINDOW_RULE,
)
from kvfleet_operator.rules import Rule, cel, check


def _limit(v: int | None, rule: Rule) -> int | None:
    check(v is None or v >= 0, rule)
    return v


class TierSpec(SpecModel):
    """One tier: a model an InferenceDeployment serves, and its cost relative to the other tiers."""

    model: str = Field(max_length=MAX_NAME_LENGTH, json_schema_extra=cel(TIER_MODEL_RULE))
    """Served model name (an InferenceDeployment's spec.model.name) that serves this tier's requests."""
    cost: float = Field(default=1.0, json_schema_extra=cel(TIER_COST_RULE))
    """Cost per request relative to the other tiers (the unit of the router's cost metrics)."""

    @field_validator("model")
    @classmethod
    def _model(cls, v: str) -> str:
        check(len(v) > 0, TIER_MODEL_RULE)
        return v

    @field_validator("cost")
    @classmethod
    def _cost(cls, v: float) -> float:
        check(0 <= v <= COST_MAX, TIER_COST_RULE)
        return v


class RequestClassSpec(SpecModel):
    """A class of requests and the tier that serves it unless the quality monitor promoted it. A request belongs to
    the first class whose every given limit holds; a limit left out does not limit."""

    # maxLength for the apiserver's cost estimate only: the rule says the limit, with its own message.
    name: str = Field(json_schema_extra={"maxLength": 32, **cel(CLASS_NAME_RULE)})
    """Class name (the `class` label of the router's tier metrics); not `unmatched`, the class of requests no class
    matches, which the top tier serves."""
    tier: int = 0
    """Index of the tier serving the class: 0 the cheapest."""
    max_prompt_tokens: int | None = Field(default=None, json_schema_extra=cel(MAX_PROMPT_TOKENS_RULE))
    """At most this many prompt tokens (estimated: prompt characters / 4, rounded up)."""
    max_output_tokens: int | None = Field(default=None, json_schema_extra=cel(MAX_OUTPUT_TOKENS_RULE))
    """At most this max_tokens (a request that states no max_tokens is not limited by it)."""
    max_turns: int | None = Field(default=None, json_schema_extra=cel(MAX_TURNS_RULE))
    """At most this many user messages in a chat (a completion is one turn)."""
    markers: bool | None = None
    """false: only requests without any marker (see classifier.markers); true: only requests with one."""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        check(re.fullmatch(CLASS_NAME_PATTERN, v) is not None and v != UNMATCHED, CLASS_NAME_RULE)
        return v

    @field_validator("max_prompt_tokens")
    @classmethod
    def _prompt(cls, v: int | None) -> int | None:
        return _limit(v, MAX_PROMPT_TOKENS_RULE)

    @field_validator("max_output_tokens")
    @classmethod
    def _output(cls, v: int | None) -> int | None:
        return _limit(v, MAX_OUTPUT_TOKENS_RULE)

    @field_validator("max_turns")
    @classmethod
    def _turns(cls, v: int | None) -> int | None:
        return _limit(v, MAX_TURNS_RULE)


def default_classes() -> list[RequestClassSpec]:
    """Short, marker-free, shallow requests on the cheapest tier; everything else is unmatched (the top tier)."""
    return [RequestClassSpec(name="simple", tier=0, max_prompt_tokens=512, max_output_tokens=256, max_turns=4,
                             markers=False)]


class ClassifierSpec(SpecModel):
    """Request features → a class (and so a tier). With `model`, a small model served by kvfleet labels each
    request instead (its answer constrained to the class names); the features decide when it fails or is slow."""

    classes: list[RequestClassSpec] = Field(default_factory=default_classes, max_length=MAX_CLASSES,
                                            json_schema_extra=cel(CLASSES_SIZE_RULE, CLASSES_UNIQUE_RULE))
    """The classes, tried in order (default: `simple`, on tier 0: prompts up to 512 tokens, max_tokens up to 256,
    up to 4 turns, no marker). A request no class matches is `unmatched`: the top tier serves it."""
    markers: list[Annotated[str, Field(max_length=MAX_MARKER_LENGTH)]] = Field(
        default_factory=lambda: list(DEFAULT_MARKERS), max_length=MAX_MARKERS, json_schema_extra=cel(MARKERS_RULE))
    """Substrings (case-insensitive) that mark code or multi-step reasoning in a request."""
    model: str | None = Field(default=None, max_length=MAX_NAME_LENGTH)
    """A served model that classifies the requests (default: the features alone)."""
    model_timeout_seconds: float = Field(default=1.0, json_schema_extra=cel(MODEL_TIMEOUT_RULE))
    """Seconds the classifier model's answer is awaited before the features decide."""

    @field_validator("classes")
    @classmethod
    def _classes(cls, v: list[RequestClassSpec]) -> list[RequestClassSpec]:
        check(len(v) > 0, CLASSES_SIZE_RULE)
        check(len({c.name for c in v}) == len(v), CLASSES_UNIQUE_RULE)
        return v

    @field_validator("markers")
    @classmethod
    def _markers(cls, v: list[str]) -> list[str]:
        check(all(v), MARKERS_RULE)
        return v

    @field_validator("model_timeout_seconds")
    @classmethod
    def _timeout(cls, v: float) -> float:
        check(MODEL_TIMEOUT_MIN <= v <= MODEL_TIMEOUT_MAX, MODEL_TIMEOUT_RULE)
        return v


# Each QualitySpec field's range (both ends allowed) and the rule that says it.
_QUALITY_RANGES: dict[str, tuple[float, float, Rule]] = {
    "sample_rate": (0.0, 1.0, SAMPLE_RATE_RULE), "threshold": (0.0, 1.0, THRESHOLD_RULE),
    "hysteresis": (0.0, 1.0, HYSTERESIS_RULE), "window_seconds": (WINDOW_MIN, WINDOW_MAX, WINDOW_RULE),
    "min_samples": (1, MIN_SAMPLES_MAX, MIN_SAMPLES_RULE),
    "max_concurrent_replays": (1, MAX_CONCURRENT_MAX, MAX_CONCURRENT_RULE),
    "max_replays_per_minute": (1, MAX_PER_MINUTE_MAX, MAX_PER_MINUTE_RULE)}


class QualitySpec(SpecModel):
    """The quality monitor: it replays a share of the lower tiers' answers on the top tier, scores their agreement
    (0 to 1), promotes a class to the next tier when a window's mean stays below the threshold, and demotes it back
    when the tier below scores at least threshold + hysteresis."""

    model_config = ConfigDict(json_schema_extra=cel(HYSTERESIS_SUM_RULE))
    sample_rate: float = Field(default=0.05, json_schema_extra=cel(SAMPLE_RATE_RULE))
    """Share of lower-tier answers replayed on the top tier."""
    threshold: float = Field(default=0.5, json_schema_extra=cel(THRESHOLD_RULE))
    """A class is promoted when a window's mean agreement is below this."""
    hysteresis: float = Field(default=0.1, json_schema_extra=cel(HYSTERESIS_RULE))
    """A promoted class is demoted when the tier below scores at least threshold + hysteresis."""
    window_seconds: float = Field(default=300.0, json_schema_extra=cel(WINDOW_RULE))
    """Length of a quality window in seconds."""
    min_samples: int = Field(default=20, json_schema_extra=cel(MIN_SAMPLES_RULE))
    """A window with fewer scores decides nothing (it keeps collecting)."""
    max_concurrent_replays: int = Field(default=2, json_schema_extra=cel(MAX_CONCURRENT_RULE))
    """Replays in flight at once, per tiered model and router pod."""
    max_replays_per_minute: int = Field(default=60, json_schema_extra=cel(MAX_PER_MINUTE_RULE))
    """Replays started per minute, per tiered model and router pod (the verification budget)."""

    @field_validator(*_QUALITY_RANGES)
    @classmethod
    def _range(cls, v: float, info: ValidationInfo) -> float:
        lo, hi, rule = _QUALITY_RANGES[str(info.field_name)]
        check(lo <= v <= hi, rule)
        return v

    @model_validator(mode="after")
    def _sum(self) -> QualitySpec:
        check(self.threshold + self.hysteresis <= 1.0, HYSTERESIS_SUM_RULE)  # in doubles, as CEL and the router
        return self


class TieredModelSpec(SpecModel):
    """A model name that stands for an ordered list of served models (tiers, cheapest first): the classifier gives
    each request a class, the class names its tier, and the quality monitor moves a class up a tier (and back)."""

    model_config = ConfigDict(json_schema_extra=cel(TIERS_DISTINCT_RULE, CLASS_TIER_RULE))
    name: str = Field(max_length=MAX_NAME_LENGTH, json_schema_extra=cel(TIERED_NAME_RULE))
    """The model name clients send; not one the tiers serve."""
    tiers: list[TierSpec] = Field(json_schema_extra={"maxItems": MAX_TIERS, **cel(TIERS_COUNT_RULE)})
    """2 to 8 served models, cheapest first; the last (the top tier) is the reference the monitor checks against."""
    classifier: ClassifierSpec = Field(default_factory=ClassifierSpec)
    """How a request gets its class."""
    quality: QualitySpec = Field(default_factory=QualitySpec)
    """How the lower tiers' answers are verified, and when a class moves between tiers."""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        check(len(v) > 0, TIERED_NAME_RULE)
        return v

    @field_validator("tiers")
    @classmethod
    def _tiers(cls, v: list[TierSpec]) -> list[TierSpec]:
        check(MIN_TIERS <= len(v) <= MAX_TIERS, TIERS_COUNT_RULE)
        return v

    @model_validator(mode="after")
    def _tiers_and_classes(self) -> TieredModelSpec:
        models = [t.model for t in self.tiers]
        check(len(set(models)) == len(models) and self.name not in models, TIERS_DISTINCT_RULE)
        check(all(0 <= c.tier < len(self.tiers) for c in self.classifier.classes), CLASS_TIER_RULE)
        return self


class _Status(BaseModel):
    # As router_models' status models (which import these): camelCase, and field docstrings as descriptions.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid",
                              use_attribute_docstrings=True)


class TierStatus(_Status):
    """One tier's traffic and verified quality, summed over the router pods that reported."""

    model: str = Field(max_length=MAX_NAME_LENGTH)
    """The tier's served model name."""
    requests: int = 0
    """Requests it served since the router pods started, summed over them."""
    share: float | None = None
    """Its share of the tiered model's requests, 0 to 1 (absent while there are none)."""
    quality: float | None = None
    """The lowest mean agreement with the top tier over the classes and router pods in their last closed windows
    (absent while never measured; the top tier is the reference and has none)."""


class PromotionStatus(_Status):
    """A class served by a higher tier than its own, because its quality stayed below the threshold."""

    request_class: str = Field(alias="class", max_length=32)
    """The class (`unmatched` never: the top tier serves it)."""
    from_model: str = Field(alias="from", max_length=MAX_NAME_LENGTH)
    """The served model of the class's own tier."""
    to: str = Field(max_length=MAX_NAME_LENGTH)
    """The served model serving it now."""
    router_pods: int = 0
    """Router pods that have it promoted to `to` (each pod's monitor decides on its own samples)."""


class TieredModelStatus(_Status):
    """A tiered model as its router pods report it."""

    name: str = Field(max_length=MAX_NAME_LENGTH)
    """The tiered model's name."""
    router_pods: int = 0
    """Router pods that reported their tier metrics."""
    tiers: list[TierStatus] = Field(default_factory=list, max_length=MAX_TIERS)
    """Each tier, cheapest first."""
    promotions: list[PromotionStatus] = Field(default_factory=list, max_length=(MAX_CLASSES + 1) * MAX_TIERS)
    """Classes served above their own tier now."""
