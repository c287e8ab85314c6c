"""The agent's metric contract: family names, the label, histogram buckets; read by the exporter, scraper, simulator."""

from __future__ import annotations

from typing import Final

# Every family carries this label: the served model name (one agent serves one model).
MODEL_LABEL: Final = "model"
# kvfleet_requests_total's second label: stop, length, abort, or rejected_<reason>.
OUTCOME_LABEL: Final = "outcome"

# Gauges. Waiting plus running is the queue-depth signal the autoscaler scales on.
REQUESTS_WAITING: Final = "kvfleet_requests_waiting"
REQUESTS_RUNNING: Final = "kvfleet_requests_running"
KV_CACHE_USAGE: Final = "kvfleet_kv_cache_usage_ratio"
LAST_STEP_TIMESTAMP: Final = "kvfleet_engine_last_step_timestamp_seconds"

# Counters, named without the _total suffix the exposition adds.
PROMPT_TOKENS: Final = "kvfleet_prompt_tokens"
GENERATION_TOKENS: Final = "kvfleet_generation_tokens"
PREEMPTIONS: Final = "kvfleet_preemptions"
PREFIX_CACHE_QUERIES: Final = "kvfleet_prefix_cache_queries"
PREFIX_CACHE_HITS: Final = "kvfleet_prefix_cache_hits"
REQUESTS: Final = "kvfleet_requests"

# Latency histograms, in seconds.
TTFT: Final = "kvfleet_time_to_first_token_seconds"
ITL: Final = "kvfleet_inter_token_latency_seconds"
E2E: Final = "kvfleet_e2e_request_latency_seconds"
QUEUE_TIME: Final = "kvfleet_request_queue_time_seconds"

# Bucket upper bounds (+Inf is implied). TTFT starts at 5 ms so fast replicas still resolve p50.
TTFT_BUCKETS: Final = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
                       5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                      0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0,
                      600.0)
QUEUE_BUCKETS: Final = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                        300.0)

# The latency histograms the autoscaler's targets name, by their short names (ttftP95, itlP99, e2eP99).
LATENCY_TARGETS: Final = {"ttft": TTFT, "itl": ITL, "e2e": E2E}
BUCKETS: Final = {TTFT: TTFT_BUCKETS, ITL: ITL_BUCKETS, E2E: E2E_BUCKETS, QUEUE_TIME: QUEUE_BUCKETS}

# The router: how the operator finds it and the one family it reads. Router pods carry the label
# app.kubernetes.io/name=ROUTER_APP and serve HTTP (OpenAI routes, /metrics) on ROUTER_PORT. The held-requests gauge
# is the demand for an InferenceDeployment that has no ready replica: the autoscaler scales it up from zero on it.
ROUTER_APP: Final = "kvfleet-router"
ROUTER_PORT: Final = 8080
ROUTER_HELD_REQUESTS: Final = "kvfleet_router_held_requests"
# The held gauge's labels: the served model name, and the InferenceDeployment serving it (empty for static endpoints).
NAMESPACE_LABEL: Final = "namespace"
DEPLOYMENT_LABEL: Final = "inference_deployment"
# Complexity tiers (an InferenceRouter's spec.tieredModels): the families the operator reads into the router's
# status. Requests by tier and class (the traffic shares); each class's promotion (tiers above its base tier now);
# the mean agreement with the top tier of each tier's last closed quality window.
ROUTER_TIER_REQUESTS: Final = "kvfleet_router_tier_requests"
ROUTER_TIER_PROMOTION: Final = "kvfleet_router_tier_promotion"
ROUTER_TIER_WINDOW_QUALITY: Final = "kvfleet_router_tier_window_quality"
TIERED_MODEL_LABEL: Final = "model"  # the public name the tiers stand for
TIER_LABEL: Final = "tier"  # a tier's served model name
CLASS_LABEL: Final = "class"

# The opt-in vLLM view (KVFLEET_METRICS_COMPAT=vllm on the agent): vLLM's own family names, labels and bucket
# bounds, so its published dashboards, llm-d's endpoint-picker flags and KEDA recipes read kvfleet unmodified.
METRICS_COMPAT_ENV: Final = "KVFLEET_METRICS_COMPAT"
# The values of the agent's --metrics-compat flag (default: METRICS_COMPAT_ENV, then kvfleet): kvfleet's families
# only, or vLLM's beside them.
METRICS_COMPAT_VIEWS: Final = ("kvfleet", "vllm")
VLLM_MODEL_LABEL: Final = "model_name"
VLLM_ENGINE_LABEL: Final = "engine"  # vLLM's data-parallel engine index; one engine per agent: always "0"
VLLM_TTFT_BUCKETS: Final = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                            10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS: Final = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                           20.0, 40.0, 80.0)
# Shared by vLLM's per-request time histograms: e2e, queue, inference, prefill, decode.
VLLM_REQUEST_BUCKETS: Final = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# Start-up: one gauge sample per phase that ran, in seconds, labelled PHASE_LABEL (besides MODEL_LABEL). Phases in
# the order they run; first_ready spans the whole start (process start to /ready answering 200), so it is at
# least the sum of the others (the rest: imports, tokenizer, binding the ports). A phase that does not run on this
# replica (graph_capture on CPU, with --enforce-eager or tensor parallelism) has no sample rather than a 0.
# vLLM exports no start-up families (it only logs its phases), so the vLLM view has no counterpart.
STARTUP_PHASE_SECONDS: Final = "kvfleet_startup_phase_seconds"
PHASE_LABEL: Final = "phase"
FIRST_READY_PHASE: Final = "first_ready"
STARTUP_PHASES: Final = ("weights_read", "weights_to_device", "kv_profile", "warmup", "graph_capture",
                         FIRST_READY_PHASE)
