"""The kopf handlers: kopf's retry policy and events, Deployment events, the state's loops follow the object, and
no handler makes kopf put a finalizer on an InferenceDeployment."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from typing import Any

import aiohttp
import kopf
import pytest
from cr_helpers import SPEC, children, conds, cr, foreign, memo, state, with_cr
from fake_kube import FakeKube

from kvfleet_operator import handlers, metrics
from kvfleet_operator.kube import ApiError
from kvfleet_operator.state import OperatorState, Tracked

BUILTIN = {**SPEC, "autoscaling": {"mode": "builtin", "minReplicas": 1, "maxReplicas": 3,
                                   "targets": {"queueDepthPerReplica": 4}}}


def test_no_handler_of_ours_puts_a_finalizer_on_our_resources() -> None:
    # kopf adds its finalizer for a daemon, a timer or a deletion handler that is not optional: watch those
    # public decorators while the handlers register, in a fresh interpreter (here they are registered already).
    code = """
import json, kopf
seen = []
def spy(what, real):
    def wrapper(*args, **kwargs):
        seen.append([what, bool(kwargs.get("optional"))])
        return real(*args, **kwargs)
    return wrapper
for module in (kopf, kopf.on):
    module.daemon, module.timer = spy("daemon", kopf.on.daemon), spy("timer", kopf.on.timer)
kopf.on.delete = spy("delete", kopf.on.delete)
import kvfleet_operator.handlers
print(json.dumps(seen))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    # One optional deletion handler (InferenceDeployment; an InferenceRouter's deletion is its DELETED watch
    # event, which needs no finalizer at all); no daemon, no timer.
    assert json.loads(p.stdout) == [["delete", True]]


def test_a_recreated_object_waits_for_garbage_collection_of_its_namesakes() -> None:
    kube = with_cr(cr(uid="new"))
    old_owner = {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceDeployment", "name": "m",
                 "uid": "old", "controller": True}
    old = kube.add({**foreign("Deployment", owner=old_owner), "apiVersion": "apps/v1"})
    with pytest.raises(kopf.TemporaryError) as e:  # before: 422 from the apiserver → PermanentError, stuck
        asyncio.run(handlers.run_reconcile("ns", "m", state(kube), "create", uid="new"))
    assert e.value.delay == 5.0 and "garbage collection" in str(e.value)
    assert kube.objects["Deployment", "ns", "m"] == old
    assert conds(kube)["Degraded"] == ("True", "WaitingForGarbageCollection")
    # Garbage collection removes it; its DELETED event names the old owner uid, yet the new CR is reconciled.
    del kube.objects["Deployment", "ns", "m"]
    asyncio.run(handlers.deployment_changed(body=old, type="DELETED", memo=memo(kube),
                                            logger=logging.getLogger("test")))
    dep = kube.objects["Deployment", "ns", "m"]
    assert dep["metadata"]["ownerReferences"][0]["uid"] == "new" and conds(kube)["Degraded"][0] == "False"


@pytest.mark.parametrize(("error", "expected"), [(ApiError(422, "Invalid", "x"), kopf.PermanentError),
                                                 (ApiError(400, "BadRequest", "x"), kopf.PermanentError),
                                                 (ApiError(403, "Forbidden", "x"), kopf.TemporaryError),
                                                 (ApiError(404, "NotFound", "x"), kopf.TemporaryError),
                                                 (ApiError(409, "Conflict", "x"), kopf.TemporaryError),
                                                 (ApiError(503, "ServiceUnavailable", "x"), kopf.TemporaryError)])
def test_api_errors_map_to_kopf_retry_policy(error: ApiError, expected: type[Exception]) -> None:
    kube = with_cr()
    kube.fail["Deployment"] = error
    with pytest.raises(expected):
        asyncio.run(handlers.run_reconcile("ns", "m", state(kube), "update"))


@pytest.mark.parametrize("error", [aiohttp.ClientConnectionError("connection reset"), TimeoutError(),
                                   aiohttp.ServerDisconnectedError(), aiohttp.ClientPayloadError()])
def test_network_failures_are_retried_with_backoff(error: BaseException) -> None:
    kube = with_cr()
    kube.broken = error  # before: these escaped the handler as unknown errors
    with pytest.raises(kopf.TemporaryError) as e:
        asyncio.run(handlers.run_reconcile("ns", "m", state(kube), "update", retry=3))
    assert e.value.delay == 40.0  # 5 s doubled per retry


def test_reconcile_handler_posts_events(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[str, str]] = []
    monkeypatch.setattr(kopf, "event", lambda body, *, type, reason, message: events.append((type, reason)))
    kube = with_cr()
    kwargs: dict[str, Any] = {"body": cr(), "name": "m", "namespace": "ns", "uid": "u1", "memo": memo(kube)}
    asyncio.run(handlers.reconcile(reason="create", **kwargs))
    kube.fail["Deployment"] = ApiError(500, "InternalError", "x")
    with pytest.raises(kopf.TemporaryError):
        asyncio.run(handlers.reconcile(reason="update", **kwargs))
    assert events == [("Normal", "Applied"), ("Warning", "ReconcileRetrying")]


