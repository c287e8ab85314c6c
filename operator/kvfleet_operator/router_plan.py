"""Pure: an InferenceRouter, its children and the watched namespaces as read → writes, deletes and the status."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from kvfleet_operator import router_builders as rb
from kvfleet_operator.builders import MANAGED_BY_LABEL, MANAGER, OWNER_LABEL
from kvfleet_operator.config import OperatorConfig
from kvfleet_operator.ownership import Ownership, classify, controller
from kvfleet_operator.plan import ReconcileError, refusal
from kvfleet_operator.router_models import MAX_MODELS, ROUTER_KIND, InferenceRouter
from kvfleet_operator.router_tier_models import TieredModelSpec
from kvfleet_operator.router_tiers import TierEvent, tier_events, tier_status
from kvfleet_operator.status import READY, condition, observe

Manifest = dict[str, Any]
ChildKey = tuple[str, str, str]  # (kind, namespace, name)
GRANT_KINDS = ("Role", "RoleBinding")
STATUS_FIELDS = ("observedGeneration", "replicas", "readyReplicas", "modelCount", "models", "tieredModels")


@dataclass(frozen=True)
class Fleet:
    """What the router will find in one watched namespace: its InferenceDeployments and their agent pods, or why
    they could not be read."""

    deployments: Sequence[Manifest] = ()
    pods: Sequence[Manifest] = ()
    error: str | None = None


@dataclass(frozen=True)
class RouterRead:
    """Everything one reconcile read: each child (see child_keys; None: absent), this router's Roles and
    RoleBindings found by label wherever they are, and each watched namespace's fleet."""

    children: Mapping[ChildKey, Manifest | None]
    grants: Sequence[Manifest] = ()
    fleets: Mapping[str, Fleet] = field(default_factory=dict)
    held: Mapping[tuple[str, str], float] | None = None  # scraped from the router pods; None: none answered
    texts: Mapping[str, str] | None = None  # each answering router pod's /metrics body; None: none answered


def parse(body: Mapping[str, Any]) -> InferenceRouter | None:
    """The router's spec as read (its status aside: ours to write), or None if it does not validate."""
    try:
        return InferenceRouter.model_validate({k: v for k, v in body.items() if k != "status"})
    except ValidationError:
        return None


def child_keys(cr: InferenceRouter) -> tuple[ChildKey, ...]:
    """Every object the router's reconcile may write: what the read phase gets."""
    ns, name = cr.metadata.namespace, cr.metadata.name
    grants = [(kind, watched, rb.grant_name(ns, name)) for watched in cr.watched for kind in GRANT_KINDS]
    return (("ServiceAccount", ns, name), *grants, ("Deployment", ns, name), ("Service", ns, name),
            ("PodDisruptionBudget", ns, name))


@dataclass(frozen=True)
class RouterWrite:
    """One object to server-side apply, with what ownership says of its live namesake."""

    manifest: Manifest
    owner: Ownership
    needs: tuple[ChildKey, ...] = ()  # writes this one depends on: skipped unless all of them were applied

    @property
    def key(self) -> ChildKey:
        meta = self.manifest["metadata"]
        return self.manifest["kind"], meta["namespace"], meta["name"]

    @property
    def refusal(self) -> ReconcileError | None:
        """Why this object must not be written (None: it may); see plan.refusal()."""
        return refusal(self.owner)


@dataclass(frozen=True)
class RouterDelete:
    """A grant of ours the router no longer needs; deleted only as that very object (uid precondition)."""

    kind: str
    namespace: str
    name: str
    uid: str | None


def grant_is_ours(live: Manifest, namespace: str, name: str, uid: str) -> bool:
    """A Role or RoleBinding the operator wrote for router namespace/name: our labels, and no controller but this
    router (one in another namespace has none; one of a deleted namesake in the router's own namespace is left to
    garbage collection)."""
    labels = (live.get("metadata") or {}).get("labels") or {}
    ref = controller(live)
    return (labels.get(MANAGED_BY_LABEL) == MANAGER and labels.get(rb.ROUTER_LABEL) == name
            and labels.get(rb.ROUTER_NAMESPACE_LABEL) == namespace and (ref is None or ref.get("uid") == uid))


def _grant_owner(live: Manifest | None, kind: str, where: str, cr: InferenceRouter) -> Ownership:
    """Ownership of a grant outside the router's namespace, where no owner reference can say it: our labels make
    it ours (an earlier router of this name wrote it, if not this one: names are unique, so that one is gone)."""
    ns, name = cr.metadata.namespace, cr.metadata.name
    if live is None or grant_is_ours(live, ns, name, cr.metadata.uid):
        return Ownership("absent" if live is None else "ours")
    return Ownership("foreign", f"{kind} {where}/{rb.grant_name(ns, name)} already exists and was not written for "
                                f"InferenceRouter {ns}/{name}; it is left untouched. Delete it, or give the "
                                "InferenceRouter another name")


