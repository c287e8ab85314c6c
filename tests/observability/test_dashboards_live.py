"""A real Prometheus scraping two real agents (vLLM view on) behind a real router, after a bounded load: vLLM's
published dashboard queries, every panel of dashboards/*.json and every rule of alerts/ evaluate to labelled data."""

from __future__ import annotations

import asyncio
import json
import math
import re
import sys
from collections.abc import Callable, Iterator

import aiohttp
import pytest
from prom_helpers import ROOT, Prometheus, poll, start_prometheus
from test_alert_rules import rule_spec

sys.path.insert(0, str(ROOT / "tests" / "router"))
from router_helpers import OpenAIless, start_router, wait_for
from server_process import start_agent

MODEL, REQUESTS, CONCURRENCY = "tiny", 24, 4
VARS = {"$__rate_interval": "2m", "$model_name": MODEL, "$namespace": "default", "$inference_deployment": MODEL,
        "$model": MODEL}
# vLLM's examples/online_serving/prometheus_grafana/grafana.json, its panels' queries re-typed ($vars as there).
VLLM_QUERIES = [
    *(f"histogram_quantile({q}, sum by(le) (rate(vllm:{h}_bucket{{model_name=\"$model_name\"}}[$__rate_interval])))"
      for q in (0.99, 0.95, 0.9, 0.5)
      for h in ("e2e_request_latency_seconds", "time_per_output_token_seconds", "time_to_first_token_seconds")),
    *(f"rate(vllm:{h}_sum{{model_name=\"$model_name\"}}[$__rate_interval])\n/\n"
      f"rate(vllm:{h}_count{{model_name=\"$model_name\"}}[$__rate_interval])"
      for h in ("e2e_request_latency_seconds", "time_per_output_token_seconds", "time_to_first_token_seconds")),
    'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'vllm:num_requests_running{model_name="$model_name"}',
    'vllm:num_requests_waiting{model_name="$model_name"}',
    'vllm:gpu_cache_usage_perc{model_name="$model_name"}',
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[$__rate_interval]))',
    'rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_prefill_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_decode_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_max_num_generation_tokens_sum{model_name="$model_name"}[$__rate_interval])',
    # Newer vLLM names, llm-d's endpoint-picker defaults and KEDA triggers.
    'vllm:kv_cache_usage_perc{model_name="$model_name"}',
    'histogram_quantile(0.95, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket[$__rate_interval])))',
    "sum(rate(vllm:prefix_cache_hits_total[$__rate_interval]))"
    " / sum(rate(vllm:prefix_cache_queries_total[$__rate_interval]))",
    "rate(vllm:num_preemptions_total[$__rate_interval])",
]


def substitute(expr: str) -> str:
    for var in sorted(VARS, key=len, reverse=True):  # $model before $model_name would cut it
        expr = expr.replace(var, VARS[var])
    return expr


def host(url: str) -> str:
    """host:port of a base URL (a scrape target)."""
    return url.split("//", 1)[1].rstrip("/")


def has_data(result: list[dict[str, object]]) -> bool:
    """Some series with a finite value (a histogram_quantile over no observations is NaN: no data on a graph)."""
    return any(math.isfinite(float(s["value"][1])) for s in result)  # type: ignore[index]


