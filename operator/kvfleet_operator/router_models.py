"""InferenceRouter spec and status (pydantic): the source of its CRD's schema (crd.py); CEL rules in rules.py."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel

from kvfleet_operator.core_types import SpecModel, Toleration
from kvfleet_operator.models import ObjectMeta, ResourceList
from kvfleet_operator.router_rules import (
    EPSILON_RULE,
    HOLD_SIZE_RULE,
    HOLD_TIMEOUT_RULE,
    NAMESPACE_PATTERN,
    ROUTER_LABELS_RULE,
    ROUTER_NAME_RULE,
    ROUTER_RESERVED_LABELS,
    SCRAPE_INTERVAL_RULE,
    WATCH_NAMESPACES_NAME_RULE,
    WATCH_NAMESPACES_UNIQUE_RULE,
)
from kvfleet_operator.router_tier_models import TieredModelSpec, TieredModelStatus
from kvfleet_operator.router_tier_rules import MAX_TIERED_MODELS, TIERED_NAMES_UNIQUE_RULE
from kvfleet_operator.rules import cel, check

ROUTER_KIND = "InferenceRouter"
ROUTER_PLURAL = "inferencerouters"
MAX_MODELS = 256  # status.models entries; more InferenceDeployments are counted in modelCount but not listed


class HoldQueueSpec(SpecModel):
    """Requests for a model with no ready replica wait in the router (FIFO per model) instead of failing."""

    size: int = Field(default=256, json_schema_extra=cel(HOLD_SIZE_RULE))
    """Requests held per model at most; past it the router answers 503 with Retry-After."""
    timeout_seconds: float = Field(default=120.0, json_schema_extra=cel(HOLD_TIMEOUT_RULE))
    """Seconds a held request waits for a replica before it gets 503 (cover a replica's cold start)."""

    @field_validator("size")
    @classmethod
    def _size(cls, v: int) -> int:
        check(0 <= v <= 100000, HOLD_SIZE_RULE)
        return v

    @field_validator("timeout_seconds")
    @classmethod
    def _timeout(cls, v: float) -> float:
        check(0 < v <= 3600, HOLD_TIMEOUT_RULE)
        return v


class RouterResources(SpecModel):
    """CPU and memory of each router pod."""

    requests: ResourceList | None = None
    """CPU and memory requests."""
    limits: ResourceList | None = None
    """CPU and memory limits."""


class RouterPodOverrides(SpecModel):
    """Additions to the router pods."""

    node_selector: dict[str, str] = Field(default_factory=dict, max_length=64)
    """Node labels the pods must match."""
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64)
    """Tolerations of the pods."""
    labels: dict[str, str] = Field(default_factory=dict, max_length=64, json_schema_extra=cel(ROUTER_LABELS_RULE))
    """Pod labels (not the operator's own: the selector and client labels cannot be overridden)."""
    annotations: dict[str, str] = Field(default_factory=dict, max_length=64)
    """Pod annotations."""

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        check(not any(k in v for k in ROUTER_RESERVED_LABELS), ROUTER_LABELS_RULE)
        return v


class InferenceRouterSpec(SpecModel):
    """Desired state: kvfleet-router replicas giving one OpenAI endpoint (a ClusterIP Service, port 8080) for the
    models of every InferenceDeployment in the watched namespaces. Router pods carry serving.kvfleet.dev/client=true,
    which the agents' NetworkPolicy admits from their own namespace; for InferenceDeployments in another namespace,
    admit the router there through that InferenceDeployment's spec.networkPolicy.from, e.g. {namespaceSelector:
    {matchLabels: {kubernetes.io/metadata.name: ROUTER_NAMESPACE}}, podSelector: {matchLabels:
    {app.kubernetes.io/name: kvfleet-router}}}."""

    replicas: int = Field(default=1, ge=0, le=100)
    """Router pods (2 or more keep the endpoint up through a node drain or a rollout)."""
    image: str | None = Field(default=None, max_length=512)
    """Router image (default: the operator's KVFLEET_ROUTER_IMAGE)."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    """Pull policy of the router image."""
    watch_namespaces: list[Annotated[str, Field(max_length=63)]] = Field(
        default_factory=list, max_length=64, json_schema_extra=cel(WATCH_NAMESPACES_NAME_RULE,
                                                                   WATCH_NAMESPACES_UNIQUE_RULE))
    """Namespaces whose InferenceDeployments the router serves (default: its own only). The operator grants the
    router's ServiceAccount get, list and watch on pods and InferenceDeployments in each, nothing more; the operator
    itself must be allowed in them (a single-namespace install serves its own namespace only)."""
    epsilon: float = Field(default=0.25, json_schema_extra=cel(EPSILON_RULE))
    """Bounded load: prefix affinity sends a request to its replica unless that replica would carry more than
    (1 + epsilon) x the mean load, then the least-loaded replica takes it."""
    scrape_interval_seconds: float = Field(default=0.25, json_schema_extra=cel(SCRAPE_INTERVAL_RULE))
    """Seconds between the router's scrapes of each agent's queue gauges."""
    hold_queue: HoldQueueSpec = Field(default_factory=HoldQueueSpec)
    """Requests for a model with no ready replica (scale from zero, cold starts)."""
    resources: RouterResources = Field(
        default_factory=lambda: RouterResources(requests=ResourceList(cpu="250m", memory="256Mi")))
    """CPU and memory of each router pod (default, only when resources is not given: requests of 250m CPU and
    256Mi memory, no limits)."""
    pod: RouterPodOverrides = Field(default_factory=RouterPodOverrides)
    """Additions to the router pods."""
    tiered_models: list[TieredModelSpec] = Field(default_factory=list, max_length=MAX_TIERED_MODELS,
                                                 json_schema_extra=cel(TIERED_NAMES_UNIQUE_RULE))
    """Complexity tiers: each entry is a model name clients send that stands for 2 to 8 served models (tiers,
    cheapest first). A classifier gives each request a class from its features (prompt length, max_tokens, code or
    reasoning markers, conversation depth) or from a small served model; the class's tier serves it. The quality
    monitor replays a share of the lower tiers' answers on the top tier, promotes a class to the next tier while its
    agreement stays below the threshold, and demotes it back once it recovers. status.tieredModels shows each
    tier's share of the traffic, its measured quality and the current promotions; promotions are also events."""

    @property
    def namespaces(self) -> tuple[str, ...]:
        """Explicit watchNamespaces; empty means the router's own (see InferenceRouter.watched)."""
        return tuple(self.watch_namespaces)

    @field_validator("watch_namespaces")
    @classmethod
    def _namespaces(cls, v: list[str]) -> list[str]:
        check(all(re.fullmatch(NAMESPACE_PATTERN, n) for n in v), WATCH_NAMESPACES_NAME_RULE)
        check(len(v) == len(set(v)), WATCH_NAMESPACES_UNIQUE_RULE)
        return v

    @field_validator("tiered_models")
    @classmethod
    def _tiered(cls, v: list[TieredModelSpec]) -> list[TieredModelSpec]:
        check(len({t.name for t in v}) == len(v), TIERED_NAMES_UNIQUE_RULE)
        return v

    @field_validator("epsilon")
    @classmethod
    def _epsilon(cls, v: float) -> float:
        check(0 <= v <= 100, EPSILON_RULE)
        return v

    @field_validator("scrape_interval_seconds")
    @classmethod
    def _scrape(cls, v: float) -> float:
        check(0 < v <= 5, SCRAPE_INTERVAL_RULE)
        return v