def _deployment_event(owner_uid: str = "u1") -> dict[str, Any]:
    return {"metadata": {"name": "m", "namespace": "ns", "ownerReferences": [
        {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceDeployment", "name": "m",
         "uid": owner_uid, "controller": True}]}}


@pytest.mark.parametrize("owner_uid", ["u1", "uid-of-a-deleted-namesake"])
def test_deployment_event_reconciles_the_current_object_of_that_name(owner_uid: str) -> None:
    kube = with_cr()
    asyncio.run(handlers.deployment_changed(body=_deployment_event(owner_uid), type="MODIFIED", memo=memo(kube),
                                            logger=logging.getLogger("test")))
    assert "Deployment" in children(kube) and len(kube.status_writes) == 1


@pytest.mark.parametrize("case", ["initial listing", "not ours", "owner gone"])
def test_deployment_event_leaves_other_objects_alone(case: str) -> None:
    kube = with_cr() if case != "owner gone" else FakeKube()
    body = _deployment_event()
    if case == "not ours":
        body["metadata"]["ownerReferences"][0]["kind"] = "Something"
    asyncio.run(handlers.deployment_changed(body=body, type=None if case == "initial listing" else "DELETED",
                                            memo=memo(kube), logger=logging.getLogger("test")))
    assert children(kube) == [] and not kube.status_writes


def test_the_reconcile_handler_runs_an_autoscaling_loop_exactly_while_builtin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kopf, "event", lambda body, *, type, reason, message: None)

    async def main() -> None:
        kube = with_cr(cr(BUILTIN))
        m = memo(kube)
        s = OperatorState.of(m)
        kwargs: dict[str, Any] = {"name": "m", "namespace": "ns", "uid": "u1", "memo": m}
        await handlers.reconcile(body=cr(BUILTIN), reason="create", **kwargs)
        assert s.objects == {("ns", "m"): Tracked("u1", True)}
        loop = s.autoscalers["u1"]
        await handlers.reconcile(body=cr(BUILTIN), reason="update", **kwargs)
        assert s.autoscalers["u1"] is loop  # one loop per object, not one per handler call
        kube.objects["InferenceDeployment", "ns", "m"]["spec"] = SPEC  # switched off
        await handlers.reconcile(body=cr(SPEC), reason="update", **kwargs)
        assert loop.done() and "u1" not in s.autoscalers and s.objects == {("ns", "m"): Tracked("u1", False)}
        assert "autoscaling" not in kube.objects["InferenceDeployment", "ns", "m"]["status"]
        # Deleted and recreated under the same name: the new object replaces the old in the state at once, even
        # while its reconcile waits for the old children's garbage collection.
        kube.objects["InferenceDeployment", "ns", "m"].update(cr(BUILTIN, uid="u2"))
        with pytest.raises(kopf.TemporaryError, match="garbage collection"):
            await handlers.reconcile(body=cr(BUILTIN, uid="u2"), reason="create", **{**kwargs, "uid": "u2"})
        assert s.objects == {("ns", "m"): Tracked("u2", True)} and set(s.autoscalers) == {"u2"}
        await s.close()

    asyncio.run(main())


def test_the_deletion_handler_forgets_the_object() -> None:
    async def main() -> None:
        kube = with_cr(cr(BUILTIN))
        m = memo(kube)
        s = OperatorState.of(m)
        await s.track("ns", "m", "u1", builtin=True)
        s.reconciled["u1"] = 1.0
        metrics.set_desired("ns", "m", "none", 2)
        await handlers.deleted(namespace="ns", name="m", uid="u1", memo=m)
        assert not s.objects and not s.autoscalers and not s.reconciled and "u1" not in s.memories
        assert metrics.REGISTRY.get_sample_value("kvfleet_operator_desired_replicas",
                                                 {"namespace": "ns", "name": "m", "reason": "none"}) is None

    asyncio.run(main())


def test_startup_starts_the_operator_wide_loop_and_cleanup_ends_every_loop() -> None:
    def names() -> set[str]:
        return {t.get_name() for t in asyncio.all_tasks()}

    async def main() -> None:
        kube = with_cr(cr(BUILTIN))
        m = memo(kube)
        s = OperatorState.of(m)
        await handlers.startup(settings=kopf.OperatorSettings(), memo=m)
        await s.track("ns", "m", "u1", builtin=True)
        assert {"kvfleet resync", "autoscaler ns/m"} <= names()
        await handlers.cleanup(memo=m)
        assert not {"kvfleet resync", "autoscaler ns/m"} & names() and kube.closed and not s.autoscalers

    asyncio.run(main())


def test_handlers_need_the_state_in_the_memo() -> None:
    with pytest.raises(RuntimeError, match="kvfleet-operator"):
        OperatorState.of(kopf.Memo())
