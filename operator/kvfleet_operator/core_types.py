"""The Kubernetes API shapes the spec embeds (tolerations, env vars and their sources, label selectors, NetworkPolicy
peers), as pydantic models with the CEL rules of rules.py; and the spec models' common base."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_validator
from pydantic.alias_generators import to_camel

from kvfleet_operator.rules import (
    ENV_SOURCE_RULE,
    ENV_VALUE_RULE,
    FIELD_PATH_PATTERN,
    FIELD_PATH_RULE,
    PEER_RULE,
    QUANTITY_PATTERN,
    RESOURCE_FIELD_RULE,
    RESOURCE_PATTERN,
    SELECTOR_RULE,
    cel,
    check,
)


class SpecModel(BaseModel):
    # Attribute docstrings become the CRD's field descriptions; camelCase in YAML, snake_case in Python.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid",
                              use_attribute_docstrings=True, validate_default=False)


# An integer or a Kubernetes quantity string ("4", "500m", "32Gi"), as in a pod's resources.
Quantity = Annotated[int | str, WithJsonSchema({"x-kubernetes-int-or-string": True,
                                                "anyOf": [{"type": "integer"}, {"type": "string"}]})]
QUANTITY_RE = re.compile(QUANTITY_PATTERN)
# Names and keys of Secrets and ConfigMaps (DNS-1123 subdomain; a data key), checked by the schema.
OBJECT_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DATA_KEY = r"^[-._a-zA-Z0-9]+$"


class Toleration(SpecModel):
    """A pod toleration (core/v1 Toleration)."""

    key: str | None = Field(default=None, max_length=317)
    """Taint key; empty with operator Exists tolerates everything."""
    operator: Literal["Exists", "Equal"] | None = None
    """Exists or Equal (the default)."""
    value: str | None = Field(default=None, max_length=63)
    """Taint value for operator Equal."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to match (empty: all)."""
    toleration_seconds: int | None = None
    """How long a NoExecute taint is tolerated."""


class SecretKeyRef(SpecModel):
    """A key of a Secret in the InferenceDeployment's namespace (as in core/v1 SecretKeySelector)."""

    name: str = Field(min_length=1, max_length=253, pattern=OBJECT_NAME)
    """Name of the Secret."""
    key: str = Field(min_length=1, max_length=253, pattern=DATA_KEY)
    """Key of the value inside the Secret's data."""


class EnvSecretKeyRef(SecretKeyRef):
    """A key of a Secret in the InferenceDeployment's namespace (core/v1 SecretKeySelector)."""

    optional: bool | None = None
    """true: start without the variable when the Secret or key is missing (default: the pod waits for it)."""


class EnvConfigMapKeyRef(SpecModel):
    """A key of a ConfigMap in the InferenceDeployment's namespace (core/v1 ConfigMapKeySelector)."""

    name: str = Field(min_length=1, max_length=253, pattern=OBJECT_NAME)
    """Name of the ConfigMap."""
    key: str = Field(min_length=1, max_length=253, pattern=DATA_KEY)
    """Key of the value inside the ConfigMap's data."""
    optional: bool | None = None
    """true: start without the variable when the ConfigMap or key is missing (default: the pod waits for it)."""


class EnvFieldRef(SpecModel):
    """A field of the agent's own pod (core/v1 ObjectFieldSelector, the downward API)."""

    model_config = ConfigDict(json_schema_extra=cel(FIELD_PATH_RULE))
    api_version: str | None = Field(default=None, max_length=64)
    """Version of the schema fieldPath is written in (default: v1)."""
    field_path: str = Field(min_length=1, max_length=512)
    """The field, e.g. metadata.name, status.podIP or metadata.labels['team']."""

    @model_validator(mode="after")
    def _field(self) -> EnvFieldRef:
        check(re.fullmatch(FIELD_PATH_PATTERN, self.field_path) is not None, FIELD_PATH_RULE)
        return self


class EnvResourceFieldRef(SpecModel):
    """A resource limit or request of the agent container (core/v1 ResourceFieldSelector)."""

    model_config = ConfigDict(json_schema_extra=cel(RESOURCE_FIELD_RULE))
    container_name: str | None = Field(default=None, max_length=63)
    """Container whose resources are read (default: the agent's own, the pod's only container)."""
    resource: str = Field(min_length=1, max_length=128)
    """limits.cpu, limits.memory, limits.ephemeral-storage, requests.* of the same, or limits/requests.hugepages-*."""
    divisor: Quantity | None = Field(default=None, json_schema_extra={"maxLength": 64})
    """Unit the value is expressed in (default: 1), e.g. 1Mi or 1m."""

    @model_validator(mode="after")
    def _resource(self) -> EnvResourceFieldRef:
        d = self.divisor
        check(re.fullmatch(RESOURCE_PATTERN, self.resource) is not None
              and (d is None or isinstance(d, int) or QUANTITY_RE.fullmatch(d) is not None), RESOURCE_FIELD_RULE)
        return self


