"""Pure: an InferenceDeployment and its children as read → what to apply and delete, and the status to write."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kvfleet_operator import builders
from kvfleet_operator.config import OperatorConfig
from kvfleet_operator.models import InferenceDeployment, InferenceDeploymentSpec
from kvfleet_operator.ownership import Ownership, classify
from kvfleet_operator.status import AUTOSCALER_CONDITIONS, RECONCILE_CONDITIONS, RECONCILE_FIELDS, invalid_spec, observe

Manifest = dict[str, Any]
ChildKey = tuple[str, str]  # (kind, name) of an object an InferenceDeployment owns, in its namespace
Children = Mapping[ChildKey, Manifest | None]  # what the read found of each; None: absent


# Ready's and Available's message at zero replicas in builtin mode, where zero is the autoscaler's decision.
SCALED_TO_ZERO = ("scaled to zero by the builtin autoscaler (status.autoscaling.lastDecision says why): a request "
                  "held at a kvfleet-router brings a replica back")


class ReconcileError(Exception):
    """Why a reconcile could not reach the desired state: a condition reason, and whether retrying can help."""

    def __init__(self, reason: str, message: str, *, permanent: bool) -> None:
        super().__init__(message)
        self.reason, self.message, self.permanent = reason, message, permanent


def refusal(owner: Ownership) -> ReconcileError | None:
    """Why an existing object must not be written (None: it may). Someone else's object is left alone for good; an
    earlier namesake's waits for garbage collection, so a resource recreated under the same name recovers."""
    if owner.writable:
        return None
    foreign = owner.verdict == "foreign"
    return ReconcileError("ResourceExists" if foreign else "WaitingForGarbageCollection", owner.message,
                          permanent=foreign)


def child_keys(name: str) -> tuple[ChildKey, ...]:
    """Every object a reconcile of InferenceDeployment `name` may apply or delete: what the read phase reads."""
    return (("ConfigMap", builders.args_config_map_name(name)), ("Deployment", name), ("Service", name),
            ("PodDisruptionBudget", name), ("NetworkPolicy", builders.network_policy_name(name)))


@dataclass(frozen=True)
class Write:
    """One object to server-side apply, with what ownership says of its live namesake."""

    manifest: Manifest
    owner: Ownership
    needs: tuple[ChildKey, ...] = ()  # writes this one depends on: skipped unless all of them were applied

    @property
    def key(self) -> ChildKey:
        return self.manifest["kind"], self.manifest["metadata"]["name"]

    @property
    def refusal(self) -> ReconcileError | None:
        """Why this object must not be written (None: it may); see refusal()."""
        return refusal(self.owner)


@dataclass(frozen=True)
class Delete:
    """One object the desired state no longer has; deleted only when ours, and only that very object (uid)."""

    kind: str
    name: str
    uid: str | None
    owner: Ownership

    @property
    def ours(self) -> bool:
        return self.owner.verdict == "ours"


@dataclass(frozen=True)
class Plan:
    """What one reconcile does: the writes in apply order, the deletes, and the inputs of its one status write."""

    namespace: str
    name: str
    generation: int
    current: Mapping[str, Any]  # the CR's status as read
    invalid: ReconcileError | None = None  # an unparseable spec: nothing is written but the status
    desired: int = 0
    writes: tuple[Write, ...] = ()
    deletes: tuple[Delete, ...] = ()
    deployment: Manifest | None = None  # our live Deployment: what the status reports if it cannot be applied
    builtin: bool = False
    waiting_for: str = "a node with room for them"  # waiting_for(spec): the status's words

    def status(self, *, deployment: Manifest | None, errors: Sequence[ReconcileError], now: str) -> dict[str, Any]:
        """The reconcile's status fields after the applies: `deployment` as applied (or as read), the errors in
        apply order."""
        if self.invalid is not None:
            return invalid_spec(dict(self.current), generation=self.generation, message=self.invalid.message,
                                now=now)
        first = errors[0] if errors else None
        return observe(generation=self.generation, desired=self.desired, selector=builders.selector_string(self.name),
                       deployment=deployment, error=None if first is None else first.message,
                       previous=_ours(self.current), now=now,
                       error_reason="ApplyFailed" if first is None else first.reason,
                       zero=SCALED_TO_ZERO if self.builtin else "no replicas are requested",
                       waiting_for=self.waiting_for)

    def status_to_write(self, *, deployment: Manifest | None, errors: Sequence[ReconcileError],
                        now: str) -> dict[str, Any] | None:
        """status(), or None when it would change none of the fields and conditions the reconcile owns (an
        invalid spec's status is always written: it is the only thing that reconcile does)."""
        new = self.status(deployment=deployment, errors=errors, now=now)
        if self.invalid is None and not _changed(self.current, new):
            return None
        return new

    @property
    def clears_autoscaler_status(self) -> bool:
        """Builtin autoscaling is off but its decision or conditions are still in the status: they would go stale."""
        return self.invalid is None and not self.builtin and bool(self.current.get("autoscaling") or any(
            c.get("type") in AUTOSCALER_CONDITIONS for c in self.current.get("conditions") or []))


