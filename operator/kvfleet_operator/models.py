"""InferenceDeployment spec (pydantic): with core_types.py and status.py, the CRD schema's source; CEL in rules.py."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvfleet_operator.core_types import (
    QUANTITY_RE,
    EnvVar,
    NetworkPolicyPeer,
    Quantity,
    SecretKeyRef,
    SpecModel,
    Toleration,
)
from kvfleet_operator.model_sources import ModelSource, clean_path
from kvfleet_operator.quantization_models import (
    FP8_DTYPE_RULE,
    KV_CACHE_DTYPE,
    QUANTIZATION,
    KvCacheDtype,
    Quantization,
    check_quantization,
)
from kvfleet_operator.rules import (
    API_KEY_ENV,
    BLOCK_SIZE_RULE,
    BLOCK_SIZES,
    BUILTIN_TARGET_RULE,
    COMPILE_CACHE_PATH_RULE,
    ENV_API_KEY_RULE,
    EXTRA_ARGS_API_KEY_RULE,
    EXTRA_ARGS_RULE,
    GPU_RULE,
    LABELS_RULE,
    LATENCY_SECONDS_RULE,
    LATENCY_UNIQUE_RULE,
    MIN_MAX_RULE,
    MODEL_NAME_RULE,
    NAME_RULE,
    QUANTITY_RULE,
    RESERVED_LABELS,
    SCALE_DOWN_POLICY_RULE,
    SCALE_TO_ZERO_RULE,
    SCALE_UP_POLICY_RULE,
    cel,
    check,
)
from kvfleet_operator.speculative_models import (
    DRAFT_IMAGE_MOUNT_RULE,
    TARGET_IMAGE_MOUNT_RULE,
    SpeculativeConfigSpec,
    check_mounts,
)
from kvfleet_operator.status import InferenceDeploymentStatus

GROUP = "serving.kvfleet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceDeployment"
PLURAL = "inferencedeployments"


class ModelSpec(SpecModel):
    """The model to serve."""

    name: str = Field(min_length=1, max_length=128, json_schema_extra=cel(MODEL_NAME_RULE))
    """Served model name: the `model` clients send in OpenAI requests."""
    source: ModelSource
    """Where the checkpoint comes from."""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        check(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/:-]*", v) is not None and ".." not in v, MODEL_NAME_RULE)
        return v


class CompileCacheSpec(SpecModel):
    """A PersistentVolumeClaim where the agents keep the kernels they compile (Triton, TorchInductor), so that a
    restarted or added replica reuses them instead of compiling again during warm-up."""

    model_config = ConfigDict(json_schema_extra=cel(COMPILE_CACHE_PATH_RULE))
    claim_name: str = Field(min_length=1, max_length=253)
    """Name of the PersistentVolumeClaim in the same namespace, mounted read-write (ReadWriteMany lets replicas on
    different nodes share it; the compilers write each entry to a temporary name and rename it into place)."""
    path: str = Field(default="", max_length=4096)
    """Sub-path of the cache directory inside the claim ("" for its root)."""

    @model_validator(mode="after")
    def _sub_path(self) -> CompileCacheSpec:
        check(not self.path.startswith("/") and clean_path(self.path), COMPILE_CACHE_PATH_RULE)
        return self


class RuntimeSpec(SpecModel):
    """Engine settings, rendered as kvfleet-agent serve flags."""

    model_config = ConfigDict(json_schema_extra=cel(FP8_DTYPE_RULE))
    tensor_parallel_size: int = Field(default=1, ge=1, le=8)
    """GPUs one model replica is sharded over (tensor parallelism)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weight and activation dtype (auto: the checkpoint's, float32 on CPU)."""
    quantization: Quantization | None = Field(default=None, json_schema_extra=QUANTIZATION.schema())
    """Weight quantization (--quantization, vLLM's names): int8 or int4 quantize an fp checkpoint as it loads; gptq,
    awq, compressed-tensors and fp8 name a pre-quantized checkpoint's format (optional: its config.json says it).
    Default: the checkpoint decides. fp8 needs dtype bfloat16, float16 or auto."""
    kv_cache_dtype: KvCacheDtype | None = Field(default=None, json_schema_extra=KV_CACHE_DTYPE.schema())
    """KV cache element type (--kv-cache-dtype; default: auto, the model's dtype). int8 and fp8 (E4M3; fp8_e4m3 is the
    same) store one byte an element with a float32 scale per token and head: about twice the sequences of bfloat16 in
    the same memory, at a small cost in accuracy (BENCHMARKS.md)."""
    max_model_len: int | None = Field(default=None, ge=1, le=1048576)
    """Longest prompt plus output in tokens (default: the checkpoint's)."""
    max_num_seqs: int = Field(default=128, ge=1, le=4096)
    """Sequences batched together in one engine step."""
    max_num_batched_tokens: int | None = Field(default=None, ge=1, le=1048576)
    """Tokens per engine step (default: 1024 on CPU, 8192 on GPU)."""
    block_size: int = Field(default=16, ge=1, le=256, json_schema_extra=cel(BLOCK_SIZE_RULE))
    """Tokens per paged KV-cache block (a power of two)."""
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    """Fraction of GPU memory the agent may use for weights, activations and KV cache."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of shared prompt prefixes."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps so decodes keep flowing."""
    max_queue_length: int = Field(default=256, ge=0, le=1000000)
    """Waiting requests beyond which new ones get HTTP 429 / gRPC RESOURCE_EXHAUSTED."""
    drain_grace_period_seconds: int = Field(default=30, ge=0, le=3600)
    """Seconds accepted requests may take to finish after SIGTERM (the pod's grace period adds 15 s)."""
    metrics_compat: Literal["kvfleet", "vllm"] = "kvfleet"
    """The families the agents' /metrics serves: kvfleet's, or vllm: vLLM's vllm:* families (labelled model_name)
    beside them, for vLLM's dashboards and recipes (--metrics-compat; it overrides KVFLEET_METRICS_COMPAT in
    pod.env)."""
    compile_cache: CompileCacheSpec | None = None
    """Where compiled kernels persist across pod restarts (TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR point
    under it; default: none, each pod compiles anew). CUDA graphs are captured at every start: they cannot be
    stored."""
    speculative_config: SpeculativeConfigSpec | None = None
    """Speculative decoding (--speculative-config; default: none): n-gram prompt lookup, suffix decoding, or a draft
    model mounted read-only beside the target."""
    extra_args: list[Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=list, max_length=64, json_schema_extra=cel(EXTRA_ARGS_RULE, EXTRA_ARGS_API_KEY_RULE))
    """Extra kvfleet-agent serve arguments, appended last (an escape hatch: later flags win; not --api-key, which
    spec.auth.apiKeySecretRef gives from a Secret)."""

    @field_validator("block_size")
    @classmethod
    def _block_size(cls, v: int) -> int:
        check(v in BLOCK_SIZES, BLOCK_SIZE_RULE)
        return v

    @model_validator(mode="after")
    def _quantization(self) -> RuntimeSpec:
        check_quantization(self.quantization, self.kv_cache_dtype, self.dtype)
        return self

    @field_validator("extra_args")
    @classmethod
    def _extra_args(cls, v: list[str]) -> list[str]:
        check(all("\n" not in a for a in v), EXTRA_ARGS_RULE)
        check(all(a != "--api-key" and not a.startswith("--api-key=") for a in v), EXTRA_ARGS_API_KEY_RULE)
        return v


def _quantity(v: int | str | None) -> int | str | None:
    if v is not None and not isinstance(v, int):
        check(QUANTITY_RE.fullmatch(v) is not None, QUANTITY_RULE)
    return v


class ResourceList(SpecModel):
    """CPU and memory for the agent container."""

    cpu: Quantity | None = Field(default=None, json_schema_extra=cel(QUANTITY_RULE) | {"maxLength": 64})
    """CPU cores, e.g. 8 or 500m."""
    memory: Quantity | None = Field(default=None, json_schema_extra=cel(QUANTITY_RULE) | {"maxLength": 64})
    """Memory, e.g. 64Gi."""

    _cpu = field_validator("cpu", "memory")(_quantity)


class ResourcesSpec(SpecModel):
    """Resources of each replica's pod."""

    gpus_per_replica: int | None = Field(default=None, ge=0, le=64)
    """nvidia.com/gpu per pod (default: tensorParallelSize; 0 runs on CPU, for tiny models and tests)."""
    requests: ResourceList | None = None
    """CPU and memory requests."""
    limits: ResourceList | None = None
    """CPU and memory limits."""


class LatencyTarget(SpecModel):
    """A latency percentile to keep under a budget, e.g. TTFT p95 <= 0.5 s."""

    model_config = ConfigDict(json_schema_extra=cel(LATENCY_SECONDS_RULE))
    metric: Literal["ttft", "itl", "e2e"]
    """ttft: time to first token; itl: inter-token latency; e2e: whole-request latency."""
    percentile: float = Field(default=95, ge=50, lt=100)
    """Percentile of the metric over the window, 50 <= p < 100."""
    seconds: float
    """Budget in seconds (> 0)."""

    @model_validator(mode="after")
    def _positive(self) -> LatencyTarget:
        check(self.seconds > 0, LATENCY_SECONDS_RULE)
        return self


class Targets(SpecModel):
    """What builtin autoscaling keeps each replica under."""

    model_config = ConfigDict(json_schema_extra=cel(LATENCY_UNIQUE_RULE))
    queue_depth_per_replica: float | None = Field(default=None, gt=0)
    """Requests per ready replica, waiting plus running (kvfleet_requests_waiting + kvfleet_requests_running)."""
    latency: list[LatencyTarget] = Field(default_factory=list, max_length=6)
    """Latency percentile budgets; the largest replica proposal wins."""

    @model_validator(mode="after")
    def _unique(self) -> Targets:
        keys = [(t.metric, t.percentile) for t in self.latency]
        check(len(keys) == len(set(keys)), LATENCY_UNIQUE_RULE)
        return self


class ScalingPolicy(SpecModel):
    """At most `value` pods (or percent of current replicas) of change per `periodSeconds`."""

    type: Literal["Pods", "Percent"]
    """Pods: an absolute count; Percent: a share of the current replicas."""
    value: int = Field(ge=1, le=10000)
    """Pods or percent allowed per period (> 0)."""
    period_seconds: int = Field(ge=1, le=1800)
    """Length of the period the limit applies to."""


class ScaleUpRules(SpecModel):
    """How fast replicas may be added (HPA behavior semantics)."""

    model_config = ConfigDict(json_schema_extra=cel(SCALE_UP_POLICY_RULE))
    stabilization_window_seconds: int = Field(default=0, ge=0, le=3600)
    """Use the lowest recommendation of this window (0: act at once)."""
    policies: list[ScalingPolicy] = Field(
        # behavior.DEFAULT_SCALE_UP: x5 or +16 per 15 s, tuned in bench/autoscale (HPA's x2 / +4 lagged a step).
        default_factory=lambda: [ScalingPolicy(type="Percent", value=400, period_seconds=15),
                                 ScalingPolicy(type="Pods", value=16, period_seconds=15)], max_length=10)
    """Rate limits; selectPolicy picks among them."""
    select_policy: Literal["Max", "Min", "Disabled"] = "Max"
    """Max: the most permissive policy; Min: the strictest; Disabled: never scale up."""

    @model_validator(mode="after")
    def _policies(self) -> ScaleUpRules:
        check(self.select_policy == "Disabled" or bool(self.policies), SCALE_UP_POLICY_RULE)
        return self


class ScaleDownRules(SpecModel):
    """How fast replicas may be removed (HPA behavior semantics)."""

    model_config = ConfigDict(json_schema_extra=cel(SCALE_DOWN_POLICY_RULE))
    stabilization_window_seconds: int = Field(default=300, ge=0, le=3600)
    """Use the highest recommendation of this window, so brief dips do not remove warm replicas."""
    policies: list[ScalingPolicy] = Field(
        default_factory=lambda: [ScalingPolicy(type="Percent", value=50, period_seconds=15)], max_length=10)
    """Rate limits; selectPolicy picks among them."""
    select_policy: Literal["Max", "Min", "Disabled"] = "Max"
    """Max: the most permissive policy; Min: the strictest; Disabled: never scale down."""

    @model_validator(mode="after")
    def _policies(self) -> ScaleDownRules:
        check(self.select_policy == "Disabled" or bool(self.policies), SCALE_DOWN_POLICY_RULE)
        return self


class Behavior(SpecModel):
    """Scale-up and scale-down rate limits and stabilization windows."""

    scale_up: ScaleUpRules = Field(default_factory=ScaleUpRules)
    """Adding replicas."""
    scale_down: ScaleDownRules = Field(default_factory=ScaleDownRules)
    """Removing replicas."""


class AutoscalingSpec(SpecModel):
    """Who sets the replica count, and how builtin autoscaling decides."""

    model_config = ConfigDict(json_schema_extra=cel(MIN_MAX_RULE, BUILTIN_TARGET_RULE, SCALE_TO_ZERO_RULE))
    mode: Literal["off", "external", "builtin"] = "off"
    """off: spec.replicas; external: an HPA/KEDA drives spec.replicas via the scale subresource; builtin: the
    operator scales on queue depth and latency percentiles (spec.replicas is ignored)."""
    min_replicas: int = Field(default=1, ge=0, le=1000)
    """Fewest replicas builtin autoscaling keeps. 0: it scales to zero after scaleToZeroAfterSeconds without a
    request, and back up as soon as a kvfleet-router holds a request for this deployment (without a router
    answering it keeps one replica: nothing else could bring it back). Off and external modes ignore it (an
    HPA or KEDA has its own bounds; spec.replicas may be 0 in any mode)."""
    max_replicas: int = Field(default=1, ge=1, le=1000)
    """Most replicas builtin autoscaling starts."""
    interval_seconds: int = Field(default=15, ge=5, le=600)
    """Seconds between autoscaling decisions."""
    window_seconds: int = Field(default=60, ge=10, le=3600)
    """Metrics window the percentiles and queue depth are computed over."""
    tolerance: float = Field(default=0.1, ge=0, le=1)
    """No change while every observed/target ratio is within 1 +- tolerance."""
    targets: Targets = Field(default_factory=Targets)
    """What to keep each replica under (builtin mode needs at least one)."""
    behavior: Behavior = Field(default_factory=Behavior)
    """Rate limits and stabilization windows."""
    startup_grace_seconds: int | None = Field(default=None, ge=0, le=7200)
    """Seconds a new replica may take to become ready before it stops counting as capacity on the way
    (default: learned from observed startups)."""
    scale_to_zero_after_seconds: int = Field(default=300, ge=10, le=86400)
    """With minReplicas 0: seconds without any request (none waiting or running on an agent, none arriving, none
    held at a router) before builtin autoscaling scales to zero; at least intervalSeconds. Ignored otherwise."""

    @model_validator(mode="after")
    def _rules(self) -> AutoscalingSpec:
        check(self.min_replicas <= self.max_replicas, MIN_MAX_RULE)
        has_target = self.targets.queue_depth_per_replica is not None or bool(self.targets.latency)
        check(self.mode != "builtin" or has_target, BUILTIN_TARGET_RULE)
        check(self.min_replicas > 0 or self.scale_to_zero_after_seconds >= self.interval_seconds, SCALE_TO_ZERO_RULE)
        return self


class PodOverrides(SpecModel):
    """Additions to the agent pods."""

    node_selector: dict[str, str] = Field(default_factory=dict, max_length=64)
    """Node labels the pods must match."""
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64)
    """Tolerations, in addition to the nvidia.com/gpu one added when the pod requests GPUs."""
    affinity: dict[str, Any] | None = Field(default=None,
                                            json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})
    """A core/v1 Affinity, copied as is."""
    env: list[EnvVar] = Field(default_factory=list, max_length=128, json_schema_extra=cel(ENV_API_KEY_RULE))
    """Extra environment variables, each a literal value or a valueFrom reference (a name also set by the operator
    overrides it; KVFLEET_API_KEY is refused: use spec.auth.apiKeySecretRef)."""
    annotations: dict[str, str] = Field(default_factory=dict, max_length=64)
    """Pod annotations."""
    labels: dict[str, str] = Field(default_factory=dict, max_length=64, json_schema_extra=cel(LABELS_RULE))
    """Pod labels (the operator's selector labels cannot be overridden)."""
    priority_class_name: str | None = Field(default=None, max_length=253)
    """PriorityClass of the pods."""
    service_account_name: str | None = Field(default=None, max_length=253)
    """ServiceAccount of the pods (its token is not mounted: the agent never calls the API)."""

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        check(not any(k in v for k in RESERVED_LABELS), LABELS_RULE)
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: list[EnvVar]) -> list[EnvVar]:
        check(all(e.name != API_KEY_ENV for e in v), ENV_API_KEY_RULE)
        return v