class _Status(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid",
                              use_attribute_docstrings=True)


class RouterCondition(_Status):
    """The router's state (metav1.Condition shape)."""

    type: str = Field(max_length=64)
    """Ready."""
    status: Literal["True", "False", "Unknown"]
    """Whether the condition holds."""
    reason: str = Field(max_length=128)
    """A CamelCase reason code."""
    message: str = Field(default="", max_length=32768)
    """A sentence for humans."""
    last_transition_time: str = Field(json_schema_extra={"format": "date-time"})
    """When status last changed."""
    observed_generation: int | None = None
    """The metadata.generation this condition was computed from."""


class RouterModel(_Status):
    """One InferenceDeployment the router routes to, and how many of its agents it can send requests to now."""

    model: str = Field(max_length=128)
    """Served model name (spec.model.name): the `model` of OpenAI requests."""
    namespace: str = Field(max_length=63)
    """Namespace of the InferenceDeployment."""
    inference_deployment: str = Field(max_length=63)
    """Name of the InferenceDeployment."""
    ready_endpoints: int = 0
    """Agent pods that are Ready (the endpoints the router sends requests to)."""
    held_requests: int | None = None
    """Requests the router pods hold for it while it has no ready agent, as scraped at the last reconcile (absent
    when no router pod answered)."""


class InferenceRouterStatus(_Status):
    """Observed state, written by the operator."""

    observed_generation: int | None = None
    """The metadata.generation the operator last reconciled."""
    replicas: int = 0
    """Router pods that exist."""
    ready_replicas: int = 0
    """Router pods ready to serve."""
    model_count: int = 0
    """Distinct model names served by the InferenceDeployments in the watched namespaces."""
    models: list[RouterModel] = Field(default_factory=list, max_length=MAX_MODELS)
    """Per InferenceDeployment in the watched namespaces: its model and ready endpoints."""
    tiered_models: list[TieredModelStatus] = Field(default_factory=list, max_length=MAX_TIERED_MODELS)
    """Per tiered model of the spec: each tier's requests, share and measured quality, and the promotions now, as
    the router pods reported them at the last reconcile (absent without tiered models; kept as it was while no
    router pod answers)."""
    conditions: list[RouterCondition] = Field(
        default_factory=list, max_length=8,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    """Ready: every router replica of the current configuration is ready, and everything the router needs (its
    ServiceAccount, Roles and RoleBindings, Deployment, Service, PodDisruptionBudget) is applied."""


class RouterMeta(ObjectMeta):
    """The metadata fields the operator reads, with the router's message for a bad name."""

    @field_validator("name")
    @classmethod
    def _dns_label(cls, v: str) -> str:
        check(re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", v) is not None and len(v) <= 63, ROUTER_NAME_RULE)
        return v


class InferenceRouter(SpecModel):
    """One OpenAI endpoint in front of the kvfleet agents of one or more namespaces."""

    model_config = ConfigDict(extra="ignore")  # the apiserver adds fields the operator does not read
    api_version: Literal["serving.kvfleet.dev/v1alpha1"] = "serving.kvfleet.dev/v1alpha1"
    kind: Literal["InferenceRouter"] = "InferenceRouter"
    metadata: RouterMeta
    spec: InferenceRouterSpec = Field(default_factory=InferenceRouterSpec)
    status: InferenceRouterStatus | None = None

    @property
    def watched(self) -> tuple[str, ...]:
        """The namespaces the router serves: spec.watchNamespaces, or its own namespace."""
        return self.spec.namespaces or (self.metadata.namespace,)
