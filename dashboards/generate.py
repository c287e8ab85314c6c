"""Writes the Grafana dashboards of dashboards/*.json from the panel lists below, and the Helm chart's copies of them
and of alerts/kvfleet-rules.yaml (Helm reads only files inside the chart): `python dashboards/generate.py`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# The labels a scrape adds to every agent and router series (the PodMonitor's relabeling does it in a cluster):
# namespace, pod, and for agents inference_deployment, from the pod label serving.kvfleet.dev/inference-deployment.
SEL = 'namespace="$namespace", inference_deployment="$inference_deployment"'
BY = "namespace, inference_deployment"
WINDOW = "$__rate_interval"
DS = {"type": "prometheus", "uid": "${datasource}"}
# (title, unit, [(expr, legend)]); a legend's {{label}}s are the labels each series must carry (a test checks).
Panel = tuple[str, str, list[tuple[str, str]]]


def quantiles(family: str, selector: str, by: str, qs: tuple[float, ...] = (0.5, 0.95, 0.99)) -> list[tuple[str, str]]:
    """histogram_quantile over the rate of a histogram's buckets, one target per quantile."""
    labels = [b.strip() for b in by.split(",") if b.strip()]
    legend, group = " ".join("{{" + b + "}}" for b in labels), ", ".join(["le", *labels])
    return [(f"histogram_quantile({q}, sum by ({group}) (rate({family}_bucket{{{selector}}}[{WINDOW}])))",
             f"p{round(q * 100)} {legend}".strip()) for q in qs]


def rate(family: str, selector: str, by: str) -> str:
    return f"sum by ({by}) (rate({family}{{{selector}}}[{WINDOW}]))"


REFUSED = rate("kvfleet_requests_total", 'outcome=~"rejected_.*"', BY)
ALL = rate("kvfleet_requests_total", "", BY)
FLEET: list[Panel] = [
    ("Requests finished per second", "reqps",
     [(rate("kvfleet_requests_total", 'outcome!~"rejected_.*"', BY), "{{namespace}}/{{inference_deployment}}")]),
    # "or ... * 0": a deployment that refused nothing shows 0 rather than no series.
    ("Requests refused at admission (share)", "percentunit",
     [(f"({REFUSED} or {ALL} * 0) / {ALL}", "{{namespace}}/{{inference_deployment}}")]),
    ("Generated tokens per second", "short",
     [(rate("kvfleet_generation_tokens_total", "", BY), "{{namespace}}/{{inference_deployment}}")]),
    ("TTFT p95", "s", quantiles("kvfleet_time_to_first_token_seconds", "", BY, (0.95,))),
    ("ITL p95", "s", quantiles("kvfleet_inter_token_latency_seconds", "", BY, (0.95,))),
    ("Queue: requests waiting", "short",
     [(f"sum by ({BY}) (kvfleet_requests_waiting)", "{{namespace}}/{{inference_deployment}}")]),
    ("KV cache usage, fullest replica", "percentunit",
     [(f"max by ({BY}) (kvfleet_kv_cache_usage_ratio)", "{{namespace}}/{{inference_deployment}}")]),
    ("Agents up", "short",
     [(f'sum by ({BY}) (up{{job="kvfleet-agent"}})', "{{namespace}}/{{inference_deployment}}")]),
    ("Seconds since each engine's last step", "s",
     [("time() - kvfleet_engine_last_step_timestamp_seconds", "{{namespace}}/{{pod}}")]),
]

DEPLOYMENT: list[Panel] = [
    ("Time to first token", "s", quantiles("kvfleet_time_to_first_token_seconds", SEL, BY)),
    ("Inter-token latency", "s", quantiles("kvfleet_inter_token_latency_seconds", SEL, BY)),
    ("End-to-end latency", "s", quantiles("kvfleet_e2e_request_latency_seconds", SEL, BY)),
    ("Queue time", "s", quantiles("kvfleet_request_queue_time_seconds", SEL, BY)),
    ("Token throughput", "short",
     [(rate("kvfleet_prompt_tokens_total", SEL, BY), "prompt {{inference_deployment}}"),
      (rate("kvfleet_generation_tokens_total", SEL, BY), "generated {{inference_deployment}}")]),
    ("Requests by outcome", "reqps",
     [(rate("kvfleet_requests_total", SEL, f"{BY}, outcome"), "{{outcome}}")]),
    ("Queue and batch", "short",
     [(f"sum by ({BY}) (kvfleet_requests_waiting{{{SEL}}})", "waiting {{inference_deployment}}"),
      (f"sum by ({BY}) (kvfleet_requests_running{{{SEL}}})", "running {{inference_deployment}}")]),
    ("KV cache usage by replica", "percentunit",
     [(f"kvfleet_kv_cache_usage_ratio{{{SEL}}}", "{{pod}}")]),
    ("Preemptions per second", "short",
     [(rate("kvfleet_preemptions_total", SEL, f"{BY}, pod"), "{{pod}}")]),
    ("Prefix cache hit ratio (tokens)", "percentunit",
     [(f"{rate('kvfleet_prefix_cache_hits_total', SEL, BY)} / {rate('kvfleet_prefix_cache_queries_total', SEL, BY)}",
       "{{inference_deployment}}")]),
]

