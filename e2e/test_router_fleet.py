"""The router in front of real agents on the local control plane: a scale-up spreads the load and lowers TTFT,
shared prefixes hit the agents' caches more than round-robin within the load bound, and a killed agent costs only
the streams it was serving, each ending cleanly."""

from __future__ import annotations

import math
import os
import random
import signal
import statistics
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import fleet_client
import pytest
from cluster import LocalCluster
from operator_proc import Operator
from router_fleet import AGENT_PORT, MODEL, ROUTER_PORT, Fleet, metrics, parse_metrics, total

EPSILON = 0.25
WORDS = ["river", "stone", "market", "garden", "lantern", "copper", "meadow", "harbor", "violet", "thunder",
         "orchard", "canyon", "ribbon", "falcon", "pepper", "marble", "glacier", "saddle", "compass", "velvet"]


@pytest.fixture(scope="module")
def fleet(cluster: LocalCluster, operator: Operator, tiny_model: Path) -> Iterator[Fleet]:
    """An InferenceDeployment at one replica behind an InferenceRouter, in a namespace of the module's own."""
    namespace = f"e2e-router-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    f = Fleet(cluster, namespace, tiny_model)
    try:
        f.start_router(epsilon=EPSILON)
        f.apply(1)
        yield f
    finally:
        cluster.kubectl("delete", "inferencedeployments,inferencerouters", "--all", "-n", namespace, "--wait=false",
                        check=False)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def shares(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Each pod's share of the requests it finished between two counter readings."""
    done = {pod: after[pod] - before.get(pod, 0.0) for pod in after}
    n = sum(done.values())
    return {pod: d / n for pod, d in done.items()} if n else {}


def capacity(fleet: Fleet, tmp_path: Path) -> float:
    """Requests per second one replica completes under a closed loop of 8 (the load the test scales against)."""
    s = fleet.bench(tmp_path / "capacity.json", "--concurrency", "8", "--duration", "10", "--max-tokens", "32",
                    "--ignore-eos", "--prompt-len", "64", "--seed", "7")
    return float(s["request_throughput"])


def test_a_scale_up_spreads_the_load_and_lowers_ttft(fleet: Fleet, tmp_path: Path) -> None:
    fleet.apply(1)
    rate = 1.3 * capacity(fleet, tmp_path)  # above one replica, within what three share on this machine
    load = ["--request-rate", f"{rate:.2f}", "--duration", "20", "--max-tokens", "32", "--ignore-eos",
            "--prompt-len", "64", "--seed", "11", "--timeout", "120"]
    one = fleet.bench(tmp_path / "one.json", *load)
    fleet.apply(3)
    before = fleet.agent_counter("kvfleet_requests_total")
    three = fleet.bench(tmp_path / "three.json", *load)
    split = shares(before, fleet.agent_counter("kvfleet_requests_total"))
    p95_one, p95_three = one["ttft_ms"]["p95"], three["ttft_ms"]["p95"]
    print(f"\nopen loop at {rate:.2f} req/s for 20 s: TTFT p95 {p95_one:.0f} ms on 1 replica, {p95_three:.0f} ms on 3;"
          f" shares after the scale-up {', '.join(f'{v:.0%}' for v in sorted(split.values()))}")
    assert one["failed"] == three["failed"] == 0, (one, three)
    assert len(split) == 3 and min(split.values()) >= 0.20, split
    # The margin: three replicas must cut the one-replica p95 by at least a quarter (the queue of an overloaded
    # replica grows for the whole run, so on this machine the gap is several-fold; a quarter is a safe floor).
    assert p95_three <= 0.75 * p95_one, (p95_one, p95_three)


def shared_prefix_bodies(salt: str, systems: int, users: int) -> list[dict[str, object]]:
    """Several long system prompts and many users each; system 0 is hot (half the requests), to test the bound.

    One fixed structure (which user asks under which system, every word), so two runs differ only in `salt`,
    which leads each system prompt: a new salt is a workload of the same shape on cold caches."""
    rng = random.Random(1)
    prompts = [f"{salt} " + " ".join(rng.choice(WORDS) for _ in range(50)) + f" [{i}]" for i in range(systems)]
    bodies: list[dict[str, object]] = []
    for u in range(users):
        system = 0 if u % 2 == 0 else rng.randrange(1, systems)
        question = " ".join(rng.choice(WORDS) for _ in range(8))
        bodies.append({"model": MODEL, "prompt": f"{prompts[system]}\nUser {u}: {question}\nAnswer:",
                       "max_tokens": 8, "temperature": 0})
    return bodies


def test_shared_prefixes_hit_more_through_the_router_than_round_robin(fleet: Fleet) -> None:
    fleet.apply(3)
    agents = fleet.agents()
    loads: list[float] = []
    placements: list[float] = []
    stop = threading.Event()

    def sample(ports: list[int]) -> None:
        # The agents' own queue gauges while the routed runs go: the bound is on what each replica holds. Read through
        # loopback forwards (a few ms each, 150 readings a test): a process spawned in the pod network per read got
        # one or two readings a run, some all zero. So many readings also caught the agents' gauges counting a request
        # twice (4 or 6 where the router had sent 3, in 7 of 36 runs), until AsyncLLM published its queues whole.
        while not stop.is_set():
            for port in ports:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    m = parse_metrics(r.read().decode())
                loads.append(total(m, "kvfleet_requests_waiting") + total(m, "kvfleet_requests_running"))
            stop.wait(0.05)  # a sampling period, not a synchronisation

    def hit_ratio(urls: list[str], salt: str) -> float:
        before_h = sum(fleet.agent_counter("kvfleet_prefix_cache_hits_total").values())
        before_q = sum(fleet.agent_counter("kvfleet_prefix_cache_queries_total").values())
        bodies = shared_prefix_bodies(salt, systems=12, users=72)
        run = fleet_client.run(urls, bodies, concurrency=6, timeout=60)
        assert run.count("done") == len(run.outcomes), [o.detail for o in run.outcomes if o.fate != "done"][:3]
        hits = sum(fleet.agent_counter("kvfleet_prefix_cache_hits_total").values()) - before_h
        queries = sum(fleet.agent_counter("kvfleet_prefix_cache_queries_total").values()) - before_q
        return hits / queries

    # Round-robin's ratio is fixed by the workload's shape. The router's depends on where the 12 prefixes land on
    # the hash ring (a salt, or new pod names, moves them): with the hot prefix's owner holding two others, more
    # spills past the bound. Single placements read 0.57-0.64 here (round-robin 0.50), so the router is judged on
    # the mean of three. They run first, so that the router is the agents' only client meanwhile: requests around it
    # reach its picker only through gauges up to a scrape old, and the bound below assumes the 6 are all it sees.
    with forwards(fleet, list(agents.values()), AGENT_PORT) as gauges, \
            forwards(fleet, [fleet.router_ip()], ROUTER_PORT) as (port,):
        sampler = threading.Thread(target=sample, args=(gauges,), daemon=True)
        sampler.start()
        try:  # fresh salts: cold caches
            for i in range(3):
                placements.append(hit_ratio([f"http://127.0.0.1:{port}/v1/completions"], salt=f"routed{i}"))
        finally:
            stop.set()
            sampler.join()
        round_robin = hit_ratio([f"http://127.0.0.1:{p}/v1/completions" for p in gauges], salt="rr")
    routed = statistics.mean(placements)
    limit = math.ceil((1 + EPSILON) * (6 + 1) / 3)  # the picker's bound for 6 in flight on 3 replicas
    print(f"\nprefix-cache hit ratio: {routed:.1%} through the router (placements "
          f"{', '.join(f'{r:.1%}' for r in placements)}), {round_robin:.1%} round-robin; "
          f"most any replica held: {max(loads):.0f} (bound {limit}; {len(loads)} readings)")
    assert routed > round_robin + 0.05, (routed, round_robin)
    # The readings must have seen the load (6 in flight on 3 replicas) for the bound to be tested at all.
    assert len(loads) >= 30 and max(loads) >= 2, (len(loads), max(loads, default=None))
    assert max(loads) <= limit, max(loads)


class forwards:
    """Loopback ports forwarded to pod IPs for the duration of a with-block."""

    def __init__(self, fleet: Fleet, ips: list[str], port: int) -> None:
        self.managers = [fleet.cluster.port_forward(ip, port) for ip in ips]

    def __enter__(self) -> list[int]:
        return [m.__enter__() for m in self.managers]

    def __exit__(self, *exc: object) -> None:
        for m in self.managers:
            m.__exit__(None, None, None)


def test_a_killed_agent_costs_only_its_streams_and_nothing_hangs(fleet: Fleet) -> None:
    fleet.apply(3)
    processes = {e["pod"].split("/", 1)[1]: e["pid"] for e in fleet.cluster.agent_processes().values()
                 if e["pod"].startswith(f"{fleet.namespace}/")}
    victim = sorted(fleet.agents())[0]
    bodies = [{"model": MODEL, "prompt": f"request {i}: " + " ".join(WORDS), "max_tokens": 160, "ignore_eos": True}
              for i in range(36)]
    killed_at: list[float] = []

    def kill_once(i: int) -> None:
        if i == 12 and not killed_at:  # a third of the way in: streams are running on every replica
            time.sleep(1.0)  # let those streams get going before the kill (timing of the fault, not a sync)
            os.kill(processes[victim], signal.SIGKILL)
            killed_at.append(time.monotonic())

    with forwards(fleet, [fleet.router_ip()], ROUTER_PORT) as (port,):
        started = time.monotonic()
        run = fleet_client.run([f"http://127.0.0.1:{port}/v1/completions"], bodies, concurrency=6, timeout=90,
                               on_sent=kill_once)
        took = time.monotonic() - started
    fates = {f: run.count(f) for f in ("done", "error-event", "http", "failed")}
    print(f"\nkilled {victim} mid-load: {fates} in {took:.1f}s")
    assert killed_at and fates["failed"] == 0 and fates["http"] == 0, [o.detail for o in run.outcomes][:6]
    cut = [o for o in run.outcomes if o.fate == "error-event"]
    assert all(f"replica={fleet.namespace}/{victim}" in o.route for o in cut), [o.route for o in cut]
    assert len(cut) <= 6, fates  # at most the streams in flight at the kill
    after = [o for o in run.outcomes if o.started > killed_at[0]]
    assert after and all(o.fate == "done" for o in after), [(o.fate, o.route) for o in after]
    router = metrics(fleet.cluster, fleet.router_ip(), ROUTER_PORT)
    assert total(router, "kvfleet_router_upstream_errors_total") >= len(cut)
