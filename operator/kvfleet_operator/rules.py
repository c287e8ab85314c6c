"""CEL validation rules of the InferenceDeployment CRD, each with the message users see (pydantic raises the same)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
RESERVED_LABELS = ("serving.kvfleet.dev/inference-deployment", "app.kubernetes.io/managed-by")


@dataclass(frozen=True)
class Rule:
    """A CEL rule for the apiserver, with the message the pydantic validators raise for the same mistake."""

    rule: str
    message: str
    field_path: str | None = None  # reported path, relative to the object the rule sits on
    message_expression: str | None = None  # CEL giving the message (e.g. naming the value); `message` if it fails

    def cel(self) -> dict[str, str]:
        out = {"rule": self.rule, "message": self.message}
        if self.message_expression:
            out["messageExpression"] = self.message_expression
        if self.field_path:
            out["fieldPath"] = self.field_path
        return out


def check(ok: bool, rule: Rule) -> None:
    """Raise the rule's message (pydantic reports it as a validation error) unless ok."""
    if not ok:
        raise ValueError(rule.message)


def cel(*rules: Rule) -> dict[str, Any]:
    """The JSON-schema fragment that attaches rules to a field or model."""
    return {"x-kubernetes-validations": [r.cel() for r in rules]}


NAME_RULE = Rule("self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$') && size(self.metadata.name) <= 63",
                 "metadata.name must be a DNS-1035 label (lowercase letters, digits and '-', starting with a letter, "
                 "at most 63 characters) because the Service is named after it: rename the InferenceDeployment")
MODEL_NAME_RULE = Rule("self.matches('^[A-Za-z0-9][A-Za-z0-9._/:-]*$') && !self.contains('..')",
                       "spec.model.name may hold only letters, digits and . _ / : - (starting with a letter or digit) "
                       "and no '..', since it is also the mount path /models/<name>: rename the served model")
COMPILE_CACHE_PATH_RULE = Rule("!self.path.startsWith('/') && !('/' + self.path + '/').contains('/../')",
                               "spec.runtime.compileCache.path is a sub-path inside the claim: make it relative (no "
                               "leading '/') and without '..', or leave it out to use the claim's root", ".path")
BLOCK_SIZE_RULE = Rule(f"self in [{', '.join(map(str, BLOCK_SIZES))}]",
                       "spec.runtime.blockSize must be a power of two up to 256: use 16 unless you measured otherwise")
EXTRA_ARGS_RULE = Rule("self.all(a, !a.contains('\\n'))",
                       "spec.runtime.extraArgs items must not contain newlines: "
                       "pass each flag and each value as its own item")
QUANTITY_RULE = Rule("type(self) == int || "
                     "string(self).matches('^[0-9]+(\\\\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$')",
                     "spec.resources cpu and memory must be Kubernetes quantities: write e.g. 4, 500m, 32Gi")
GPU_RULE = Rule("!has(self.resources) || !has(self.resources.gpusPerReplica) || !has(self.runtime) || "
                "!has(self.runtime.tensorParallelSize) || "
                "self.resources.gpusPerReplica % self.runtime.tensorParallelSize == 0",
                "spec.resources.gpusPerReplica must be a multiple of spec.runtime.tensorParallelSize: set it to "
                "tensorParallelSize (one GPU per shard) or a multiple of it", ".resources.gpusPerReplica")
MIN_MAX_RULE = Rule("self.minReplicas <= self.maxReplicas",
                    "spec.autoscaling.minReplicas must be <= maxReplicas: lower minReplicas or raise maxReplicas",
                    ".minReplicas")
# Scale to zero (autoscaling/zero.py): idleness is seen once a round, so a shorter window could not be observed.
SCALE_TO_ZERO_RULE = Rule("self.minReplicas > 0 || self.scaleToZeroAfterSeconds >= self.intervalSeconds",
                          "spec.autoscaling.scaleToZeroAfterSeconds must be >= intervalSeconds when minReplicas is 0 "
                          "(idleness is checked once a round): raise scaleToZeroAfterSeconds or lower intervalSeconds",
                          ".scaleToZeroAfterSeconds")
BUILTIN_TARGET_RULE = Rule(
    "self.mode != 'builtin' || (has(self.targets) && (has(self.targets.queueDepthPerReplica) || "
    "(has(self.targets.latency) && size(self.targets.latency) > 0)))",
    "spec.autoscaling.targets needs queueDepthPerReplica or at least one latency target when mode is builtin: "
    "add a target, or set mode to off or external", ".targets")
