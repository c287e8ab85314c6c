"""Kubernetes discovery: which pods serve which model (pure), the watch caches keeping a Fleet current at each event,
and the router in front of it (readiness until synced, held requests under their InferenceDeployments, 404 when
the model goes). The list-watch against a real apiserver is in e2e/test_router_discovery.py."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kvfleet_contract import metrics as contract
from kvfleet_router import kube
from kvfleet_router.discovery import MANAGED_BY_LABEL, MANAGER, OWNER_LABEL, Discovery, pod_ready, served
from kvfleet_router.fleet import Fleet
from kvfleet_router.hold_queue import HoldQueue
from kvfleet_router.kube import KubeClient, KubeConfig, list_watch
from kvfleet_router.proxy import serve, wire


def idp(name: str, model: str = "llama", namespace: str = "ns") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": namespace}, "spec": {"model": {"name": model}}}


def pod(name: str, owner: str, ip: str | None = "10.0.0.1", phase: str = "Running", ready: str | None = "True",
        namespace: str = "ns", managed: str = MANAGER, deleting: bool = False,
        port: int | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": {OWNER_LABEL: owner,
                                                                              MANAGED_BY_LABEL: managed}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {"phase": phase, "conditions": [{"type": "PodScheduled", "status": "True"}]}
    if ready is not None:
        status["conditions"].append({"type": "Ready", "status": ready})
    if ip is not None:
        status["podIP"] = ip
    spec = {"containers": [{"name": "agent", "ports": [{"name": "http", "containerPort": port}]}]} if port else {}
    return {"metadata": meta, "spec": spec, "status": status}


@pytest.mark.parametrize(("variant", "counts"), [
    ({}, True),
    ({"phase": "Pending"}, False),
    ({"phase": "Succeeded"}, False),
    ({"phase": "Failed"}, False),
    ({"phase": "Unknown"}, False),
    ({"ready": "False"}, False),
    ({"ready": "Unknown"}, False),
    ({"ready": None}, False),  # no Ready condition yet
    ({"ip": None}, False),
    ({"ip": ""}, False),
    ({"deleting": True}, False),  # terminating: out at once, though its agent still drains
    ({"managed": "someone-else"}, False),  # a pod wearing our owner label is not ours without managed-by
])
def test_only_running_ready_pods_with_an_ip_and_not_terminating_count(variant: dict[str, Any], counts: bool) -> None:
    p = pod("a-1", "a", **variant)
    got = served([idp("a")], [p])
    assert got["llama"].endpoints == ({"ns/a-1": "http://10.0.0.1:8000"} if counts else {})
    assert got["llama"].deployments == (("ns", "a"),)  # known either way: requests are held, not refused


def test_a_model_with_no_pods_is_known_and_an_unknown_one_is_absent() -> None:
    assert served([idp("a", "m")], []) == {"m": served([idp("a", "m")], [])["m"]}
    assert served([idp("a", "m")], [])["m"].endpoints == {}
    assert served([], [pod("x-1", "x")]) == {}  # pods of no InferenceDeployment serve nothing


def test_the_port_named_http_and_ipv6_addresses() -> None:
    got = served([idp("a")], [pod("a-1", "a", port=9000), pod("a-2", "a", ip="fd00::7")])["llama"].endpoints
    assert got == {"ns/a-1": "http://10.0.0.1:9000", "ns/a-2": "http://[fd00::7]:8000"}


def test_a_relabelled_pod_follows_its_label() -> None:
    idps = [idp("a", "m1"), idp("b", "m2")]
    p = pod("a-1", "a")
    assert list(served(idps, [p])["m1"].endpoints) == ["ns/a-1"]
    p["metadata"]["labels"][OWNER_LABEL] = "b"  # moved to another InferenceDeployment
    got = served(idps, [p])
    assert got["m1"].endpoints == {} and list(got["m2"].endpoints) == ["ns/a-1"]
    del p["metadata"]["labels"][OWNER_LABEL]  # taken out of service (e.g. kept for debugging)
    assert all(s.endpoints == {} for s in served(idps, [p]).values())


def test_two_inference_deployments_with_one_model_name_merge_their_replicas() -> None:
    idps = [idp("blue", "m"), idp("green", "m"), idp("green", "m", namespace="other")]
    pods = [pod("blue-1", "blue", ip="10.0.0.1"), pod("green-1", "green", ip="10.0.0.2"),
            pod("green-1", "green", ip="10.0.1.2", namespace="other"), pod("green-2", "green", ready="False")]
    got = served(idps, pods)
    assert got["m"].endpoints == {"ns/blue-1": "http://10.0.0.1:8000", "ns/green-1": "http://10.0.0.2:8000",
                                  "other/green-1": "http://10.0.1.2:8000"}  # same pod name, two namespaces
    assert got["m"].deployments == (("ns", "blue"), ("ns", "green"), ("other", "green"))


def test_namespaces_outside_the_watch_are_ignored() -> None:
    idps = [idp("a", "m"), idp("b", "n", namespace="elsewhere")]
    pods = [pod("a-1", "a"), pod("b-1", "b", namespace="elsewhere"),
            pod("a-9", "a", namespace="elsewhere")]  # its owner label names an InferenceDeployment of another ns
    got = served(idps, pods, namespaces={"ns"})
    assert list(got) == ["m"] and list(got["m"].endpoints) == ["ns/a-1"]
    assert list(served(idps, pods)["m"].endpoints) == ["ns/a-1"]  # a pod counts only in its own namespace


@given(st.lists(st.fixed_dictionaries({
    "phase": st.sampled_from(["Pending", "Running", "Succeeded", "Failed"]),
    "ready": st.sampled_from(["True", "False", None]), "ip": st.sampled_from(["10.0.0.1", None]),
    "deleting": st.booleans(), "owner": st.sampled_from(["a", "b", "gone"])}), max_size=12))
def test_every_endpoint_is_a_ready_pod_of_a_known_deployment_whatever_the_order(specs: list[dict[str, Any]]) -> None:
    pods = [pod(f"p-{i}", **s) for i, s in enumerate(specs)]
    got = served([idp("a", "m"), idp("b", "m")], pods)
    expected = {f"ns/{p['metadata']['name']}" for p, s in zip(pods, specs, strict=True)
                if s["owner"] != "gone" and pod_ready(p)}
    assert set(got["m"].endpoints) == expected
    assert served([idp("b", "m"), idp("a", "m")], list(reversed(pods))) == got


def discovery(fleet: Fleet, *namespaces: str) -> Discovery:
    """A Discovery whose caches the test feeds as the watches would (its client is never used here)."""
    return Discovery(fleet, KubeClient(KubeConfig("https://unused", ssl.create_default_context(), "test")),
                     namespaces)


def test_each_watch_event_updates_the_fleet_at_once() -> None:
    released: list[str] = []
    gone: list[str] = []
    fleet = Fleet(on_ready=released.append, on_gone=gone.append, synced=False)
    d = discovery(fleet, "ns", "two")
    d.deployments["ns"].replace([idp("a", "m")])
    d.pods["ns"].replace([])
    assert fleet.models == {"m": {}} and fleet.deployments["m"] == (("ns", "a"),)
    assert not fleet.synced  # namespace "two" has not been listed yet
    d.deployments["two"].replace([])
    d.pods["two"].replace([])
    assert fleet.synced

    starting = pod("a-1", "a", ready="False")
    d.pods["ns"].apply("ADDED", starting)
    assert fleet.ready("m") == [] and released == []
    ready = copy.deepcopy(starting)
    ready["status"]["conditions"][1]["status"] = "True"
    d.pods["ns"].apply("MODIFIED", ready)
    assert [r.name for r in fleet.ready("m")] == ["ns/a-1"] and released == ["m"]  # held requests go now
    d.pods["ns"].apply("MODIFIED", starting)  # unready again: out on this event, no scrape needed
    assert fleet.models["m"] == {}
    d.pods["ns"].apply("MODIFIED", ready)
    assert released == ["m", "m"]
    d.pods["ns"].apply("DELETED", ready)
    assert fleet.models["m"] == {}
    d.deployments["ns"].apply("DELETED", idp("a", "m"))
    assert fleet.models == {} and gone == ["m"]


def test_a_re_list_replaces_what_the_watch_had() -> None:
    fleet = Fleet()
    d = discovery(fleet, "ns")
    d.deployments["ns"].replace([idp("a", "m"), idp("b", "n")])
    d.pods["ns"].replace([pod("a-1", "a"), pod("b-1", "b")])
    assert sorted(fleet.models) == ["m", "n"]
    d.deployments["ns"].replace([idp("a", "m")])  # after a 410: "b" was deleted while we were not watching
    d.pods["ns"].replace([pod("a-2", "a")])
    assert list(fleet.models) == ["m"] and [r.name for r in fleet.ready("m")] == ["ns/a-2"]


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with session.get(url) as r:
        return r.status, await r.text()


def held_samples(text: str) -> dict[tuple[str, str, str], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == contract.ROUTER_HELD_REQUESTS:
            for s in family.samples:
                out[(s.labels[contract.MODEL_LABEL], s.labels[contract.NAMESPACE_LABEL],
                     s.labels[contract.DEPLOYMENT_LABEL])] = s.value
    return out


def run_router(test: Callable[[str, Fleet, Discovery, aiohttp.ClientSession], Awaitable[None]]) -> None:
    """A router on a free port over a Fleet fed by a Discovery's caches; run `test` against it."""
    async def main() -> None:
        fleet = Fleet(synced=False)
        holds = HoldQueue(8, 60.0)
        runner, port, scraper = await serve(wire(fleet, holds), "127.0.0.1", 0, 3600.0)
        d = discovery(fleet, "ns")
        try:
            async with aiohttp.ClientSession() as session:
                await test(f"http://127.0.0.1:{port}", fleet, d, session)
        finally:
            scraper.cancel()
            await runner.cleanup()

    asyncio.run(main())


