"""Complexity tiers through a real router in front of real agents: the classifier's split, the header and the
counters that say it, the quality monitor replaying on the top tier (agreement 1.0 for a tier serving the same
checkpoint, a promotion for one serving another), its budget, and a classifier model labelling requests."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from router_helpers import OpenAIless, RouterProcess, counters, served, start_router, wait_for
from server_process import AgentProcess, start_agent

SIMPLE = {"prompt": "hello there", "max_tokens": 12, "temperature": 0}
COMPLEX = {"prompt": "explain step by step: ```def f(x): return x```", "max_tokens": 12, "temperature": 0}


def tiered(small: str, quality: dict[str, Any] | None = None, **classifier: Any) -> str:
    """--tiers for `chat`: `small` then chat-large; short marker-free requests are `simple` (tier 0)."""
    classes = [{"name": "simple", "tier": 0, "maxPromptTokens": 64, "maxOutputTokens": 64, "markers": False}]
    return json.dumps([{"name": "chat", "tiers": [{"model": small, "cost": 1}, {"model": "chat-large", "cost": 8}],
                        "classifier": {"classes": classes, **classifier},
                        "quality": {"sampleRate": 1.0, "windowSeconds": 1, "minSamples": 3, "threshold": 0.5,
                                    "hysteresis": 0.1, "maxConcurrentReplays": 4, "maxReplaysPerMinute": 1000,
                                    **(quality or {})}}])


def post(router: RouterProcess, body: dict[str, Any], path: str = "/v1/completions") -> tuple[dict[str, str], Any]:
    status, headers, text = OpenAIless.post(f"{router.url}{path}", json.dumps({"model": "chat", **body}).encode())
    assert status == 200, text
    return headers, json.loads(text)


def tier_of(headers: dict[str, str]) -> dict[str, str]:
    """The x-kvfleet-tier header's fields."""
    value = next(v for k, v in headers.items() if k.lower() == "x-kvfleet-tier")
    return dict(part.split("=", 1) for part in value.split("; ") if "=" in part)