LATENCY_SECONDS_RULE = Rule("self.seconds > 0.0",
                            "spec.autoscaling.targets.latency[].seconds must be > 0: give the latency budget in "
                            "seconds, e.g. 0.5", ".seconds")
LATENCY_UNIQUE_RULE = Rule(
    "!has(self.latency) || self.latency.all(a, self.latency.exists_one(b, b.metric == a.metric && "
    "b.percentile == a.percentile))",
    "spec.autoscaling.targets.latency lists the same metric and percentile twice: keep one entry for each", ".latency")
SCALE_UP_POLICY_RULE = Rule("self.selectPolicy == 'Disabled' || size(self.policies) > 0",
                            "spec.autoscaling.behavior.scaleUp.policies must not be empty unless selectPolicy is "
                            "Disabled: add e.g. {type: Percent, value: 100, periodSeconds: 15}", ".policies")
SCALE_DOWN_POLICY_RULE = Rule("self.selectPolicy == 'Disabled' || size(self.policies) > 0",
                              "spec.autoscaling.behavior.scaleDown.policies must not be empty unless selectPolicy is "
                              "Disabled: add e.g. {type: Percent, value: 50, periodSeconds: 15}", ".policies")
LABELS_RULE = Rule(" && ".join(f"!('{k}' in self)" for k in RESERVED_LABELS),
                   "spec.pod.labels must not set serving.kvfleet.dev/inference-deployment or "
                   "app.kubernetes.io/managed-by (the operator selects its pods by them): remove those keys")

# A hostPath model volume is mounted into pods the operator creates for whoever may create an InferenceDeployment,
# so it must not expose the node itself: its root, its configuration and credentials, kernel interfaces, device
# nodes, or runtime sockets (a read-only mount of a socket can still be connected to). The subtrees below are
# refused with everything under them; the parents only as themselves (/var/lib/<app>/models is a usual place).
SYSTEM_SUBTREES = ("/etc", "/proc", "/sys", "/dev", "/boot", "/root", "/run", "/var/run", "/usr", "/bin", "/sbin",
                   "/lib", "/lib32", "/lib64", "/libx32", "/var/lib/kubelet", "/var/lib/containerd",
                   "/var/lib/docker", "/var/lib/etcd", "/var/lib/cni", "/var/log")
SYSTEM_PARENTS = ("/", "/var", "/var/lib", "/home")
_SYSTEM_PATHS = SYSTEM_PARENTS + tuple(p + "/" for p in SYSTEM_PARENTS[1:])  # the parents, as written either way


@dataclass(frozen=True)
class SourceRules:
    """The rules of a checkpoint source (pvc, hostPath or image), their messages naming the field at `where`."""

    source: Rule
    sub_path: Rule
    host_path: Rule
    host_path_system: Rule
    image_path: Rule

    def all(self) -> tuple[Rule, ...]:
        return self.source, self.sub_path, self.host_path, self.host_path_system, self.image_path


def source_rules(where: str) -> SourceRules:
    """The rules of the checkpoint source at `where` (spec.model.source, or the draft model's)."""
    return SourceRules(
        Rule("(has(self.pvc) ? 1 : 0) + (has(self.hostPath) ? 1 : 0) + (has(self.image) ? 1 : 0) == 1",
             f"{where} must set exactly one of pvc, hostPath or image: keep one and remove the others"),
        Rule("!self.path.startsWith('/') && !('/' + self.path + '/').contains('/../')",
             f"{where}.pvc.path is a sub-path inside the claim: make it relative (no leading '/') and without '..'",
             ".path"),
        Rule(  # "/" passes this rule so that the system-directory rule, which says why it is refused, reports it.
            "self.path == '/' || (self.path.matches('^(/[^/]+)+/?$') && !(self.path + '/').contains('/../') && "
            "!(self.path + '/').contains('/./'))",
            f"{where}.hostPath.path must be an absolute path on the node without '.', '..' or empty ('//') "
            "segments, e.g. /data/models/llama-3-8b", ".path"),
        Rule(f"!(self.path in [{', '.join(repr(p) for p in _SYSTEM_PATHS)}]) "
             f"&& ![{', '.join(repr(p) for p in SYSTEM_SUBTREES)}].exists(d, (self.path + '/').startsWith(d + '/'))",
             f"{where}.hostPath.path must not be a system directory of the node: not {', '.join(SYSTEM_PARENTS)} "
             f"themselves, nor {', '.join(SYSTEM_SUBTREES)} or anything under them. Keep the checkpoint in a "
             "directory of its own, e.g. /data/models/llama-3-8b, or use a pvc source", ".path"),
        Rule("self.path.startsWith('/') && !(self.path + '/').contains('/../')",
             f"{where}.image.path must be an absolute path without '..' inside the agent image, e.g. /opt/models/tiny",
             ".path"))