def _ready(pod: Manifest) -> bool:
    status = pod.get("status") or {}
    conds = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    return conds.get("Ready") == "True" and bool(status.get("podIP")) and not pod["metadata"].get("deletionTimestamp")


def endpoints(fleets: Mapping[str, Fleet], held: Mapping[tuple[str, str], float] | None = None,
              ) -> tuple[list[dict[str, Any]], int]:
    """Per InferenceDeployment of the watched namespaces: its model, Ready agent pods and (when the router pods
    answered) the requests they hold for it, sorted; and the number of distinct models."""
    out = []
    for ns, fleet in fleets.items():
        ready: dict[str, int] = {}
        for pod in fleet.pods:
            owner = ((pod.get("metadata") or {}).get("labels") or {}).get(OWNER_LABEL)
            if owner and _ready(pod):
                ready[owner] = ready.get(owner, 0) + 1
        for idp in fleet.deployments:
            meta, model = idp.get("metadata") or {}, ((idp.get("spec") or {}).get("model") or {}).get("name")
            if model and not meta.get("deletionTimestamp"):
                entry = {"model": model, "namespace": ns, "inferenceDeployment": meta["name"],
                         "readyEndpoints": ready.get(meta["name"], 0)}
                if held is not None:
                    entry["heldRequests"] = round(held.get((ns, meta["name"]), 0.0))
                out.append(entry)
    out.sort(key=lambda m: (m["model"], m["namespace"], m["inferenceDeployment"]))
    return out[:MAX_MODELS], len({m["model"] for m in out})


@dataclass(frozen=True)
class RouterPlan:
    """What one router reconcile does: writes in apply order, deletes, and the inputs of its one status write."""

    namespace: str
    name: str
    generation: int
    current: Mapping[str, Any]  # the CR's status as read
    invalid: ReconcileError | None = None
    desired: int = 0
    writes: tuple[RouterWrite, ...] = ()
    deletes: tuple[RouterDelete, ...] = ()
    deployment: Manifest | None = None  # our live Deployment: what the status reports if it cannot be applied
    read_errors: tuple[ReconcileError, ...] = ()
    models: tuple[dict[str, Any], ...] = ()
    model_count: int = 0
    tiered_specs: tuple[TieredModelSpec, ...] = ()
    tiered: tuple[dict[str, Any], ...] | None = None  # status.tieredModels; None: left out (no tiered models)

    def status(self, *, deployment: Manifest | None, errors: Sequence[ReconcileError], now: str) -> dict[str, Any]:
        """The status after the applies: `deployment` as applied (else as read), the errors in apply order."""
        previous = {c.get("type", ""): c for c in self.current.get("conditions") or [] if c.get("type") == READY}
        if self.invalid is not None:
            kept = {k: self.current[k] for k in STATUS_FIELDS if self.current.get(k) is not None}
            ready = condition(READY, False, "InvalidSpec", self.invalid.message, self.generation, now, previous)
            return {**kept, "observedGeneration": self.generation, "conditions": [ready]}
        met = [*self.read_errors, *errors]
        first = met[0] if met else None
        seen = observe(generation=self.generation, desired=self.desired, selector="", deployment=deployment,
                       error=None if first is None else first.message, previous=list(previous.values()), now=now,
                       error_reason="ApplyFailed" if first is None else first.reason)
        [ready] = [c for c in seen["conditions"] if c["type"] == READY]
        if first is not None:  # Ready is the router's only condition: it says what went wrong itself
            ready["message"] = f"{first.message}; {ready['message']}"[:32768]
        tiered = {} if self.tiered is None else {"tieredModels": list(self.tiered)}
        return {"observedGeneration": self.generation, "replicas": seen["replicas"],
                "readyReplicas": seen["readyReplicas"], "modelCount": self.model_count, "models": list(self.models),
                **tiered, "conditions": [ready]}

    def status_to_write(self, *, deployment: Manifest | None, errors: Sequence[ReconcileError],
                        now: str) -> dict[str, Any] | None:
        """status(), or None when it would change nothing the reconcile owns."""
        new = self.status(deployment=deployment, errors=errors, now=now)
        ours = [c for c in self.current.get("conditions") or [] if c.get("type") == READY]
        unchanged = all(self.current.get(k) == new.get(k) for k in STATUS_FIELDS) and ours == new["conditions"]
        return None if unchanged else new

    def events(self, status: Mapping[str, Any]) -> list[TierEvent]:
        """The promotion events of writing `status` over the status as read."""
        return tier_events(self.tiered_specs, self.current.get("tieredModels"), status.get("tieredModels"))