def make_plan(body: Mapping[str, Any], children: Children, cfg: OperatorConfig, replicas: int | None) -> Plan:
    """The plan for one InferenceDeployment `body` (as read), its `children` as read (see child_keys), with
    `replicas` from the autoscaler or None (then replicas_for() decides)."""
    meta = body["metadata"]
    ns, name, generation = meta["namespace"], meta["name"], int(meta.get("generation") or 0)
    current = body.get("status") or {}
    try:
        # The spec only: the status is ours to write, and a field a newer operator added there must not make
        # this one refuse to reconcile.
        cr = InferenceDeployment.model_validate({k: v for k, v in body.items() if k != "status"})
    except ValidationError as e:
        # The CRD's schema and CEL rules should have refused this; it happens only if the CRD is out of date.
        msg = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        return Plan(ns, name, generation, current, invalid=ReconcileError(
            "InvalidSpec", f"invalid spec (is the CRD up to date?): {msg}", permanent=True))
    uid = cr.metadata.uid

    def owner(kind: str, obj_name: str) -> Ownership:
        return classify(children[kind, obj_name], kind, ns, name, uid)

    live = children["Deployment", name]
    ours = live if owner("Deployment", name).verdict == "ours" else None
    desired = replicas if replicas is not None else builders.replicas_for(
        cr.spec, ours["spec"].get("replicas") if ours is not None else None)
    if replicas is None and ours is None and cr.spec.autoscaling.mode == "builtin":
        # minReplicas 0 still creates one replica: it shows the spec serves (image, checkpoint, GPUs) while the
        # user watches, and the autoscaler's idle window then takes it to zero.
        desired = max(desired, 1)
    want = builders.plan(cr, cfg.agent_image, desired, operator_namespace=cfg.operator_namespace)
    writes: list[Write] = []
    for obj in want.apply:
        kind = obj["kind"]
        # The Deployment's pods mount the args ConfigMap applied before it: without it they would read someone
        # else's file, or none.
        needs = tuple(w.key for w in writes) if kind == "Deployment" else ()
        writes.append(Write(obj, owner(kind, obj["metadata"]["name"]), needs))
    deletes = tuple(Delete(kind, obj_name, ((children[kind, obj_name] or {}).get("metadata") or {}).get("uid"),
                           owner(kind, obj_name)) for _api_version, kind, obj_name in want.delete)
    return Plan(ns, name, generation, current, desired=desired, writes=tuple(writes), deletes=deletes,
                deployment=ours, builtin=cr.spec.autoscaling.mode == "builtin",
                waiting_for=waiting_for(cr.spec))


def waiting_for(spec: InferenceDeploymentSpec) -> str:
    """What a replica that is not ready yet may wait for, in the status's words: a CPU deployment never waits
    for GPUs, and tells which requests a node must have free."""
    if spec.gpus_per_replica:
        return f"a node with {spec.gpus_per_replica} free {builders.GPU_RESOURCE}"
    req = spec.resources.requests
    free = [f"{v} {k}" for k, v in (("CPU", req.cpu if req else None), ("memory", req.memory if req else None)) if v]
    return f"a node with {' and '.join(free)} free; no GPU requested" if free else "a node; no GPU requested"


def _ours(status: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [c for c in status.get("conditions") or [] if c.get("type") in RECONCILE_CONDITIONS]


def _changed(current: Mapping[str, Any], new: dict[str, Any]) -> bool:
    return any(current.get(k) != new.get(k) for k in RECONCILE_FIELDS) or _ours(current) != new["conditions"]
