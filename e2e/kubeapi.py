"""A small asyncio Kubernetes API client for the process kubelet: list, watch, patch status, delete."""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp


class ApiStatusError(Exception):
    """An HTTP error from the API server, with its status code and body."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


class KubeApi:
    """Talks to one API server with a client certificate (the cluster's PKI)."""

    def __init__(self, server: str, ca: Path, cert: Path, key: Path) -> None:
        self.server = server.rstrip("/")
        self._ssl = ssl.create_default_context(cafile=str(ca))
        self._ssl.load_cert_chain(str(cert), str(key))
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> KubeApi:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self._ssl))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "use KubeApi as an async context manager"
        return self._session

    async def request(self, method: str, path: str, body: Any = None,
                      content_type: str = "application/json") -> dict[str, Any]:
        """One JSON request; raises ApiStatusError on an HTTP error status."""
        data = json.dumps(body) if body is not None else None
        headers = {"Accept": "application/json", "Content-Type": content_type}
        async with self.session.request(method, self.server + path, data=data, headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=30)) as resp:
            text = await resp.text()
            if resp.status >= 400:
                raise ApiStatusError(resp.status, text)
            result: dict[str, Any] = json.loads(text) if text else {}
            return result

    async def watch(self, path: str, resource_version: str) -> AsyncIterator[dict[str, Any]]:
        """Watch events ({type, object}) from resource_version until the server ends the stream."""
        sep = "&" if "?" in path else "?"
        # The server ends the watch after timeoutSeconds; a read timeout above that catches a half-open connection.
        url = (f"{self.server}{path}{sep}watch=1&allowWatchBookmarks=true&timeoutSeconds=300"
               f"&resourceVersion={resource_version}")
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=330)
        async with self.session.get(url, timeout=timeout) as resp:
            if resp.status >= 400:
                raise ApiStatusError(resp.status, await resp.text())
            async for line in resp.content:
                if line.strip():
                    yield json.loads(line)

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Merge-patch a pod's status subresource (lists such as conditions are replaced whole)."""
        await self.request("PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}/status", {"status": status},
                           content_type="application/merge-patch+json")

    async def delete_pod_now(self, namespace: str, name: str, uid: str) -> None:
        """Finish a pod's deletion (grace 0), as a kubelet does once its containers stopped; only that uid."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0, "preconditions": {"uid": uid}}
        try:
            await self.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}", body)
        except ApiStatusError as exc:
            if exc.status not in (404, 409):  # already gone, or a new pod with the same name
                raise