MODEL_SOURCE_RULES = source_rules("spec.model.source")
SOURCE_RULE, SUBPATH_RULE = MODEL_SOURCE_RULES.source, MODEL_SOURCE_RULES.sub_path
HOST_PATH_RULE, HOST_PATH_SYSTEM_RULE = MODEL_SOURCE_RULES.host_path, MODEL_SOURCE_RULES.host_path_system
IMAGE_PATH_RULE = MODEL_SOURCE_RULES.image_path

API_KEY_ENV = "KVFLEET_API_KEY"  # the agent reads its --api-key from it
ENV_VALUE_RULE = Rule("has(self.value) != has(self.valueFrom)",
                      "spec.pod.env[] entries set exactly one of value or valueFrom: keep value for a literal "
                      "(value: \"\" for an empty one), or valueFrom to read a Secret, a ConfigMap or a pod field")
ENV_SOURCE_RULE = Rule(
    "(has(self.secretKeyRef) ? 1 : 0) + (has(self.configMapKeyRef) ? 1 : 0) + (has(self.fieldRef) ? 1 : 0) + "
    "(has(self.resourceFieldRef) ? 1 : 0) == 1",
    "spec.pod.env[].valueFrom sets exactly one of secretKeyRef, configMapKeyRef, fieldRef or resourceFieldRef: "
    "keep one and remove the others")
# What a container's env may read through the downward API (core/v1 validation of env fieldRef). The rules below
# write their patterns as CEL raw strings (r"..."): they hold backslashes and quotes.
FIELD_PATH_PATTERN = (r"^(metadata\.(name|namespace|uid|labels\['[^']+'\]|annotations\['[^']+'\])|"
                      r"spec\.(nodeName|serviceAccountName)|status\.(hostIP|hostIPs|podIP|podIPs))$")
FIELD_PATH_RULE = Rule(f'self.fieldPath.matches(r"{FIELD_PATH_PATTERN}")',
                       "spec.pod.env[].valueFrom.fieldRef.fieldPath must be a field a container's env can read: "
                       "metadata.name, metadata.namespace, metadata.uid, metadata.labels['KEY'], "
                       "metadata.annotations['KEY'], spec.nodeName, spec.serviceAccountName, status.hostIP(s) or "
                       "status.podIP(s)", ".fieldPath")
RESOURCE_PATTERN = r"^(limits|requests)\.(cpu|memory|ephemeral-storage|hugepages-[^.]+)$"
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"
RESOURCE_FIELD_RULE = Rule(f'self.resource.matches(r"{RESOURCE_PATTERN}") && (!has(self.divisor) || '
                           f'type(self.divisor) == int || string(self.divisor).matches(r"{QUANTITY_PATTERN}"))',
                           "spec.pod.env[].valueFrom.resourceFieldRef needs resource limits.X or requests.X, X one "
                           "of cpu, memory, ephemeral-storage or hugepages-SIZE, and a divisor that is a quantity, "
                           "e.g. {resource: limits.memory, divisor: 1Mi}")
ENV_API_KEY_RULE = Rule(f"self.all(e, e.name != '{API_KEY_ENV}')",
                        f"spec.pod.env must not set {API_KEY_ENV}: give the key through spec.auth.apiKeySecretRef "
                        "(a Secret), which keeps it out of the pod spec")
EXTRA_ARGS_API_KEY_RULE = Rule("self.all(a, a != '--api-key' && !a.startsWith('--api-key='))",
                               "spec.runtime.extraArgs must not pass --api-key (the key would be readable in the "
                               "pod spec): give it through spec.auth.apiKeySecretRef (a Secret)")
PEER_RULE = Rule("has(self.ipBlock) ? !has(self.podSelector) && !has(self.namespaceSelector) : "
                 "(has(self.podSelector) || has(self.namespaceSelector))",
                 "spec.networkPolicy.from[] entries set ipBlock alone, or podSelector and/or namespaceSelector "
                 "(as in a NetworkPolicy's ingress from): give each entry one of these, and split one that mixes "
                 "ipBlock with a selector")
SELECTOR_RULE = Rule("self.operator in ['In', 'NotIn'] ? has(self.values) && size(self.values) > 0 : "
                     "!has(self.values) || size(self.values) == 0",
                     "spec.networkPolicy.from[] matchExpressions need values with In and NotIn, and none with "
                     "Exists and DoesNotExist")
