"""Pure: may this InferenceDeployment (or InferenceRouter) write an existing object of its name? (GitOps-safe
adoption rules)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kvfleet_operator.models import GROUP, KIND

Verdict = Literal["absent", "ours", "previous", "foreign"]


@dataclass(frozen=True)
class Ownership:
    """What an existing object's controller reference says about it, relative to one InferenceDeployment."""

    verdict: Verdict
    message: str = ""

    @property
    def writable(self) -> bool:
        return self.verdict in ("absent", "ours")


def controller(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The ownerReference with controller: true, if any."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return next((r for r in refs if r.get("controller")), None)


def classify(live: dict[str, Any] | None, kind: str, namespace: str, cr_name: str, cr_uid: str, *,
             owner_kind: str = KIND) -> Ownership:
    """absent: nothing there, create it. ours: controlled by this very CR (this uid), apply.
    previous: controlled by an earlier CR of the same kind (`owner_kind`) and name, deleted and not yet collected:
    garbage collection removes it soon, so retry (a CR recreated under the same name must not fail for good).
    foreign: anything else (no controller, another kind, another CR): never adopt it, since a server-side apply
    with force would silently take over an object a person or another tool manages."""
    if live is None:
        return Ownership("absent")
    ref = controller(live)
    name = (live.get("metadata") or {}).get("name", "")
    what = f"{kind} {namespace}/{name}"
    if ref is not None and ref.get("kind") == owner_kind and str(ref.get("apiVersion", "")).startswith(GROUP + "/"):
        if ref.get("uid") == cr_uid:
            return Ownership("ours")
        if ref.get("name") == cr_name:
            # Names are unique, so an owner with our name but another uid no longer exists.
            return Ownership("previous", f"{what} still belongs to a deleted {owner_kind} {cr_name} (uid "
                                         f"{ref.get('uid')}); waiting for garbage collection to remove it")
    owner = f"{ref.get('kind')} {ref.get('name')}" if ref is not None else "no controller"
    return Ownership("foreign", f"{what} already exists and is not controlled by this {owner_kind} "
                                f"({owner}); it is left untouched. Delete or rename that {kind}, or give the "
                                f"{owner_kind} another name")