OP_SEL = 'namespace="$namespace", name="$inference_deployment"'
AUTOSCALING: list[Panel] = [
    ("Desired replicas and why", "short",
     [(f"kvfleet_operator_desired_replicas{{{OP_SEL}}}", "desired ({{reason}})"),
      (f'sum by ({BY}) (up{{job="kvfleet-agent", {SEL}}})', "agents scraped {{inference_deployment}}")]),
    ("Autoscaler rounds by result", "ops",
     [("sum by (result) (rate(kvfleet_operator_autoscale_ticks_total[$__rate_interval]))", "{{result}}")]),
    ("Agent scrape errors by reason", "ops",
     [("sum by (reason) (rate(kvfleet_operator_scrape_errors_total[$__rate_interval]))", "{{reason}}")]),
    ("Reconciles by trigger and result", "ops",
     [("sum by (trigger, result) (rate(kvfleet_operator_reconciles_total[$__rate_interval]))",
       "{{trigger}} {{result}}")]),
    ("Reconcile duration p95", "s", quantiles("kvfleet_operator_reconcile_duration_seconds", "", "", (0.95,))),
    ("Failed writes to the API by kind", "ops",
     [("sum by (kind) (rate(kvfleet_operator_apply_errors_total[$__rate_interval]))", "{{kind}}")]),
]

ROUTER: list[Panel] = [
    ("Requests by replica and outcome", "reqps",
     [(rate("kvfleet_router_requests_total", 'model=~"$model"', "model, replica, outcome"),
       "{{replica}} {{outcome}}")]),
    ("Routing decisions by reason", "ops",
     [(rate("kvfleet_router_routing_decisions_total", 'model=~"$model"', "model, reason"), "{{model}} {{reason}}")]),
    ("Requests held (no ready replica)", "short",
     # namespace and inference_deployment are empty (so absent) for models served by static endpoints.
     [('sum by (model, namespace, inference_deployment) (kvfleet_router_held_requests{model=~"$model"})',
       "{{model}}")]),
    ("Latency the router adds", "s", quantiles("kvfleet_router_added_latency_seconds", "", "pod")),
]


def variable(name: str, query: str) -> dict[str, Any]:
    return {"name": name, "label": name, "type": "query", "datasource": DS, "refresh": 2, "includeAll": False,
            "multi": False, "query": {"query": query, "refId": f"{name}-query"}, "definition": query}


DATASOURCE_VAR = {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus"}
DEPLOYMENT_VARS = [DATASOURCE_VAR, variable("namespace", "label_values(kvfleet_requests_waiting, namespace)"),
                   variable("inference_deployment",
                            'label_values(kvfleet_requests_waiting{namespace="$namespace"}, inference_deployment)')]
ROUTER_VARS = [DATASOURCE_VAR, {**variable("model", "label_values(kvfleet_router_requests_total, model)"),
                                "includeAll": True, "multi": True, "allValue": ".*"}]


def panel(i: int, p: Panel) -> dict[str, Any]:
    title, unit, targets = p
    return {"id": i + 1, "type": "timeseries", "title": title, "datasource": DS,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}},
            "targets": [{"refId": chr(ord("A") + j), "datasource": DS, "expr": e, "legendFormat": legend,
                         "range": True} for j, (e, legend) in enumerate(targets)]}


def dashboard(uid: str, title: str, panels: list[Panel], variables: list[dict[str, Any]]) -> dict[str, Any]:
    return {"uid": uid, "title": title, "tags": ["kvfleet"], "editable": True, "schemaVersion": 39,
            "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "timezone": "",
            "templating": {"list": variables}, "panels": [panel(i, p) for i, p in enumerate(panels)]}


DASHBOARDS = {
    "kvfleet-fleet.json": dashboard("kvfleet-fleet", "kvfleet / Fleet overview", FLEET, [DATASOURCE_VAR]),
    "kvfleet-deployment.json": dashboard("kvfleet-deployment", "kvfleet / InferenceDeployment", DEPLOYMENT,
                                         DEPLOYMENT_VARS),
    "kvfleet-autoscaling.json": dashboard("kvfleet-autoscaling", "kvfleet / Autoscaling", AUTOSCALING,
                                          DEPLOYMENT_VARS),
    "kvfleet-router.json": dashboard("kvfleet-router", "kvfleet / Router", ROUTER, ROUTER_VARS),
}


def render(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2) + "\n"


def outputs(root: Path) -> dict[Path, str]:
    """Every file this script owns, by path under the repository root, with the text it must hold."""
    chart = root / "charts" / "kvfleet" / "files"
    out = {}
    for name, doc in DASHBOARDS.items():
        out[root / "dashboards" / name] = out[chart / "dashboards" / name] = render(doc)
    # The alerts are written by hand; the chart carries a copy (templates/monitoring.yaml renders it).
    out[chart / "kvfleet-rules.yaml"] = (root / "alerts" / "kvfleet-rules.yaml").read_text()
    return out


def main(argv: list[str]) -> int:
    """Write every dashboard and chart copy; with --check, only report the ones that differ (exit 1)."""
    root, stale = Path(__file__).resolve().parent.parent, []
    for path, text in outputs(root).items():
        if "--check" in argv:
            if not path.exists() or path.read_text() != text:
                stale.append(path.relative_to(root))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    for rel in stale:
        print(f"{rel} differs from generate.py's output: run python dashboards/generate.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