async def load(url: str) -> None:
    """REQUESTS completions, CONCURRENCY at a time, sharing a 64-token prefix (prefix-cache hits), own tails."""
    sem = asyncio.Semaphore(CONCURRENCY)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        async def one(i: int) -> None:
            body = {"model": MODEL, "prompt": [1, *range(100, 164), 300 + i, 400 + i], "max_tokens": 8 + i % 8,
                    "temperature": 0, "ignore_eos": True}
            async with sem, s.post(f"{url}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
        await asyncio.gather(*(one(i) for i in range(REQUESTS)))


@pytest.fixture(scope="module")
def prom(tiny_checkpoint: Callable[..., str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    env = {"KVFLEET_METRICS_COMPAT": "vllm"}
    agents = [start_agent(tiny_checkpoint("llama"), "--served-model-name", MODEL, "--max-num-seqs", "4", env=env)
              for _ in range(2)]
    router = None
    p = None
    try:
        router = start_router(f"{MODEL}={agents[0].url},{agents[1].url}")
        wait_for(lambda: '"ready_replicas": 2' in json.dumps(json.loads(OpenAIless.get(f"{router.url}/v1/models"))))
        work = tmp_path_factory.mktemp("prometheus")
        agent_labels = {"namespace": "default", "inference_deployment": MODEL}
        p = start_prometheus(work, {
            "kvfleet-agent": [(host(a.url), {**agent_labels, "pod": f"agent-{i}"}) for i, a in enumerate(agents)],
            "kvfleet-router": [(host(router.url), {"namespace": "default", "pod": "router-0"})],
        }, rule_files=(str(rule_spec(work)),))
        asyncio.run(load(router.url))
        # Every finished request scraped (a condition on Prometheus' own view, not a sleep), then one more rule round.
        poll(lambda: p.scalar('sum(kvfleet_requests_total{outcome!~"rejected_.*"})') == REQUESTS, 60, "all scraped")
        poll(lambda: p.scalar(f"sum(vllm:request_success_total) == {REQUESTS}") == REQUESTS, 60, "vLLM view scraped")
        # The router's labelled counters appear at their first request: rate() needs them scraped twice.
        poll(lambda: p.scalar("min(count_over_time(kvfleet_router_requests_total[2m])) >= 2") >= 2, 60,
             "router counters scraped twice")
        yield p
    finally:
        if p is not None:
            p.stop()
        if router is not None:
            router.stop()
        for a in agents:
            a.stop()


def test_vllm_published_dashboard_queries_return_data(prom: Prometheus) -> None:
    empty = [q for q in VLLM_QUERIES if not has_data(prom.query(substitute(q)))]
    assert not empty, "no data:\n" + "\n".join(empty)
    # The dashboard's model_name variable: label_values({__name__=~"vllm:.*"}, model_name).
    assert prom.api("label/model_name/values", **{"match[]": '{__name__=~"vllm:.*"}'}) == [MODEL]
    reasons = {s["metric"]["finished_reason"] for s in prom.query("vllm:request_success_total")}
    assert reasons == {"stop", "length", "abort"}


def dashboard_targets() -> Iterator[tuple[str, str, str, str]]:
    for path in sorted((ROOT / "dashboards").glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for t in panel["targets"]:
                yield path.name, panel["title"], t["expr"], t["legendFormat"]


def test_dashboards_are_generated_from_generate_py() -> None:
    sys.path.insert(0, str(ROOT / "dashboards"))
    import generate

    assert generate.main(["--check"]) == 0


def test_every_dashboard_panel_returns_data_with_its_legend_labels(prom: Prometheus) -> None:
    failures = []
    for name, title, expr, legend in dashboard_targets():
        result = prom.query(substitute(expr))  # raises on a parse error: the operator's panels get this check only
        if "kvfleet_operator_" in expr:
            continue  # no operator runs here (it needs an API server): its panels are parsed, not fed
        wanted = set(re.findall(r"\{\{(\w+)\}\}", legend))
        if not has_data(result):
            failures.append(f"{name} / {title}: no data for {expr}")
        elif missing := [s["metric"] for s in result if not wanted <= {k for k, v in s["metric"].items() if v}]:
            failures.append(f"{name} / {title}: series without {wanted}: {missing}")
    assert not failures, "\n".join(failures)
    # The template variables (label_values queries) list what the load produced.
    assert prom.api("label/inference_deployment/values", **{"match[]": "kvfleet_requests_waiting"}) == [MODEL]
    assert prom.api("label/model/values", **{"match[]": "kvfleet_router_requests_total"}) == [MODEL]


def test_alert_rules_evaluate_cleanly_on_live_series(prom: Prometheus) -> None:
    def evaluated() -> bool:
        rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
        return bool(rules) and all(r["lastEvaluation"] > "2000" for r in rules)  # each rule evaluated at least once

    poll(evaluated, 30, "every rule evaluated")
    rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
    assert [r["name"] for r in rules if r["health"] != "ok"] == []
    # Recording rules over agent series have values here (the load was within the SLOs: ratios of 0 are data).
    ratios = [r["name"] for r in rules if r["type"] == "recording"]
    assert all(prom.query(name) for name in ratios if name.endswith(("rate5m", "rate30m", "rate1h"))), ratios
    firing = [a["labels"]["alertname"] for a in prom.api("alerts")["alerts"] if a["state"] == "firing"]
    assert firing == []  # a healthy fleet under light load pages no one


def test_no_created_series_from_agents_or_router(prom: Prometheus) -> None:
    assert prom.query('{__name__=~".+_created"}') == []


def test_operator_exposition_has_no_created_series() -> None:
    from prometheus_client import generate_latest

    from kvfleet_operator import metrics

    text = generate_latest(metrics.REGISTRY).decode()
    assert "kvfleet_operator_reconcile_duration_seconds_bucket" in text and "_created" not in text
