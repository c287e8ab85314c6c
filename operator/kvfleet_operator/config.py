"""OperatorConfig from the environment, and the kopf settings it implies."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import kopf

from kvfleet_operator.builders import DEFAULT_OPERATOR_NAMESPACE, MANAGED_BY_LABEL, MANAGER
from kvfleet_operator.models import GROUP

DEFAULT_AGENT_IMAGE = "ghcr.io/kvfleet/kvfleet-agent:0.1.0"
DEFAULT_ROUTER_IMAGE = "ghcr.io/kvfleet/kvfleet-router:0.1.0"


@dataclass(frozen=True)
class OperatorConfig:
    """Every operator setting; `from_env` documents the variable of each."""

    namespaces: tuple[str, ...] = ()  # empty: every namespace (cluster-wide)
    agent_image: str = DEFAULT_AGENT_IMAGE
    router_image: str = DEFAULT_ROUTER_IMAGE  # InferenceRouters' pods, unless their spec.image says otherwise
    port: int = 8080  # /healthz and /metrics; 0 picks a free port (logged)
    scrape_timeout_seconds: float = 2.0
    unschedulable_grace_seconds: float = 60.0  # Pending as Unschedulable this long → CapacityBlocked
    resync_seconds: float = 60.0  # every object is reconciled at least this often (lost events, drift)
    log_format: Literal["json", "text"] = "json"
    log_level: str = "INFO"
    peering: str = ""  # a KopfPeering/ClusterKopfPeering name for one active operator; empty: standalone
    peering_priority: int = 0
    post_events: bool = True
    operator_namespace: str = DEFAULT_OPERATOR_NAMESPACE  # where the operator's pods run: agents admit them to /metrics

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorConfig:
        """Read KVFLEET_WATCH_NAMESPACE (comma-separated; empty: all), KVFLEET_AGENT_IMAGE, KVFLEET_ROUTER_IMAGE,
        KVFLEET_OPERATOR_PORT, KVFLEET_SCRAPE_TIMEOUT_SECONDS, KVFLEET_UNSCHEDULABLE_GRACE_SECONDS,
        KVFLEET_RESYNC_SECONDS, KVFLEET_LOG_FORMAT (json|text), KVFLEET_LOG_LEVEL, KVFLEET_PEERING,
        KVFLEET_PEERING_PRIORITY, KVFLEET_POST_EVENTS (true|false) and KVFLEET_OPERATOR_NAMESPACE (the operator
        pod's own namespace, from the downward API; default kvfleet-system). Raises ValueError naming the bad
        variable."""
        env = os.environ if env is None else env

        def get(name: str, default: str) -> str:
            return env.get(name, "").strip() or default

        def number(name: str, default: str, kind: type[int] | type[float]) -> float:
            raw = get(name, default)
            try:
                return kind(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a valid {kind.__name__}") from None

        log_format = get("KVFLEET_LOG_FORMAT", "json")
        if log_format not in ("json", "text"):
            raise ValueError(f"KVFLEET_LOG_FORMAT={log_format!r}: use json or text")
        events = get("KVFLEET_POST_EVENTS", "true").lower()
        if events not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"KVFLEET_POST_EVENTS={events!r}: use true or false")
        port = int(number("KVFLEET_OPERATOR_PORT", "8080", int))
        if not 0 <= port <= 65535:
            raise ValueError(f"KVFLEET_OPERATOR_PORT={port}: use 0..65535 (0: any free port)")
        namespaces = tuple(n.strip() for n in env.get("KVFLEET_WATCH_NAMESPACE", "").split(",") if n.strip())
        peering = get("KVFLEET_PEERING", "")
        if namespaces and peering:
            # kopf then elects a leader per namespace through namespaced KopfPeering objects, which the manifests
            # do not create (they ship one ClusterKopfPeering): the operator would wait for them forever.
            raise ValueError(f"KVFLEET_WATCH_NAMESPACE={','.join(namespaces)} with KVFLEET_PEERING={peering}: "
                             "peering is only supported cluster-wide; unset KVFLEET_PEERING (run one replica) "
                             "or leave KVFLEET_WATCH_NAMESPACE empty")
        timings: dict[str, float] = {}
        for var, default in (("KVFLEET_SCRAPE_TIMEOUT_SECONDS", "2.0"), ("KVFLEET_UNSCHEDULABLE_GRACE_SECONDS", "60"),
                             ("KVFLEET_RESYNC_SECONDS", "60")):
            timings[var] = number(var, default, float)
            if not 0 < timings[var] <= 3600:
                raise ValueError(f"{var}={timings[var]:g}: use a number of seconds in (0, 3600]")
        return cls(
            namespaces=namespaces,
            agent_image=get("KVFLEET_AGENT_IMAGE", DEFAULT_AGENT_IMAGE),
            router_image=get("KVFLEET_ROUTER_IMAGE", DEFAULT_ROUTER_IMAGE),
            port=port,
            scrape_timeout_seconds=timings["KVFLEET_SCRAPE_TIMEOUT_SECONDS"],
            unschedulable_grace_seconds=timings["KVFLEET_UNSCHEDULABLE_GRACE_SECONDS"],
            resync_seconds=timings["KVFLEET_RESYNC_SECONDS"],
            log_format="json" if log_format == "json" else "text",
            log_level=get("KVFLEET_LOG_LEVEL", "INFO").upper(),
            peering=peering,
            peering_priority=int(number("KVFLEET_PEERING_PRIORITY", "0", int)),
            post_events=events in ("true", "1", "yes"),
            operator_namespace=get("KVFLEET_OPERATOR_NAMESPACE", DEFAULT_OPERATOR_NAMESPACE),
        )

    @property
    def clusterwide(self) -> bool:
        return not self.namespaces

    def settings(self) -> kopf.OperatorSettings:
        """Fresh kopf settings configured by configure()."""
        return self.configure(kopf.OperatorSettings())

    def configure(self, s: kopf.OperatorSettings) -> kopf.OperatorSettings:
        """kopf settings: our own annotation prefix for handler progress, peering, events, server-side filters."""
        # Handler progress and the last-handled spec live in annotations under our prefix, not in status (which
        # the reconcile writes whole by server-side apply) and not under kopf.zalando.org, shared with other tools.
        s.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP, v1=False)
        s.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=GROUP, key="last-handled-configuration", v1=False)
        s.persistence.finalizer = f"{GROUP}/kopf-finalizer"  # used only if a deletion handler is ever added
        s.posting.enabled = self.post_events
        s.posting.level = logging.WARNING  # handler failures become Events; successes only our explicit "Applied"
        s.posting.reporting_component = MANAGER
        s.peering.standalone = not self.peering
        s.peering.name = self.peering or "kvfleet"
        s.peering.priority = self.peering_priority
        s.peering.clusterwide = self.clusterwide
        s.peering.mandatory = bool(self.peering)
        # Watching named namespaces is how single-namespace installs run, under a Role that cannot list
        # namespaces or CRDs (cluster-scoped): serve exactly those namespaces and the CRDs present at startup
        # rather than try, fail and warn on every start.
        s.scanning.disabled = not self.clusterwide
        # Watch only the Deployments we manage (filtered by the apiserver, not in memory).
        s.watching.label_selectors["apps", "v1", "deployments"] = f"{MANAGED_BY_LABEL}={MANAGER}"
        s.watching.server_timeout = 270  # re-list now and then; never silently stuck on a dead watch
        s.watching.client_timeout = 300
        s.networking.request_timeout = 60
        return s
