"""The only module that calls the Kubernetes API: a small aiohttp client on kopf's login credentials."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any, Protocol

import aiohttp
import kopf

from kvfleet_operator.models import GROUP, KIND, PLURAL, VERSION
from kvfleet_operator.router_models import ROUTER_KIND, ROUTER_PLURAL

log = logging.getLogger(__name__)
FIELD_MANAGER = "kvfleet-operator"
# The builtin autoscaler's field manager for status.autoscaling and its conditions: under server-side apply, each
# manager's status write keeps the other's fields, and an empty apply by one removes exactly what it owned.
AUTOSCALER_MANAGER = "kvfleet-autoscaler"
PEERING_KIND = "ClusterKopfPeering"  # kopf's cluster-wide peering object (read by peering.py)
# kind → (API path prefix, plural) for every kind the operator reads or writes.
_KINDS: dict[str, tuple[str, str]] = {
    "Deployment": ("/apis/apps/v1", "deployments"),
    "Service": ("/api/v1", "services"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "Pod": ("/api/v1", "pods"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    KIND: (f"/apis/{GROUP}/{VERSION}", PLURAL),
    ROUTER_KIND: (f"/apis/{GROUP}/{VERSION}", ROUTER_PLURAL),
    PEERING_KIND: ("/apis/kopf.dev/v1", "clusterkopfpeerings"),
}
_CLUSTER_SCOPED = frozenset({PEERING_KIND})
# 400 and 422: the request itself is wrong (bad body, invalid object), so only a changed spec helps; 405 and 415
# mean this client speaks an API the server lacks. Everything else (403 while RBAC propagates, 404 or 409 around a
# terminating namespace or a racing writer, 429, 5xx) can heal by itself and is retried with back-off.
PERMANENT_STATUSES = frozenset({400, 405, 415, 422})


class ApiError(Exception):
    """A non-2xx answer of the apiserver, with its Status reason and message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message

    @property
    def permanent(self) -> bool:
        """Retrying the same request cannot help; the input must change."""
        return self.status in PERMANENT_STATUSES