def family(router: RouterProcess, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return counters(router.url, name)


def sample(router: RouterProcess, name: str, **labels: str) -> float:
    """The sum of one sample name's values (any metric type) over the label sets matching `labels`."""
    return sum(s.value for f in text_string_to_metric_families(OpenAIless.get(f"{router.url}/metrics"))
               for s in f.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def value(samples: dict[tuple[tuple[str, str], ...], float], **labels: str) -> float:
    return sum(v for k, v in samples.items() if all((key, val) in k for key, val in labels.items()))


@pytest.fixture(scope="module")
def agents(tiny_checkpoint: Callable[..., str]) -> Iterator[dict[str, AgentProcess]]:
    """chat-small and chat-large on one checkpoint, chat-other on another (a degraded cheap tier), and a
    labeller."""
    same, other = tiny_checkpoint("llama"), tiny_checkpoint("llama", seed=7)
    flags = ("--max-num-seqs", "8", "--max-queue-length", "64")
    started = {name: start_agent(ckpt, "--served-model-name", name, *flags)
               for name, ckpt in (("chat-small", same), ("chat-large", same), ("chat-other", other),
                                  ("labeller", other))}
    yield started
    for a in started.values():
        a.stop()


def routed(agents: dict[str, AgentProcess], tiers: str) -> RouterProcess:
    r = start_router(*(f"{n}={a.url}" for n, a in agents.items()), flags=("--tiers", tiers))
    wait_for(lambda: all(m["ready_replicas"] >= 1 for m in json.loads(OpenAIless.get(f"{r.url}/v1/models"))["data"]))
    return r


def test_the_classifier_splits_traffic_and_a_faithful_tier_scores_full_agreement(
        agents: dict[str, AgentProcess]) -> None:
    # Room for every verification at once (as in the promotion test below): at the default bound a loaded machine
    # skips some as busy, and the count of scored ones would never reach 12.
    r = routed(agents, tiered("chat-small", {"maxConcurrentReplays": 64}))
    try:
        cards = {m["id"]: m for m in json.loads(OpenAIless.get(f"{r.url}/v1/models"))["data"]}
        assert cards["chat"]["tiers"] == ["chat-small", "chat-large"]
        small_before = served(agents["chat-small"])
        seen = []
        for i in range(16):
            headers, _ = post(r, COMPLEX if i % 4 == 3 else SIMPLE)
            seen.append(tier_of(headers))
        assert [s["class"] for s in seen] == ["unmatched" if i % 4 == 3 else "simple" for i in range(16)]
        assert {s["tier"] for s in seen if s["class"] == "simple"} == {"chat-small"}
        assert {s["tier"] for s in seen if s["class"] == "unmatched"} == {"chat-large"}
        assert "max_tokens 12 <= 64" in seen[0]["reason"], seen[0]
        # The cheap tier served exactly the 12 simple requests: replays go to the top tier only.
        assert served(agents["chat-small"]) - small_before == 12
        requests = family(r, "kvfleet_router_tier_requests")
        assert value(requests, tier="chat-small", **{"class": "simple"}) == 12
        assert value(requests, tier="chat-large", **{"class": "unmatched"}) == 4
        assert value(family(r, "kvfleet_router_tier_cost_units"), tier="chat-large") == 4 * 8
        wait_for(lambda: value(family(r, "kvfleet_router_tier_verifications")) == 12)
        assert value(family(r, "kvfleet_router_tier_verifications"), outcome="scored") == 12
        scores = sample(r, "kvfleet_router_tier_quality_sum", tier="chat-small")
        assert sample(r, "kvfleet_router_tier_quality_count", tier="chat-small") == 12
        assert scores == pytest.approx(12.0)  # every score 1.0: the same checkpoint, greedy
        assert value(family(r, "kvfleet_router_tier_promotions")) == 0
    finally:
        r.stop()


def test_a_degraded_cheap_tier_is_promoted_and_stays_promoted_while_it_is_bad(
        agents: dict[str, AgentProcess]) -> None:
    # Room for every verification at once: on a loaded machine replays run slower than the requests they verify,
    # and at the default bound some would be skipped as busy, which this test is not about.
    r = routed(agents, tiered("chat-other", {"maxConcurrentReplays": 64}))
    try:
        # A window closes after 1 s with 3 scores: bounded by time, not by a count of requests (on a fast machine 60
        # requests took under a second, so no window had closed when the loop gave up).
        deadline = time.monotonic() + 30.0
        for _ in range(5000):
            headers, _ = post(r, SIMPLE)
            if tier_of(headers)["tier"] == "chat-large" or time.monotonic() > deadline:
                break
        header = tier_of(headers)
        assert header["tier"] == "chat-large" and header["promoted-from"] == "chat-other", header
        assert value(family(r, "kvfleet_router_tier_promotions"), **{"class": "simple"}) == 1
        assert value(family(r, "kvfleet_router_tier_promotion"), **{"class": "simple"}) == 1
        assert value(family(r, "kvfleet_router_tier_window_quality"), tier="chat-other") < 0.5
        # Promoted, the class keeps probing the tier below on out-of-band replays: still bad, so no demotion.
        probes = value(family(r, "kvfleet_router_tier_replays"), tier="chat-other")
        for _ in range(8):
            assert tier_of(post(r, SIMPLE)[0])["tier"] == "chat-large"
        wait_for(lambda: value(family(r, "kvfleet_router_tier_replays"), tier="chat-other") >= probes + 8)
        assert value(family(r, "kvfleet_router_tier_verifications"), outcome="skipped_busy") == 0
        assert value(family(r, "kvfleet_router_tier_demotions")) == 0
    finally:
        r.stop()


def test_replays_stay_within_their_budget(agents: dict[str, AgentProcess]) -> None:
    r = routed(agents, tiered("chat-small", {"maxReplaysPerMinute": 3}))
    try:
        for _ in range(8):
            post(r, SIMPLE)
        wait_for(lambda: value(family(r, "kvfleet_router_tier_verifications")) == 8)
        outcomes = family(r, "kvfleet_router_tier_verifications")
        assert value(outcomes, outcome="skipped_budget") == 5, outcomes
        assert value(family(r, "kvfleet_router_tier_replays")) == 3
    finally:
        r.stop()


def test_a_classifier_model_labels_each_request_with_a_class(agents: dict[str, AgentProcess]) -> None:
    classes = [{"name": "simple", "tier": 0}, {"name": "hard", "tier": 1}]
    r = routed(agents, tiered("chat-small", {"sampleRate": 0.0}, classes=classes, model="labeller",
                              modelTimeoutSeconds=30))
    try:
        labels = []
        for body in (SIMPLE, COMPLEX, SIMPLE):
            header = tier_of(post(r, body)[0])
            assert header["source"] == "model", header
            labels.append(header["class"])
            assert header["tier"] == ("chat-small" if header["class"] == "simple" else "chat-large")
        assert set(labels) <= {"simple", "hard"}
        assert value(family(r, "kvfleet_router_tier_classifications"), source="model") == 3
    finally:
        r.stop()


@pytest.mark.parametrize(("tiers", "says"), [
    ('[{"name": "chat", "tiers": [{"model": "a"}]}]', "tieredModels[0].tiers has 1 entries"),
    ('[{"name": "chat", "tiers": [{"model": "a"}, {"model": "b"}], "classifier": {"classes": [{"name": "x", '
     '"tier": 2}]}}]', "tieredModels[0].classifier.classes[0].tier=2 must index the tiers"),
    ('[{"name": "chat", "tiers": [{"model": "a"}, {"model": "b"}], "quality": {"threshold": 0.95}}]',
     "tieredModels[0].quality: threshold + hysteresis = 1.05"),
    ("{", "--tiers: not JSON"),
])
def test_a_bad_tiers_flag_is_refused_naming_the_field(tiers: str, says: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvfleet_router.cli", "--endpoint", "a=http://127.0.0.1:1",
                           "--tiers", tiers], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
