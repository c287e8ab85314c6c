"""InferenceDeployment bodies, the in-memory API seeded with one, and the operator state over it, for the
reconcile, plan and handler tests."""

from __future__ import annotations

from typing import Any

import kopf
from fake_kube import FakeKube

from kvfleet_operator.config import OperatorConfig
from kvfleet_operator.state import OperatorState

SPEC: dict[str, Any] = {"model": {"name": "m", "source": {"pvc": {"claimName": "c"}}}, "replicas": 2}


def cr(spec: dict[str, Any] | None = None, status: dict[str, Any] | None = None, uid: str = "u1") -> dict[str, Any]:
    return {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "m", "namespace": "ns", "uid": uid, "generation": 4},
            "spec": spec or SPEC, "status": status or {}}


def state(kube: FakeKube, cfg: OperatorConfig | None = None) -> OperatorState:
    return OperatorState(cfg or OperatorConfig(), kube)


def memo(kube: FakeKube) -> kopf.Memo:
    """A handler's memo, carrying a fresh state over `kube`."""
    m = kopf.Memo()
    state(kube).attach(m)
    return m


def with_cr(body: dict[str, Any] | None = None) -> FakeKube:
    kube = FakeKube()
    kube.add(body or cr())
    return kube


def children(kube: FakeKube) -> list[str]:
    return sorted(k for k, _, _ in kube.objects if k != "InferenceDeployment")


def stored_status(kube: FakeKube) -> dict[str, Any]:
    return kube.objects["InferenceDeployment", "ns", "m"]["status"]


def conds(kube: FakeKube) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in stored_status(kube)["conditions"]}


def foreign(kind: str, name: str = "m", owner: dict[str, Any] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {"team": "theirs"}}
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return {"apiVersion": "v1", "kind": kind, "metadata": meta, "spec": {"theirs": True}}