def make_plan(body: Mapping[str, Any], read: RouterRead, cfg: OperatorConfig) -> RouterPlan:
    """The plan for one InferenceRouter `body` (as read) and what else was read (see RouterRead)."""
    meta = body["metadata"]
    ns, name, generation = meta["namespace"], meta["name"], int(meta.get("generation") or 0)
    current = body.get("status") or {}
    try:
        cr = InferenceRouter.model_validate({k: v for k, v in body.items() if k != "status"})
    except ValidationError as e:  # the CRD's schema and CEL rules should have refused this: an old CRD
        msg = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        return RouterPlan(ns, name, generation, current, invalid=ReconcileError(
            "InvalidSpec", f"invalid spec (is the CRD up to date?): {msg}", permanent=True))
    uid = cr.metadata.uid

    def owner(kind: str, where: str, obj_name: str) -> Ownership:
        live = read.children[kind, where, obj_name]
        if kind in GRANT_KINDS and where != ns:
            return _grant_owner(live, kind, where, cr)
        return classify(live, kind, where, name, uid, owner_kind=ROUTER_KIND)

    sa = ("ServiceAccount", ns, name)
    writes: list[RouterWrite] = []
    for obj in rb.desired(cr, cfg.router_image):
        kind, where, obj_name = obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"]
        # Never bind a grant to, or run the pods as, a ServiceAccount of that name someone else made; never bind
        # our ServiceAccount to a Role of that name someone else wrote.
        needs = {"RoleBinding": (sa, ("Role", where, obj_name)), "Deployment": (sa,)}.get(kind, ())
        writes.append(RouterWrite(obj, owner(kind, where, obj_name), needs))
    watched = set(cr.watched)
    deletes = tuple(RouterDelete(g["kind"], g["metadata"]["namespace"], g["metadata"]["name"],
                                 g["metadata"].get("uid")) for g in read.grants
                    if g.get("kind") in GRANT_KINDS and g["metadata"].get("namespace") not in watched
                    and grant_is_ours(g, ns, name, uid))
    live = read.children["Deployment", ns, name]
    ours = live if owner("Deployment", ns, name).verdict == "ours" else None
    read_errors = tuple(ReconcileError("ReadFailed", f"cannot read InferenceDeployments and pods in namespace "
                                                     f"{where}: {f.error}", permanent=False)
                        for where, f in read.fleets.items() if f.error is not None)
    models, count = endpoints(read.fleets, read.held)
    return RouterPlan(ns, name, generation, current, desired=cr.spec.replicas, writes=tuple(writes),
                      deletes=deletes, deployment=ours, read_errors=read_errors, models=tuple(models),
                      model_count=count, tiered_specs=tuple(cr.spec.tiered_models),
                      tiered=_tiered(cr, current, read.texts))


def _tiered(cr: InferenceRouter, current: Mapping[str, Any], texts: Mapping[str, str] | None,
            ) -> tuple[dict[str, Any], ...] | None:
    """status.tieredModels: measured when a router pod reported its tier metrics; else the previous entries of the
    models still tiered (nobody measured a zero); None (left out) when there are none, or no tiered models."""
    specs = cr.spec.tiered_models
    if not specs:
        return None
    measured = tier_status(specs, texts or {})
    if measured[0]["routerPods"] > 0:  # every entry counts the same pods
        return tuple(measured)
    previous = {e.get("name"): e for e in current.get("tieredModels") or ()}
    return tuple(previous[t.name] for t in specs if t.name in previous) or None


def orphans(grants: Sequence[Manifest], exists: Mapping[tuple[str, str], bool]) -> list[RouterDelete]:
    """Grants whose router is gone, given whether each router (namespace, name) they name exists. Only grants
    without a controller: garbage collection removes those in a router's own namespace with it. A router recreated
    under the same name takes its grants over, or deletes those it no longer needs (make_plan)."""
    out = []
    for g in grants:
        meta = g.get("metadata") or {}
        labels = meta.get("labels") or {}
        key = (labels.get(rb.ROUTER_NAMESPACE_LABEL, ""), labels.get(rb.ROUTER_LABEL, ""))
        if (g.get("kind") in GRANT_KINDS and labels.get(MANAGED_BY_LABEL) == MANAGER and controller(g) is None
                and exists.get(key) is False):
            out.append(RouterDelete(g["kind"], meta["namespace"], meta["name"], meta.get("uid")))
    return out
