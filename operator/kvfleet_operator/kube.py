"""The only module that calls the Kubernetes API: a small aiohttp client on kopf's login credentials."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import aiohttp
import kopf

from kvfleet_operator.models import GROUP, KIND, PLURAL, VERSION

log = logging.getLogger(__name__)
FIELD_MANAGER = "kvfleet-operator"
# kind → (API path prefix, plural) for every kind the operator reads or writes.
_KINDS: dict[str, tuple[str, str]] = {
    "Deployment": ("/apis/apps/v1", "deployments"),
    "Service": ("/api/v1", "services"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "Pod": ("/api/v1", "pods"),
    KIND: (f"/apis/{GROUP}/{VERSION}", PLURAL),
}


class ApiError(Exception):
    """A non-2xx answer of the apiserver, with its Status reason and message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message

    @property
    def permanent(self) -> bool:
        """Retrying the same request cannot help (bad request, invalid, forbidden); the input must change."""
        return self.status in (400, 403, 404, 405, 415, 422)


def path(kind: str, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    """The REST path of a namespaced object, or of its collection when name is None."""
    prefix, plural = _KINDS[kind]
    out = f"{prefix}/namespaces/{namespace}/{plural}"
    return out + (f"/{name}" if name else "") + (f"/{subresource}" if subresource else "")


def default_login(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    """The credentials kopf's own default login would pick: the pod's service account, else the kubeconfig."""
    for login in (kopf.login_with_service_account, kopf.login_with_kubeconfig):
        info = login(settings=settings, logger=log)
        if info is not None:
            return info
    raise kopf.LoginError("no service account token and no kubeconfig: cannot reach the Kubernetes API")


class Kube:
    """Server-side apply, get, list, delete and status writes; one aiohttp session, re-login on 401."""

    def __init__(self, login: Callable[[], kopf.ConnectionInfo], timeout: float = 30.0) -> None:
        self._login = login
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._server = ""

    def _connect(self) -> aiohttp.ClientSession:
        info = self._login()
        self._server = info.server.rstrip("/")
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=info.as_ssl_context()), timeout=self._timeout,
            headers={**info.as_http_headers(), "User-Agent": FIELD_MANAGER}, trust_env=info.trust_env)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(self, method: str, url: str, *, body: Any = None, content_type: str = "application/json",
                      params: dict[str, str] | None = None) -> Any:
        """One API call; JSON in and out. Re-reads the credentials once on 401 (rotated service-account tokens)."""
        data = None if body is None else json.dumps(body)
        for attempt in (0, 1):
            if self._session is None:
                self._session = self._connect()
            async with self._session.request(method, self._server + url, data=data, params=params,
                                             headers={"Content-Type": content_type}) as resp:
                text = await resp.text()
                if resp.status == 401 and attempt == 0:
                    await self.close()
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
        """Objects of a kind in a namespace that match a label selector."""
        out = await self.request("GET", path(kind, namespace), params={"labelSelector": label_selector})
        return list(out.get("items") or [])

    async def apply(self, obj: dict[str, Any], *, subresource: str | None = None,
                    manager: str = FIELD_MANAGER) -> dict[str, Any]:
        """Server-side apply. force=true: these objects (or status fields) are the operator's own, so a
        conflicting manager (a hand edit, `kubectl scale`) is overridden rather than fought over. A writer of
        only some status fields (the autoscaler) passes its own `manager`, so neither removes the other's."""
        meta = obj["metadata"]
        url = path(obj["kind"], meta["namespace"], meta["name"], subresource)
        out: dict[str, Any] = await self.request(
            "PATCH", url, body=obj, content_type="application/apply-patch+yaml",  # JSON is valid YAML
            params={"fieldManager": manager, "force": "true"})
        return out

    async def delete(self, kind: str, namespace: str, name: str) -> bool:
        """Delete if present (background propagation); False when there was nothing to delete."""
        try:
            await self.request("DELETE", path(kind, namespace, name),
                               body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"})
            return True
        except ApiError as e:
            if e.status == 404:
                return False
            raise