class AuthSpec(SpecModel):
    """Who may call the agents' OpenAI and gRPC APIs."""

    api_key_secret_ref: SecretKeyRef | None = None
    """The API key, from a key of a Secret in this namespace, as a pod's env valueFrom.secretKeyRef reads one. Every
    agent then requires `Authorization: Bearer <key>` on /v1 routes and the same `authorization` metadata on gRPC
    calls, as vLLM's --api-key does; /health, /ready and /metrics stay open for probes and Prometheus. The kubelet
    passes it to the agent as KVFLEET_API_KEY; the operator never reads the Secret. Changing name or key rolls
    the pods; a new value under the same key takes effect as pods restart (kubectl rollout restart deployment
    NAME). Create one with: kubectl create secret generic NAME --from-literal=api-key=$(openssl rand -hex 32). The
    agent refuses to start on a value with leading or trailing whitespace (as --from-file of a file ending in a
    newline gives)."""


class NetworkPolicySpec(SpecModel):
    """Which pods may reach the agents' HTTP and gRPC ports."""

    enabled: bool = True
    """Render a NetworkPolicy named after this InferenceDeployment that admits the agents' HTTP and gRPC ports only
    from pods of this namespace labelled serving.kvfleet.dev/client=true (routers, gateways, clients), from the
    kvfleet operator's pods to the HTTP port (it scrapes /metrics), and from the peers in `from`; other ingress to
    the agents is refused wherever the network plugin enforces NetworkPolicy. false: none (the operator deletes
    the one it rendered)."""
    from_: list[NetworkPolicyPeer] = Field(default_factory=list, max_length=32, alias="from")
    """More sources admitted to both ports, as in a NetworkPolicy's ingress from, e.g. Prometheus in another
    namespace: {namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: monitoring}}}."""


