"""An in-memory Kubernetes API for the operator's unit tests: get/list/apply/delete with server-side apply's
ownership rules where they matter (status fields per field manager; uids; delete preconditions)."""

from __future__ import annotations

import copy
import itertools
from typing import Any

from kvfleet_operator.kube import FIELD_MANAGER, ApiError

Key = tuple[str, str, str]
_uids = itertools.count(1)


def _fields(status: dict[str, Any]) -> set[Any]:
    return {k for k in status if k != "conditions"} | {("condition", c["type"]) for c in status.get("conditions", [])}


class FakeKube:
    """Objects by (kind, namespace, name). Optional failures by kind (`fail`) or for every call (`broken`)."""

    def __init__(self) -> None:
        self.objects: dict[Key, dict[str, Any]] = {}
        self.status_writes: list[dict[str, Any]] = []  # the reconcile's (manager kvfleet-operator)
        self.writes: list[tuple[str, str, str | None, str]] = []  # (verb, kind, subresource, manager)
        self.fail: dict[str, ApiError] = {}
        self.fail_list: dict[str, ApiError] = {}  # list calls by kind
        self.broken: BaseException | None = None
        self.deleted: list[tuple[str, str]] = []
        self.reads: list[tuple[str, str]] = []  # (kind, name) of every get
        self.closed = False
        self._owners: dict[Key, dict[str, set[Any]]] = {}

    def add(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Store an object as if someone else had created it (a uid, generation 1)."""
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", "ns")
        meta.setdefault("uid", f"uid-{next(_uids)}")
        meta.setdefault("generation", 1)
        self.objects[obj["kind"], meta["namespace"], meta["name"]] = obj
        return obj

    def _check(self) -> None:
        if self.broken is not None:
            raise self.broken

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self._check()
        self.reads.append((kind, name))
        obj = self.objects.get((kind, namespace, name))
        return copy.deepcopy(obj) if obj else None

    async def list(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        """Objects of a kind in a namespace ("": every namespace) matching `key=value` and bare `key` (exists)
        terms; like the API's, the items carry no kind."""
        self._check()
        terms = [term.split("=", 1) for term in label_selector.split(",") if term]
        if kind in self.fail_list:
            raise self.fail_list[kind]

        def match(labels: dict[str, str]) -> bool:
            return all(t[0] in labels and (len(t) == 1 or labels[t[0]] == t[1]) for t in terms)

        return [{k: copy.deepcopy(v) for k, v in o.items() if k != "kind"}
                for (k, ns, _), o in sorted(self.objects.items())
                if k == kind and namespace in ("", ns) and match(o["metadata"].get("labels", {}))]

    async def apply(self, obj: dict[str, Any], *, subresource: str | None = None,
                    manager: str = FIELD_MANAGER) -> dict[str, Any]:
        self._check()
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        self.writes.append(("apply", obj["kind"], subresource, manager))
        if subresource == "status":
            return self._apply_status(key, obj["status"], manager)
        if obj["kind"] in self.fail:
            raise self.fail[obj["kind"]]
        old = self.objects.get(key)
        meta = {**copy.deepcopy(obj["metadata"]),
                "uid": old["metadata"]["uid"] if old else f"uid-{next(_uids)}",
                "generation": (old["metadata"]["generation"] + (old.get("spec") != obj.get("spec"))) if old else 1}
        self.objects[key] = {**copy.deepcopy(obj), "metadata": meta, "status": (old or {}).get("status", {})}
        return copy.deepcopy(self.objects[key])

    def _apply_status(self, key: Key, status: dict[str, Any], manager: str) -> dict[str, Any]:
        """Server-side apply of a status: a field this manager owned and no longer sends is removed (unless
        another manager owns it too); conditions merge by type (a list-map)."""
        if manager == FIELD_MANAGER:
            self.status_writes.append(copy.deepcopy(status))
        stored = self.objects[key].setdefault("status", {})
        owners = self._owners.setdefault(key, {})
        dropped = owners.get(manager, set()) - _fields(status)
        owners[manager] = _fields(status)
        others = set().union(*(f for m, f in owners.items() if m != manager))
        conds = {c["type"]: c for c in stored.get("conditions", [])}
        for f in dropped - others:
            if isinstance(f, tuple):
                conds.pop(f[1], None)
            else:
                stored.pop(f, None)
        stored.update({k: copy.deepcopy(v) for k, v in status.items() if k != "conditions"})
        conds.update({c["type"]: copy.deepcopy(c) for c in status.get("conditions", [])})
        stored["conditions"] = list(conds.values())
        return copy.deepcopy(self.objects[key])

    async def delete(self, kind: str, namespace: str, name: str, *, uid: str | None = None) -> bool:
        self._check()
        obj = self.objects.get((kind, namespace, name))
        if obj is not None and uid is not None and obj["metadata"]["uid"] != uid:
            raise ApiError(409, "Conflict", "Precondition failed: UID in precondition")
        self.deleted.append((kind, name))
        self.writes.append(("delete", kind, None, ""))
        return self.objects.pop((kind, namespace, name), None) is not None

    async def close(self) -> None:
        self.closed = True