def path(kind: str, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    """The REST path of an object, or of its collection when name is None (`namespace` is ignored for a
    cluster-scoped kind; "" with no name: the collection across all namespaces)."""
    prefix, plural = _KINDS[kind]
    everywhere = kind in _CLUSTER_SCOPED or (not namespace and name is None)
    out = f"{prefix}/{plural}" if everywhere else f"{prefix}/namespaces/{namespace}/{plural}"
    return out + (f"/{name}" if name else "") + (f"/{subresource}" if subresource else "")


def default_login(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    """The credentials kopf's own default login would pick: the pod's service account, else the kubeconfig."""
    for login in (kopf.login_with_service_account, kopf.login_with_kubeconfig):
        info = login(settings=settings, logger=log)
        if info is not None:
            return info
    raise kopf.LoginError("no service account token and no kubeconfig: cannot reach the Kubernetes API")


class KubeClient(Protocol):
    """What the reconcile and the loops call; Kube implements it, and unit tests substitute an in-memory API."""

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None: ...

    async def list(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]: ...

    async def apply(self, obj: dict[str, Any], *, subresource: str | None = None,
                    manager: str = FIELD_MANAGER) -> dict[str, Any]: ...

    async def delete(self, kind: str, namespace: str, name: str, *, uid: str | None = None) -> bool: ...

    async def close(self) -> None: ...


class Kube:
    """Server-side apply, get, list, delete and status writes; one shared aiohttp session, re-login on 401."""

    def __init__(self, login: Callable[[], kopf.ConnectionInfo], timeout: float = 30.0) -> None:
        self._login = login
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._server = ""
        self._swap = asyncio.Lock()
        self._closers: set[asyncio.Task[None]] = set()

    def _connect(self) -> aiohttp.ClientSession:
        info = self._login()
        self._server = info.server.rstrip("/")
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=info.as_ssl_context()), timeout=self._timeout,
            headers={**info.as_http_headers(), "User-Agent": FIELD_MANAGER}, trust_env=info.trust_env)

    async def _current(self, stale: aiohttp.ClientSession | None = None) -> aiohttp.ClientSession:
        """The shared session; with `stale` (one that got a 401), a fresh login replaces it unless another
        request already did. The old session is closed only after its in-flight requests had time to end:
        closing it now would fail every concurrent reconcile and scrape that still uses it."""
        async with self._swap:
            if self._session is None or (stale is not None and self._session is stale):
                old, self._session = self._session, self._connect()
                if old is not None:
                    task = asyncio.create_task(self._close_later(old))
                    self._closers.add(task)
                    task.add_done_callback(self._closers.discard)
            return self._session

    async def _close_later(self, session: aiohttp.ClientSession) -> None:
        try:
            await asyncio.sleep((self._timeout.total or 30.0) + 1)  # past every request's own deadline
        finally:
            await session.close()

    async def close(self) -> None:
        """Close the session and any retired ones now (operator shutdown)."""
        for task in list(self._closers):
            task.cancel()  # its finally clause closes the retired session
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(self, method: str, url: str, *, body: Any = None, content_type: str = "application/json",
                      params: dict[str, str] | None = None) -> Any:
        """One API call; JSON in and out. Logs in again once on 401 (rotated service-account tokens)."""
        data = None if body is None else json.dumps(body)
        session = await self._current()
        for attempt in (0, 1):
            async with session.request(method, self._server + url, data=data, params=params,
                                       headers={"Content-Type": content_type}) as resp:
                text = await resp.text()
                if resp.status == 401 and attempt == 0:
                    session = await self._current(stale=session)
                    continue
                if resp.status >= 400:
                    try:
                        st = json.loads(text)
                        raise ApiError(resp.status, st.get("reason", ""), st.get("message", text))
                    except (ValueError, AttributeError):
                        raise ApiError(resp.status, resp.reason or "", text) from None
                return json.loads(text) if text else None
        raise AssertionError("unreachable")

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            out: dict[str, Any] = await self.request("GET", path(kind, namespace, name))
            return out
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def list(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        """Objects of a kind in a namespace ("": in every namespace) that match a label selector."""
        out = await self.request("GET", path(kind, namespace), params={"labelSelector": label_selector})
        return list(out.get("items") or [])

    async def apply(self, obj: dict[str, Any], *, subresource: str | None = None,
                    manager: str = FIELD_MANAGER) -> dict[str, Any]:
        """Server-side apply with force=true, on objects (or status fields) this operator controls.

        Force only takes over the fields listed in `obj`: fields we never apply stay with whoever set them (a
        `kubectl rollout restart` annotation, defaulted fields, another controller's labels). For the fields we
        do apply, the InferenceDeployment is the source of truth, so a hand edit or a stale manager is
        overridden rather than fought over. That includes the Deployment's replicas in every mode: with
        `external` an HPA or KEDA must target the InferenceDeployment's scale subresource, never the Deployment
        (one that did would be reverted on every reconcile). Callers check ownership first (see ownership.py):
        force must never adopt an object someone else created. A writer of only some status fields (the
        autoscaler) passes its own `manager`, so neither write removes the other's fields."""
        meta = obj["metadata"]
        url = path(obj["kind"], meta["namespace"], meta["name"], subresource)
        out: dict[str, Any] = await self.request(
            "PATCH", url, body=obj, content_type="application/apply-patch+yaml",  # JSON is valid YAML
            params={"fieldManager": manager, "force": "true"})
        return out

    async def delete(self, kind: str, namespace: str, name: str, *, uid: str | None = None) -> bool:
        """Delete if present (background propagation); False when there was nothing to delete. With `uid`, only
        that very object (a precondition: a namesake created since our read is left alone, with a 409)."""
        options: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        if uid is not None:
            options["preconditions"] = {"uid": uid}
        try:
            await self.request("DELETE", path(kind, namespace, name), body=options)
            return True
        except ApiError as e:
            if e.status == 404:
                return False
            raise