class InferenceDeploymentSpec(SpecModel):
    """Desired state: a model served by a fleet of kvfleet agents."""

    model_config = ConfigDict(json_schema_extra=cel(GPU_RULE, DRAFT_IMAGE_MOUNT_RULE, TARGET_IMAGE_MOUNT_RULE))
    model: ModelSpec
    """The model to serve and where its checkpoint comes from."""
    image: str | None = Field(default=None, max_length=512)
    """Agent image (default: the operator's KVFLEET_AGENT_IMAGE)."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    """Pull policy of the agent image."""
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    """Engine settings."""
    replicas: int = Field(default=1, ge=0, le=1000)
    """Replicas when autoscaling.mode is off or external (the scale subresource's spec path)."""
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    """GPUs, CPU and memory of each replica."""
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    """Who owns the replica count, and builtin autoscaling's targets."""
    pod: PodOverrides = Field(default_factory=PodOverrides)
    """Additions to the agent pods."""
    auth: AuthSpec = Field(default_factory=AuthSpec)
    """API key authentication of the agents (default: none)."""
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)
    """The NetworkPolicy in front of the agents (default: rendered)."""

    @property
    def gpus_per_replica(self) -> int:
        """The GPUs each pod requests: explicit, or one per tensor-parallel shard."""
        g = self.resources.gpus_per_replica
        return self.runtime.tensor_parallel_size if g is None else g

    @model_validator(mode="after")
    def _gpus(self) -> InferenceDeploymentSpec:
        check(self.gpus_per_replica % self.runtime.tensor_parallel_size == 0, GPU_RULE)
        check_mounts(self.model.name, self.model.source, self.runtime.speculative_config)
        return self


class ObjectMeta(BaseModel):
    """The metadata fields the operator reads (the apiserver owns the schema of metadata)."""

    model_config = ConfigDict(extra="allow")
    name: str
    namespace: str = "default"
    uid: str = ""
    generation: int = 0

    @field_validator("name")
    @classmethod
    def _dns_label(cls, v: str) -> str:
        check(re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", v) is not None and len(v) <= 63, NAME_RULE)
        return v


class InferenceDeployment(SpecModel):
    """A model served by an autoscaled fleet of kvfleet agents."""

    model_config = ConfigDict(extra="ignore")  # the apiserver adds fields the operator does not read
    api_version: Literal["serving.kvfleet.dev/v1alpha1"] = "serving.kvfleet.dev/v1alpha1"
    kind: Literal["InferenceDeployment"] = "InferenceDeployment"
    metadata: ObjectMeta
    spec: InferenceDeploymentSpec
    status: InferenceDeploymentStatus | None = None
