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

    def cel(self) -> dict[str, str]:
        out = {"rule": self.rule, "message": self.message}
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
SOURCE_RULE = Rule("(has(self.pvc) ? 1 : 0) + (has(self.hostPath) ? 1 : 0) + (has(self.image) ? 1 : 0) == 1",
                   "spec.model.source must set exactly one of pvc, hostPath or image: keep one and remove the others")
SUBPATH_RULE = Rule("!self.path.startsWith('/') && !('/' + self.path + '/').contains('/../')",
                    "spec.model.source.pvc.path is a sub-path inside the claim: make it relative (no leading '/') "
                    "and without '..'", ".path")
HOST_PATH_RULE = Rule("self.path.startsWith('/') && !(self.path + '/').contains('/../')",
                      "spec.model.source.hostPath.path must be an absolute path without '..' on the node, "
                      "e.g. /data/models/llama-3-8b", ".path")
IMAGE_PATH_RULE = Rule("self.path.startsWith('/') && !(self.path + '/').contains('/../')",
                       "spec.model.source.image.path must be an absolute path without '..' inside the agent image, "
                       "e.g. /opt/models/tiny", ".path")
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