class EnvVarSource(SpecModel):
    """Where a variable's value comes from: exactly one of secretKeyRef, configMapKeyRef, fieldRef or
    resourceFieldRef (core/v1 EnvVarSource). The kubelet resolves it; the operator never reads the value."""

    model_config = ConfigDict(json_schema_extra=cel(ENV_SOURCE_RULE))
    secret_key_ref: EnvSecretKeyRef | None = None
    """A key of a Secret in the same namespace."""
    config_map_key_ref: EnvConfigMapKeyRef | None = None
    """A key of a ConfigMap in the same namespace."""
    field_ref: EnvFieldRef | None = None
    """A field of the pod."""
    resource_field_ref: EnvResourceFieldRef | None = None
    """A resource limit or request of the container."""

    @model_validator(mode="after")
    def _exactly_one(self) -> EnvVarSource:
        sources = (self.secret_key_ref, self.config_map_key_ref, self.field_ref, self.resource_field_ref)
        check(sum(s is not None for s in sources) == 1, ENV_SOURCE_RULE)
        return self


class EnvVar(SpecModel):
    """An environment variable of the agent container (core/v1 EnvVar): exactly one of value or valueFrom."""

    model_config = ConfigDict(json_schema_extra=cel(ENV_VALUE_RULE))
    name: str = Field(min_length=1, max_length=256)
    """Variable name."""
    value: str | None = Field(default=None, max_length=32768)
    """A literal value ($(VAR) references to earlier variables are expanded, as in a pod)."""
    value_from: EnvVarSource | None = None
    """The value from a Secret, a ConfigMap or the pod itself."""

    @model_validator(mode="after")
    def _exactly_one(self) -> EnvVar:
        check((self.value is None) != (self.value_from is None), ENV_VALUE_RULE)
        return self

    def manifest(self) -> dict[str, Any]:
        """The core/v1 EnvVar, as written (a divisor as a quantity string)."""
        out = self.model_dump(mode="json", by_alias=True, exclude_none=True)
        resource = (out.get("valueFrom") or {}).get("resourceFieldRef") or {}
        if "divisor" in resource:
            resource["divisor"] = str(resource["divisor"])
        return out


class LabelSelectorRequirement(SpecModel):
    """A label selector requirement (metav1 LabelSelectorRequirement)."""

    model_config = ConfigDict(json_schema_extra=cel(SELECTOR_RULE))
    key: str = Field(min_length=1, max_length=317)
    """Label key."""
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    """How the key's value is matched against values."""
    values: list[Annotated[str, Field(max_length=63)]] = Field(default_factory=list, max_length=64)
    """Values for In and NotIn; none for Exists and DoesNotExist."""

    @model_validator(mode="after")
    def _values(self) -> LabelSelectorRequirement:
        check(bool(self.values) == (self.operator in ("In", "NotIn")), SELECTOR_RULE)
        return self


class LabelSelector(SpecModel):
    """A label selector (metav1 LabelSelector); empty selects everything."""

    match_labels: dict[str, str] = Field(default_factory=dict, max_length=64)
    """Labels that must all match."""
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list, max_length=16)
    """Requirements that must all hold."""


class IPBlock(SpecModel):
    """An IP range (networking.k8s.io/v1 IPBlock)."""

    cidr: str = Field(min_length=1, max_length=64)
    """The range, e.g. 10.0.0.0/16."""
    except_: list[Annotated[str, Field(max_length=64)]] = Field(default_factory=list, max_length=32, alias="except")
    """Ranges inside cidr that are not admitted."""


class NetworkPolicyPeer(SpecModel):
    """Sources admitted to the agents' ports (networking.k8s.io/v1 NetworkPolicyPeer)."""

    model_config = ConfigDict(json_schema_extra=cel(PEER_RULE))
    pod_selector: LabelSelector | None = None
    """Pods (in this namespace, or in those namespaceSelector picks)."""
    namespace_selector: LabelSelector | None = None
    """Namespaces, by their labels (kubernetes.io/metadata.name holds each one's name)."""
    ip_block: IPBlock | None = None
    """An IP range, e.g. of an external load balancer."""

    @model_validator(mode="after")
    def _shape(self) -> NetworkPolicyPeer:
        selectors = self.pod_selector is not None or self.namespace_selector is not None
        check(not selectors if self.ip_block is not None else selectors, PEER_RULE)
        return self
