"""kube.Kube against a loopback HTTP server standing in for the apiserver: paths, apply parameters, errors."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import kopf
import pytest
from aiohttp import web

from kvfleet_operator.kube import FIELD_MANAGER, ApiError, Kube, path

Handler = Callable[[web.Request], Awaitable[web.Response]]


def run_against(handler: Handler, body: Callable[[Kube], Awaitable[Any]], tokens: list[str] | None = None) -> Any:
    """Start a server answering every request with `handler`, run `body` with a client pointed at it."""
    tokens = tokens if tokens is not None else ["t"]

    async def main() -> Any:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        logins = iter(tokens)
        kube = Kube(lambda: kopf.ConnectionInfo(server=f"http://127.0.0.1:{port}", token=next(logins)))
        try:
            return await body(kube)
        finally:
            await kube.close()
            await runner.cleanup()

    return asyncio.run(main())


def status(code: int, reason: str, message: str) -> web.Response:
    return web.json_response({"kind": "Status", "reason": reason, "message": message}, status=code)


def test_paths() -> None:
    assert path("Deployment", "ns", "d") == "/apis/apps/v1/namespaces/ns/deployments/d"
    assert path("InferenceDeployment", "ns", "x", "status") == (
        "/apis/serving.kvfleet.dev/v1alpha1/namespaces/ns/inferencedeployments/x/status")
    assert path("PodDisruptionBudget", "ns") == "/apis/policy/v1/namespaces/ns/poddisruptionbudgets"
    assert path("ClusterKopfPeering", "") == "/apis/kopf.dev/v1/clusterkopfpeerings"  # cluster-scoped


def test_apply_is_server_side_apply_with_our_field_manager() -> None:
    seen: list[dict[str, Any]] = []

    async def handler(r: web.Request) -> web.Response:
        seen.append({"method": r.method, "path": r.path, "query": dict(r.query), "ct": r.content_type,
                     "auth": r.headers.get("Authorization"), "body": json.loads(await r.text())})
        return web.json_response({"applied": True})

    obj = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s", "namespace": "ns"}}
    assert run_against(handler, lambda k: k.apply(obj)) == {"applied": True}
    assert seen == [{"method": "PATCH", "path": "/api/v1/namespaces/ns/services/s",
                     "ct": "application/apply-patch+yaml", "query": {"fieldManager": FIELD_MANAGER, "force": "true"},
                     "auth": "Bearer t", "body": obj}]


def test_get_returns_none_on_404_and_raises_other_errors() -> None:
    async def handler(r: web.Request) -> web.Response:
        if r.path.endswith("/missing"):
            return status(404, "NotFound", "not found")
        return status(500, "InternalError", "etcd is sad")

    assert run_against(handler, lambda k: k.get("Deployment", "ns", "missing")) is None
    with pytest.raises(ApiError) as e:
        run_against(handler, lambda k: k.get("Deployment", "ns", "other"))
    assert (e.value.status, e.value.reason, e.value.permanent) == (500, "InternalError", False)


def test_apply_errors_carry_the_apiserver_message() -> None:
    async def handler(r: web.Request) -> web.Response:
        return status(422, "Invalid", 'Deployment.apps "x" is invalid: spec.template.spec.nodeSelector: bad')

    obj = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x", "namespace": "ns"}}
    with pytest.raises(ApiError, match="nodeSelector: bad") as e:
        run_against(handler, lambda k: k.apply(obj))
    assert e.value.permanent


def test_relogin_once_on_401() -> None:
    async def handler(r: web.Request) -> web.Response:
        if r.headers.get("Authorization") == "Bearer old":
            return status(401, "Unauthorized", "token expired")
        return web.json_response({"items": [{"metadata": {"name": "p"}}]})

    items = run_against(handler, lambda k: k.list("Pod", "ns", "a=b"), tokens=["old", "new"])
    assert items == [{"metadata": {"name": "p"}}]


@pytest.mark.parametrize(("code", "permanent"), [(400, True), (422, True), (401, False), (403, False),
                                                 (404, False), (409, False), (429, False), (500, False)])
def test_only_a_wrong_request_is_permanent(code: int, permanent: bool) -> None:
    # 403 while a new RoleBinding propagates, 404/409 around a terminating namespace: they heal by themselves.
    assert ApiError(code, "x", "y").permanent is permanent


def test_relogin_does_not_break_requests_in_flight_on_the_old_session() -> None:
    slow_arrived, relogged = asyncio.Event(), asyncio.Event()

    async def handler(r: web.Request) -> web.Response:
        if r.headers.get("Authorization") == "Bearer new":
            relogged.set()
            return web.json_response({"ok": r.path})
        if r.path.endswith("/slow"):
            slow_arrived.set()
            await relogged.wait()  # still running when the other request's 401 swaps the session
            return web.json_response({"ok": r.path})
        return status(401, "Unauthorized", "token expired")

    async def body(k: Kube) -> list[Any]:
        slow = asyncio.create_task(k.get("Deployment", "ns", "slow"))
        await slow_arrived.wait()  # the slow request is in flight on the old session
        fast = await k.get("Deployment", "ns", "fast")
        return [await slow, fast]

    # Before, the 401 closed the shared session under the slow request, which then failed.
    slow, fast = run_against(handler, body, tokens=["old", "new"])
    assert slow == {"ok": "/apis/apps/v1/namespaces/ns/deployments/slow"}
    assert fast == {"ok": "/apis/apps/v1/namespaces/ns/deployments/fast"}


def test_concurrent_401s_log_in_once() -> None:
    async def handler(r: web.Request) -> web.Response:
        if r.headers.get("Authorization") == "Bearer old":
            await asyncio.sleep(0.05)
            return status(401, "Unauthorized", "token expired")
        return web.json_response({})

    async def body(k: Kube) -> list[Any]:
        return list(await asyncio.gather(*(k.get("Pod", "ns", f"p{i}") for i in range(5))))

    assert run_against(handler, body, tokens=["old", "new"]) == [{}] * 5  # a third login would raise StopIteration


def test_delete_with_a_uid_precondition() -> None:
    seen: list[Any] = []

    async def handler(r: web.Request) -> web.Response:
        seen.append(json.loads(await r.text()))
        return web.json_response({})

    assert run_against(handler, lambda k: k.delete("ConfigMap", "ns", "m-args", uid="abc")) is True
    assert seen[0]["preconditions"] == {"uid": "abc"} and seen[0]["propagationPolicy"] == "Background"


def test_delete_tolerates_absence() -> None:
    async def handler(r: web.Request) -> web.Response:
        assert r.method == "DELETE"
        return status(404, "NotFound", "gone") if r.path.endswith("/gone") else web.json_response({})

    assert run_against(handler, lambda k: k.delete("ConfigMap", "ns", "gone")) is False
    assert run_against(handler, lambda k: k.delete("ConfigMap", "ns", "here")) is True
