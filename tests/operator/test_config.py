"""OperatorConfig from the environment, and the kopf settings it produces."""

from __future__ import annotations

import kopf
import pytest

from kvfleet_operator.config import DEFAULT_AGENT_IMAGE, OperatorConfig


def test_defaults() -> None:
    cfg = OperatorConfig.from_env({})
    assert cfg == OperatorConfig()
    assert cfg.clusterwide and cfg.agent_image == DEFAULT_AGENT_IMAGE and cfg.port == 8080 and not cfg.peering


def test_everything_from_env() -> None:
    cfg = OperatorConfig.from_env({
        "KVFLEET_WATCH_NAMESPACE": "team-a, team-b", "KVFLEET_AGENT_IMAGE": "r/agent:1", "KVFLEET_OPERATOR_PORT": "0",
        "KVFLEET_SCRAPE_TIMEOUT_SECONDS": "0.5", "KVFLEET_LOG_FORMAT": "text", "KVFLEET_LOG_LEVEL": "debug",
        "KVFLEET_PEERING_PRIORITY": "10", "KVFLEET_POST_EVENTS": "false",
        "KVFLEET_UNSCHEDULABLE_GRACE_SECONDS": "30", "KVFLEET_RESYNC_SECONDS": "120",
        "KVFLEET_OPERATOR_NAMESPACE": "ml-serving"})
    assert cfg.namespaces == ("team-a", "team-b") and not cfg.clusterwide
    assert (cfg.agent_image, cfg.port, cfg.scrape_timeout_seconds, cfg.log_format, cfg.log_level) == (
        "r/agent:1", 0, 0.5, "text", "DEBUG")
    assert (cfg.peering, cfg.peering_priority, cfg.post_events) == ("", 10, False)
    assert (cfg.unschedulable_grace_seconds, cfg.resync_seconds) == (30.0, 120.0)
    assert cfg.operator_namespace == "ml-serving"
    assert OperatorConfig.from_env({}).operator_namespace == "kvfleet-system"


def test_namespaced_watching_with_peering_is_refused() -> None:
    # kopf would look for namespaced KopfPeering objects that the manifests do not create, and wait forever.
    with pytest.raises(ValueError, match="KVFLEET_WATCH_NAMESPACE=team-a with KVFLEET_PEERING=kvfleet"):
        OperatorConfig.from_env({"KVFLEET_WATCH_NAMESPACE": "team-a", "KVFLEET_PEERING": "kvfleet"})
    assert OperatorConfig.from_env({"KVFLEET_PEERING": "kvfleet"}).peering == "kvfleet"


@pytest.mark.parametrize(("name", "value"), [("KVFLEET_OPERATOR_PORT", "http"), ("KVFLEET_OPERATOR_PORT", "70000"),
                                             ("KVFLEET_LOG_FORMAT", "xml"), ("KVFLEET_POST_EVENTS", "maybe"),
                                             ("KVFLEET_SCRAPE_TIMEOUT_SECONDS", "soon"),
                                             ("KVFLEET_RESYNC_SECONDS", "0"),
                                             ("KVFLEET_UNSCHEDULABLE_GRACE_SECONDS", "-1")])
def test_bad_values_name_the_variable(name: str, value: str) -> None:
    with pytest.raises(ValueError, match=name):
        OperatorConfig.from_env({name: value})


def test_kopf_settings() -> None:
    s = OperatorConfig.from_env({"KVFLEET_PEERING": "kvfleet"}).settings()
    assert isinstance(s.persistence.progress_storage, kopf.AnnotationsProgressStorage)
    assert s.persistence.progress_storage.prefix == "serving.kvfleet.dev"
    assert isinstance(s.persistence.diffbase_storage, kopf.AnnotationsDiffBaseStorage)
    assert s.persistence.diffbase_storage.prefix == "serving.kvfleet.dev"
    assert (s.peering.standalone, s.peering.name, s.peering.clusterwide) == (False, "kvfleet", True)
    assert s.posting.reporting_component == "kvfleet-operator"
    assert list(s.watching.label_selectors.values()) == ["app.kubernetes.io/managed-by=kvfleet-operator"]
    assert OperatorConfig().settings().peering.standalone
    assert not OperatorConfig().settings().scanning.disabled  # cluster-wide: CRDs and namespaces come and go


def test_watching_named_namespaces_needs_no_cluster_scoped_reads() -> None:
    # A single-namespace install's Role cannot list namespaces or CRDs: kopf must not try.
    s = OperatorConfig.from_env({"KVFLEET_WATCH_NAMESPACE": "ml-serving"}).settings()
    assert s.scanning.disabled and s.peering.standalone and not s.peering.clusterwide
