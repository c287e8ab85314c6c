"""Requests held at kvfleet-router pods for InferenceDeployments without a ready replica: demand seen at zero."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvfleet_contract import metrics as contract
from kvfleet_operator.autoscaling.scrape import ParseError
from kvfleet_operator.kube import ApiError, KubeClient

Key = tuple[str, str]  # (namespace, InferenceDeployment name)
ROUTER_SELECTOR: Final = f"app.kubernetes.io/name={contract.ROUTER_APP}"
# KubeClient.list's namespace for a list across every namespace (the API's cluster-wide collection, /api/v1/pods).
ALL_NAMESPACES: Final = ""


def held_requests(exposition_text: str) -> dict[Key, float]:
    """The held-requests gauge of one router's text exposition, by (namespace, inference_deployment), summed over
    models. Samples without an InferenceDeployment (static endpoints: the label empty or absent) are left out.
    Raises ParseError on a body that is not an exposition, or one without the gauge (not a kvfleet-router, or one
    older than the gauge: reading it as "nothing held" could scale a deployment to zero under its demand)."""
    held: dict[Key, float] = {}
    seen = False
    try:
        for fam in text_string_to_metric_families(exposition_text):
            if fam.name != contract.ROUTER_HELD_REQUESTS:
                continue
            seen = True  # the family's TYPE line is there even while no sample is (a labelled gauge never set)
            for s in fam.samples:
                name = s.labels.get(contract.DEPLOYMENT_LABEL, "")
                namespace = s.labels.get(contract.NAMESPACE_LABEL, "")
                if name and namespace:
                    held[namespace, name] = held.get((namespace, name), 0.0) + s.value
    except (ValueError, KeyError, IndexError) as e:  # the parser raises ValueError on any malformed line
        raise ParseError(f"not a Prometheus exposition: {e}") from e
    if not seen:
        raise ParseError(f"missing {contract.ROUTER_HELD_REQUESTS}")
    return held


@dataclass(frozen=True)
class RouterDemand:
    """What the routers hold, summed over those that answered; `reporting` and `errors` name routers as
    namespace/pod (a router that did not answer is skipped: its held requests are unknown)."""

    held: Mapping[Key, float] = field(default_factory=dict)
    reporting: tuple[str, ...] = ()
    errors: Mapping[str, str] = field(default_factory=dict)
    texts: Mapping[str, str] = field(default_factory=dict)  # each reporting router's /metrics body (router_tiers.py)

    def of(self, namespace: str, name: str) -> float:
        """Requests held for one InferenceDeployment at the routers that answered."""
        return self.held.get((namespace, name), 0.0)


def _ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    conds = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    return (not (pod.get("metadata") or {}).get("deletionTimestamp") and status.get("phase") == "Running"
            and conds.get("Ready") == "True" and bool(status.get("podIP")))


def router_targets(pods: Iterable[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(namespace/name, metrics URL) of each ready router pod with an IP, at its container port named `http`,
    else the contract's ROUTER_PORT. A router that is not ready holds nothing a client can reach."""
    out = []
    for pod in pods:
        if not _ready(pod):
            continue
        meta, ip = pod.get("metadata") or {}, pod["status"]["podIP"]
        ports = [p for c in (pod.get("spec") or {}).get("containers") or [] for p in c.get("ports") or []]
        port = next((p.get("containerPort") for p in ports if p.get("name") == "http"), contract.ROUTER_PORT)
        host = f"[{ip}]" if ":" in ip else ip  # IPv6
        out.append((f"{meta.get('namespace', '')}/{meta.get('name', '')}", f"http://{host}:{port}/metrics"))
    return sorted(out)


async def scrape_routers(targets: Sequence[tuple[str, str]], *, timeout: float = 2.0) -> RouterDemand:
    """GET every (name, url) concurrently; a slow, failing or garbled router becomes an error entry, never an
    exception."""
    held: dict[Key, float] = {}
    reporting: list[str] = []
    errors: dict[str, str] = {}
    texts: dict[str, str] = {}

    async def one(session: aiohttp.ClientSession, name: str, url: str) -> None:
        try:
            async with session.get(url) as resp:
                if resp.status != 200:
                    errors[name] = f"HTTP {resp.status}"
                    return
                body = await resp.text(errors="replace")
            for key, n in held_requests(body).items():
                held[key] = held.get(key, 0.0) + n
            reporting.append(name)
            texts[name] = body
        except TimeoutError:  # asyncio.TimeoutError is TimeoutError from 3.11
            errors[name] = f"timeout after {timeout:g}s"
        except ParseError as e:
            errors[name] = f"parse: {e}"
        except aiohttp.ClientError as e:
            errors[name] = f"{type(e).__name__}: {e}"

    if targets:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            await asyncio.gather(*(one(session, name, url) for name, url in targets))
    return RouterDemand(held, tuple(sorted(reporting)), dict(sorted(errors.items())), dict(sorted(texts.items())))


async def router_demand(kube: KubeClient, namespaces: Iterable[str] | None, *, timeout: float = 2.0) -> RouterDemand:
    """List the router pods (label app.kubernetes.io/name=kvfleet-router) in each namespace, or in every one
    (None: one cluster-wide list), and scrape the ready ones. A namespace that cannot be listed becomes an error
    entry (`namespace/*`, `*/*` for all), so one forbidden namespace does not blind the rest."""
    pods: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    for ns in dict.fromkeys(namespaces if namespaces is not None else (ALL_NAMESPACES,)):  # unique, in order
        try:
            pods += await kube.list("Pod", ns, ROUTER_SELECTOR)
        except (ApiError, aiohttp.ClientError, TimeoutError) as e:
            failed[f"{ns or '*'}/*"] = f"listing router pods: {e}"
    demand = await scrape_routers(router_targets(pods), timeout=timeout)
    return RouterDemand(demand.held, demand.reporting, {**failed, **demand.errors}, demand.texts)