def test_ready_is_503_until_every_watch_listed_and_health_is_always_200() -> None:
    async def test(url: str, fleet: Fleet, d: Discovery, session: aiohttp.ClientSession) -> None:
        assert (await _get(session, f"{url}/ready"))[0] == 503
        assert (await _get(session, f"{url}/health"))[0] == 200
        d.deployments["ns"].replace([])
        assert (await _get(session, f"{url}/ready"))[0] == 503
        d.pods["ns"].replace([])
        assert (await _get(session, f"{url}/ready"))[0] == 200

    run_router(test)


def test_held_requests_are_counted_under_each_deployment_and_answered_404_when_the_model_goes() -> None:
    async def test(url: str, fleet: Fleet, d: Discovery, session: aiohttp.ClientSession) -> None:
        d.deployments["ns"].replace([idp("blue", "m"), idp("green", "m"), idp("solo", "s")])
        d.pods["ns"].replace([])
        status, text = await _get(session, f"{url}/metrics")
        assert held_samples(text) == {("m", "ns", "blue"): 0.0, ("m", "ns", "green"): 0.0, ("s", "ns", "solo"): 0.0}

        async def post(model: str) -> tuple[int, str]:
            async with session.post(f"{url}/v1/completions", json={"model": model, "prompt": "x"}) as r:
                return r.status, await r.text()

        assert (await post("unknown"))[0] == 404  # an unknown model is refused, not held
        waiting = [asyncio.create_task(post("m")) for _ in range(2)]
        await _wait_held(session, url, ("m", "ns", "blue"), 2.0)
        _, text = await _get(session, f"{url}/metrics")
        assert held_samples(text)[("m", "ns", "green")] == 2.0  # the full demand under each: either may scale
        d.deployments["ns"].apply("DELETED", idp("blue", "m"))
        d.deployments["ns"].apply("DELETED", idp("green", "m"))
        for status, text in await asyncio.gather(*waiting):
            assert status == 404 and "no longer served" in text
        _, text = await _get(session, f"{url}/metrics")
        assert held_samples(text) == {("s", "ns", "solo"): 0.0}

    run_router(test)


async def _wait_held(session: aiohttp.ClientSession, url: str, key: tuple[str, str, str], value: float) -> None:
    """Scrape until the gauge shows `value` (each scrape lets the posted requests reach the hold queue)."""
    for _ in range(1_000):
        _, text = await _get(session, f"{url}/metrics")
        if held_samples(text).get(key) == value:
            return
    raise AssertionError(f"{key} never reached {value}")


class Recorder:
    """A list-watch store that records what it is told and wakes the test on the event it waits for."""

    def __init__(self, until: tuple[str, str]) -> None:
        self.seen: list[tuple[str, str]] = []
        self.until, self.done = until, asyncio.Event()

    def replace(self, items: list[dict[str, Any]]) -> None:
        self.seen.append(("LIST", ",".join(o["metadata"]["name"] for o in items)))

    def apply(self, kind: str, obj: dict[str, Any]) -> None:
        self.seen.append((kind, obj["metadata"]["name"]))
        if self.seen[-1] == self.until:
            self.done.set()


def test_list_watch_resumes_at_bookmarks_relists_on_410_and_logs_a_403_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The apiserver's wire behaviour that the local control plane cannot be made to show on demand (its watch cache
    serves old versions instead of 410 Gone), replayed by a scripted server: a list, a watch that ends after a
    bookmark, an ERROR event with 410, a re-list, two 403s, then a watch that delivers. The rest runs against the
    real apiserver in e2e/test_router_discovery.py."""
    monkeypatch.setattr(kube, "BACKOFF_S", (0.001, 0.002))
    lists = [{"metadata": {"resourceVersion": "10"}, "items": [{"metadata": {"name": "a"}}]},
             {"metadata": {"resourceVersion": "20"}, "items": [{"metadata": {"name": "c"}}]}]
    watches: list[str] = []

    def event(kind: str, name: str, version: str) -> bytes:
        return json.dumps({"type": kind, "object": {"metadata": {"name": name, "resourceVersion": version}}}).encode()

    async def pods(request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") != "1":
            return web.json_response(lists.pop(0))
        watches.append(request.query["resourceVersion"])
        assert request.query["allowWatchBookmarks"] == "true" and request.query["labelSelector"] == "app=x"
        if len(watches) in (3, 4):
            return web.json_response({"kind": "Status", "code": 403, "message": "pods is forbidden"}, status=403)
        resp = web.StreamResponse()
        await resp.prepare(request)
        gone = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old resource version: 15 (18)"}
        script = {1: [event("ADDED", "b", "11"), event("BOOKMARK", "", "15")],
                  2: [json.dumps({"type": "ERROR", "object": gone}).encode()],
                  5: [event("DELETED", "c", "21")]}[len(watches)]
        for line in script:
            await resp.write(line + b"\n")
        if len(watches) == 5:
            await asyncio.Event().wait()  # a watch that stays open, until the client leaves
        return resp  # the server's own timeout ends the first watch (resumed at once), the ERROR the second

    async def main() -> Recorder:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/ns/pods", pods)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        store = Recorder(until=("DELETED", "c"))
        try:
            config = KubeConfig(f"http://127.0.0.1:{port}", ssl.create_default_context(), "test", token="t")
            async with KubeClient(config) as client:
                task = asyncio.create_task(list_watch(client, "/api/v1/namespaces/ns/pods", "app=x", store, "pods"))
                await asyncio.wait_for(store.done.wait(), 30)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        finally:
            await runner.cleanup()
        return store

    with caplog.at_level(logging.DEBUG, logger="kvfleet_router.kube"):
        store = asyncio.run(main())
    assert store.seen == [("LIST", "a"), ("ADDED", "b"), ("LIST", "c"), ("DELETED", "c")]  # no bookmark, no ERROR
    assert watches == ["10", "15", "20", "20", "20"]  # resumed at the bookmark; after the re-list at its version
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "403: pods is forbidden" in warnings[0], caplog.text  # once, not per attempt
    assert "pods: still failing (403" in caplog.text and "pods: working again" in caplog.text
    assert "resourceVersion 15 expired (410 Gone), listing again" in caplog.text
