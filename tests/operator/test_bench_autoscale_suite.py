"""bench/autoscale's suite: the window SLO, the new traces, the faults, the replica's new metrics and what the
kvfleet adapter passes to decide()."""

from __future__ import annotations

import math
import random
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "autoscale"))

import policies
import replica
import run as autoscale_run
import scoring
import suite
import workload
from policies import Hpa, KubeAI, Kvfleet, Setup
from simulator import Fault, Fleet, RunResult, simulate
from workload import RequestMix, Trace, arrivals, traces

from kvfleet_operator.autoscaling.decision import Observation
from kvfleet_operator.autoscaling.scrape import MetricsWindow

GPU = replica.PRESETS["gpu-8b"]
UNIT = Setup.unit


def served(arrival: float, ttft: float | None) -> replica.Request:
    r = replica.Request(arrival, 100, 10)
    r.first_token = None if ttft is None else arrival + ttft
    return r


# --- the window SLO -------------------------------------------------------------------------------------------


def test_window_slo_takes_each_minutes_p95_and_skips_empty_minutes() -> None:
    reqs = [served(1.0 + i, 0.1) for i in range(19)] + [served(30.0, 2.0)]  # minute 0: p95 (19th of 20) is 0.1
    reqs += [served(61.0 + i, 0.1) for i in range(18)] + [served(70.0, 2.0), served(71.0, 3.0)]  # minute 1: 2.0
    # minute 2: nothing arrives (not counted); minute 3: one request never served (an infinite TTFT)
    reqs += [served(185.0, None)]
    # minute 4: fast requests, but their first tokens come in minute 5: by arrival, they count in minute 4
    reqs += [served(299.0, 0.4), served(299.5, 0.45)]
    assert scoring.window_slo(reqs, 0.5) == (2, 4)
    run = RunResult("kvfleet", "hand", reqs, 100.0, [(10.0, 1), (100.0, -1)])
    s = scoring.score(run, 0.5)
    assert (s.windows, s.windows_met, s.requests) == (4, 2, len(reqs))
    assert s.window_share == 0.5
    assert s.slo_share == pytest.approx(39 / 43)  # per request: 4 late or unserved of 43
    assert s.flaps == 1
    both = scoring.combine([s, s])
    assert (both.windows, both.windows_met, both.window_share) == (8, 4, 0.5)


def test_the_bar_judges_slo_by_windows_not_requests() -> None:
    kv = scoring.Score("kvfleet", "t", 1000, 0.99, 0.3, 100.0, 2, 0, windows=10, windows_met=8)
    hpa = scoring.Score("hpa", "t", 1000, 0.95, 0.9, 100.0, 2, 0, windows=10, windows_met=9)
    kubeai = scoring.Score("kubeai", "t", 1000, 0.90, 0.9, 90.0, 2, 0, windows=10, windows_met=9)
    assert scoring.better_baseline([kv, hpa, kubeai]) is kubeai  # a tie on windows: the cheaper
    ok, why = scoring.bar([kv, hpa, kubeai])
    assert not ok and "FAIL SLO windows 80.00% vs kubeai 90.00%" in why
    report = scoring.table({"t / 2m / none": [kv, hpa, kubeai]})
    assert "| t / 2m / none | kvfleet | 1000 | 80.00% | 99.00% |" in report
    assert report.rstrip().endswith("bar held in 0 of 1 cases")


# --- traces ---------------------------------------------------------------------------------------------------


def samples(trace: Trace, step: float = 5.0) -> list[float]:
    return [trace.rate(i * step) for i in range(int(trace.duration_s / step))]


def test_unseeded_traces_do_not_depend_on_the_seed() -> None:
    a, b = traces(UNIT, seed=1), traces(UNIT, seed=7)
    for name in ("step", "ramp", "burst", "wave", "spike", "long-prompt"):
        assert samples(a[name], 60.0) == samples(b[name], 60.0)
    assert a["step"].rate(0) == 2 * UNIT and a["step"].rate(900) == 6 * UNIT and a["step"].rate(3600) == 2 * UNIT
    assert a["step"].mix == RequestMix() and a["step"].duration_s == 5400


def test_spike_is_ten_times_its_base_for_ten_minutes_twice() -> None:
    t = traces(UNIT)["spike"]
    xs = samples(t)
    assert min(xs) == UNIT and max(xs) == 10 * UNIT and t.peak == 10 * UNIT
    starts = [i for i in range(1, len(xs)) if xs[i] > xs[i - 1]]
    ends = [i for i in range(1, len(xs)) if xs[i] < xs[i - 1]]
    assert len(starts) == len(ends) == 2
    assert [(e - s) * 5.0 for s, e in zip(starts, ends, strict=True)] == [600.0, 600.0]
    assert t.rise_s == starts[0] * 5.0 and t.duration_s == 5400


def test_seeded_traces_differ_by_seed_and_repeat_for_a_seed() -> None:
    for name in ("sine-noise", "lognormal-bursts", "diurnal"):
        one, again, other = (traces(UNIT, seed=s)[name] for s in (1, 1, 2))
        assert samples(one) == samples(again), name
        assert samples(one) != samples(other), name
        for t in (one, other):
            assert max(samples(t, 1.0)) <= t.peak + 1e-9, name  # thinning needs a true bound


def test_sine_noise_is_a_noisy_one_to_six_sinusoid() -> None:
    t = traces(UNIT, seed=3)["sine-noise"]
    base = [UNIT * (3.5 - 2.5 * math.cos(2 * math.pi * (m * 60 + 30) / 2400)) for m in range(120)]
    ratio = [t.rate(m * 60 + 30) / b for m, b in enumerate(base)]
    assert min(ratio) > 0.6 and max(ratio) < 1.6
    assert 0.1 < statistics.pstdev(math.log(r) for r in ratio) < 0.2  # sigma ~0.15, drawn per minute


def test_lognormal_bursts_sit_on_base_three_and_stay_within_max_replicas() -> None:
    for seed in (1, 2, 3):
        t = traces(UNIT, seed=seed, max_units=20.0)["lognormal-bursts"]
        xs = samples(t)
        assert min(xs) == 3 * UNIT
        assert max(xs) <= 20 * UNIT
        assert statistics.median(xs) == 3 * UNIT  # bursts are the exception
        assert max(xs) > 3 * UNIT  # at least one burst in 2 h
    many = [m for s in range(1, 60) for _, _, m in bursts_of(s)]
    assert 1.6 < statistics.median(many) < 2.4  # median ~2 (the few under 1 are clipped to 1)
    gaps = [b[0] - a[0] for s in range(1, 60) for a, b in zip(bursts_of(s), bursts_of(s)[1:], strict=False)]
    assert 700 < statistics.mean(gaps) < 1100  # Poisson, every ~15 min
    lengths = [e - s for seed in range(1, 20) for s, e, _ in bursts_of(seed)]
    assert min(lengths) >= 120 and max(lengths) <= 300


def bursts_of(seed: int) -> list[tuple[float, float, float]]:
    """The bursts the lognormal-bursts trace draws for `seed` (at 20 max replicas)."""
    return workload._bursts(random.Random(seed * 1_000_003 + 12), 7200.0, 900.0, 20 / 3)


def test_diurnal_has_a_night_a_peak_and_a_steeper_morning_than_evening() -> None:
    t = traces(UNIT, seed=1)["diurnal"]
    units = [x / UNIT for x in samples(t, 60.0)]
    assert max(units[:15]) < 1.2 and max(units[-5:]) < 1.2  # night
    assert 7.5 < max(units) < 9.2
    peak = units.index(max(units))
    rise = next(i for i in range(peak) if units[i] > 7.0) - max(i for i in range(peak) if units[i] < 1.5)
    fall = min(i for i in range(peak, 120) if units[i] < 1.5) - max(i for i in range(peak, 120) if units[i] > 7.0)
    assert rise < fall


def test_long_prompt_trace_has_ten_percent_long_prompts() -> None:
    t = traces(UNIT, scale=0.3)["long-prompt"]
    assert t.rate(0) == 2 * UNIT and t.rate(900 * 0.3) == 5 * UNIT and t.rate(3600 * 0.3) == 2 * UNIT
    reqs = list(arrivals(t, None, 1))
    plain = list(arrivals(t, RequestMix(), 1))
    long_share = sum(r.prompt >= 2500 for r in reqs) / len(reqs)
    plain_share = sum(r.prompt >= 2500 for r in plain) / len(plain)
    assert 0.085 < long_share - plain_share < 0.115
    assert max(r.prompt for r in reqs) == 4096  # clipped
    assert 3300 < statistics.median(r.prompt for r in reqs if r.prompt >= 2500) < 3700


# --- the suite's matrix ---------------------------------------------------------------------------------------


def test_the_suite_is_33_cases_and_filters() -> None:
    cases = suite.matrix()
    assert len(cases) == 33 and len(set(cases)) == 33
    assert sum(c.fault == "none" for c in cases) == 27
    assert {(c.trace, c.cold_start) for c in cases if c.fault != "none"} == {("step", "2m"), ("spike", "2m")}
    assert suite.matrix(["step"], ["30s"], ["none", "never-ready"]) == [suite.Case("step", "30s", "none")]
    assert len(suite.matrix(["spike"], ["2m"])) == 4
    m = suite.Case("step", "5m").model(GPU)
    assert (m.startup_min_s, m.startup_max_s) == (240.0, 360.0)
    assert suite.Case("step").model(GPU) is GPU


# --- faults ---------------------------------------------------------------------------------------------------


def ready_fleet(n: int, fault: Fault | None = None) -> Fleet:
    fleet = Fleet(GPU, n, seed=1, horizon=10_000.0, fault=fault)
    for p in fleet.pods:
        p.ready = True
    return fleet


def test_metrics_dropout_blinds_every_policy_for_its_minute_only() -> None:
    fleet = ready_fleet(2, Fault("metrics-dropout", at=100.0, seconds=60.0))
    for pod in fleet.pods:
        pod.waiting.extend(replica.Request(0.0, 10, 10) for _ in range(90))  # 2x the target of 45 each
    for now, up in ((99.9, True), (100.0, False), (130.0, False), (159.9, False), (160.0, True)):
        assert bool(fleet.scrape(now)) == up and bool(fleet.loads(now)) == up, now
    hpa = Hpa(45.0, 1, 20)
    assert hpa.tick(120.0, fleet) == 2  # no metrics: the HPA keeps the count
    assert hpa.tick(165.0, fleet) == 4
    kubeai = KubeAI(45.0, 1, 20)
    kubeai.tick(90.0, fleet)
    before = list(kubeai.history)
    assert kubeai.tick(110.0, fleet) == 2 and list(kubeai.history) == before  # the sample is skipped


def test_metrics_dropout_in_a_run_hides_the_scrape_exactly_then() -> None:
    seen: list[tuple[float, int]] = []

    class Watch:
        name, interval = "watch", 5.0

        def tick(self, now: float, fleet: Fleet) -> int:
            seen.append((now, len(fleet.scrape(now))))
            return fleet.spec

    trace = traces(UNIT, scale=0.1)["step"]
    simulate(trace, Watch(), GPU, 2, None, 1, fault=Fault.of("metrics-dropout", trace))
    blind = [t for t, n in seen if n == 0]
    assert blind == [t for t, _ in seen if trace.rise_s <= t < trace.rise_s + 60.0]
    assert len(blind) == 12  # every 5 s for a minute


def test_never_ready_pod_never_serves() -> None:
    class Script:
        name, interval = "script", 15.0

        def tick(self, now: float, fleet: Fleet) -> int:
            return 2 if now < 600 else 3

    trace = Trace("const", 1800.0, autoscale_run._constant(4.0), 4.0)
    run = simulate(trace, Script(), GPU, 1, None, 1, fault=Fault("never-ready"))
    assert max(ready for t, _, ready in run.timeline if t < 600) == 1  # the first scale-up's pod never comes
    assert max(ready for _, _, ready in run.timeline) == 2  # the next one does
    assert run.timeline[-1][1:] == (3, 2)
    assert all(r.first_token is not None for r in run.requests)
    # It is billed as a pod that holds a GPU while it tries (a crash-looping or stuck pod does).
    assert run.pod_seconds == pytest.approx(1800.0 + (1800.0 - 15.0) + (1800.0 - 600.0))
    # With `at`, the fault spares scale-ups before it: here the one at 15 s, and hits the one at 600 s.
    later = simulate(trace, Script(), GPU, 1, None, 1, fault=Fault("never-ready", at=300.0))
    assert max(ready for t, _, ready in later.timeline if t < 600) == 2
    assert later.timeline[-1][1:] == (3, 2)


def test_unschedulable_pod_is_reported_pending_then_starts_and_is_billed_once_scheduled() -> None:
    fleet = ready_fleet(1, Fault("unschedulable", seconds=600.0))
    (pod,) = fleet.scale(2, 0.0)
    (other,) = fleet.scale(3, 10.0)  # only the first scale-up's pod is hit
    assert other.pending_until == other.created and other.ready_at < 10.0 + GPU.startup_max_s + 1e-9
    assert pod.pending_until == 600.0 and 600.0 + GPU.startup_min_s <= pod.ready_at <= 600.0 + GPU.startup_max_s
    grace = policies.UNSCHEDULABLE_GRACE_S
    assert fleet.unschedulable(grace - 1, grace) == 0  # the operator's grace before CapacityBlocked
    assert fleet.unschedulable(grace, grace) == 1 and fleet.unschedulable(599.0, grace) == 1
    assert fleet.unschedulable(600.0, grace) == 0 and fleet.pending(600.0) == []
    fleet.account(1000.0)
    assert fleet.pod_seconds == pytest.approx(1000.0 + 990.0 + 400.0)  # Pending time holds no GPU
    spared = ready_fleet(1, Fault("unschedulable", at=100.0, seconds=600.0))
    first, = spared.scale(2, 50.0)
    hit, = spared.scale(3, 100.0)
    assert first.pending_until == 50.0 and hit.pending_until == 700.0
    # Scale-down removes the Pending pod first (ReplicaSet order), before the newer starting one.
    fleet2 = ready_fleet(1, Fault("unschedulable", seconds=600.0))
    pending, = fleet2.scale(2, 0.0)
    starting, = fleet2.scale(3, 5.0)
    fleet2.scale(2, 20.0)
    assert pending not in fleet2.pods and starting in fleet2.pods


def test_unschedulable_pod_in_a_run_starts_after_its_pending_time() -> None:
    class Script:
        name, interval = "script", 15.0

        def tick(self, now: float, fleet: Fleet) -> int:
            return 2

    trace = Trace("const", 1200.0, autoscale_run._constant(4.0), 4.0)
    run = simulate(trace, Script(), GPU, 1, None, 1, fault=Fault("unschedulable", seconds=600.0))
    ready_at = min(t for t, _, ready in run.timeline if ready == 2)
    assert 615.0 + GPU.startup_min_s <= ready_at <= 615.0 + GPU.startup_max_s + 15.0  # sampled every 15 s
    assert run.pod_seconds == pytest.approx(1200.0 + (1200.0 - 615.0))


# --- the replica's new metrics ----------------------------------------------------------------------------------


def test_replica_counters_and_queue_histogram_are_consistent() -> None:
    pod = replica.Replica("p", GPU, 0.0, 0.0)
    reqs = [replica.Request(0.01 * i, 200 + 37 * i, 5 + i % 40) for i in range(200)]  # > max_num_seqs at once
    done: list[replica.Request] = []
    t = 0.0
    mid_checked = False
    for r in reqs:
        t = r.arrival
        pod.step_events(t, done)
        pod.add(r, t)
    while pod.load:
        nxt = pod.step_events(t, done)
        if nxt is None:  # it finished its last request at t
            assert not pod.load
            break
        assert nxt >= t
        t = nxt
        started = sum(r.prefill_start is not None for r in reqs)
        snap = pod.snapshot(t)
        assert snap.histograms["queue"].count == started  # one observation per prefill start
        assert snap.requests == len(done) == pod.completed
        assert snap.prompt_tokens == sum(r.prompt for r in reqs if r.first_token is not None)
        assert snap.kv_usage == snap.running / GPU.max_num_seqs <= 1.0
        mid_checked = mid_checked or 0 < len(done) < len(reqs)
    assert mid_checked
    snap = pod.snapshot(t)
    assert snap.requests == 200 and snap.generation_tokens == sum(r.output for r in reqs)
    assert snap.prompt_tokens == sum(r.prompt for r in reqs) and snap.kv_usage == 0.0
    q = snap.histograms["queue"]
    assert q.count == 200 and q.buckets[-1] == 200
    for r in reqs:  # the queue time is arrival → prefill start, within the TTFT
        assert r.prefill_start is not None and r.first_token is not None
        assert r.arrival <= r.prefill_start <= r.first_token
    assert q.sum == pytest.approx(sum(r.prefill_start - r.arrival for r in reqs if r.prefill_start is not None))
    assert reqs[0].prefill_start == 0.0  # it entered an empty FIFO


def test_flow_from_the_replica_counts_what_it_served() -> None:
    trace = Trace("const", 300.0, autoscale_run._constant(6.0), 6.0)
    window = MetricsWindow(600.0)
    pod = replica.Replica("p", GPU, 0.0, 0.0)
    window.update([pod.snapshot(0.0)], now=0.0)
    reqs = list(arrivals(trace, None, 2))
    done: list[replica.Request] = []
    for r in reqs:
        pod.step_events(r.arrival, done)
        pod.add(r, r.arrival)
    pod.step_events(300.0, done)
    window.update([pod.snapshot(300.0)], now=300.0)
    flow = window.flow()
    assert flow is not None
    assert flow.completed == pytest.approx(len(done) / 300.0)
    assert flow.output_tokens == pytest.approx(sum(r.output for r in done) / 300.0)
    assert flow.arrived == pytest.approx(len(reqs) / 300.0)  # completions plus what it still holds


# --- the kvfleet adapter ----------------------------------------------------------------------------------------


def adapter_observations(monkeypatch: pytest.MonkeyPatch) -> tuple[Kvfleet, list[Observation]]:
    seen: list[Observation] = []

    def fake_decide(policy: Any, obs: Observation, state: Any) -> Any:
        seen.append(obs)
        return SimpleNamespace(state=state, desired_replicas=obs.current_replicas)

    monkeypatch.setattr(policies, "decide", fake_decide)
    kv = autoscale_run.policies(Setup(GPU))[0]
    assert isinstance(kv, Kvfleet)
    return kv, seen


def serve(pod: replica.Replica, until: float, done: list[replica.Request]) -> None:
    """Run a pod through its own events up to `until`."""
    nxt = pod.step_events(pod.last, done)
    while nxt is not None and nxt <= until:
        nxt = pod.step_events(nxt, done)
    pod.step_events(until, done)


def test_kvfleet_adapter_fills_the_new_observation_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    kv, seen = adapter_observations(monkeypatch)
    fleet = ready_fleet(2, Fault("unschedulable", seconds=600.0))
    fleet.scale(3, 0.0)
    a, b = fleet.pods[:2]
    done: list[replica.Request] = []
    for pod in (a, b):
        for i in range(40):
            pod.add(replica.Request(0.0, 300, 50 + i), 0.0)
    kv.tick(0.0, fleet)
    for pod in (a, b):
        serve(pod, 45.0, done)
    kv.tick(45.0, fleet)
    for pod in (a, b):
        for i in range(30):
            pod.add(replica.Request(50.0, 400, 20 + i), 50.0)
        serve(pod, 74.0, done)
    a.add(replica.Request(74.0, 300, 500), 74.0)
    fleet.held.extend(replica.Request(70.0, 10, 10) for _ in range(3))
    kv.tick(75.0, fleet)
    first, second, obs = seen
    assert first.flow is None and first.requests_arrived is None and first.queue_time_p95 is None  # one scrape
    assert second.unschedulable_replicas == 0  # Pending, but within the operator's grace
    assert obs.unschedulable_replicas == 1 and obs.starting_replicas == 1 and obs.ready_replicas == 2
    assert obs.held_requests == 3 and obs.routers_reporting == 1
    assert obs.flow is not None and obs.flow_last is not None and obs.flow.pods == 2
    assert obs.flow.completed == pytest.approx(60 / 30.0)  # the 60 served between the scrapes at 45 and 75
    assert obs.requests_arrived == 60 == a.completed + b.completed - 80
    assert obs.queue_time_p95 is not None and obs.queue_time_p95 > 0
    assert obs.kv_usage == a.kv_usage == 1 / GPU.max_num_seqs
    # A dropout: nothing reports, and the adapter passes no queue and no KV figure.
    fleet.fault = Fault("metrics-dropout", at=80.0, seconds=60.0)
    kv.tick(90.0, fleet)
    blind = seen[-1]
    assert blind.reporting_replicas == 0 and blind.queue_depth is None and blind.kv_usage is None
    assert blind.requests_arrived is None


def test_suite_cli_runs_cases_in_worker_processes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["--suite", "--traces", "step", "--cold-starts", "30s", "--faults", "none", "never-ready",
            "--seeds", "1", "--scale", "0.05", "--jobs", "2", "--out", str(tmp_path)]
    assert autoscale_run.main(argv) == 0
    out = capsys.readouterr().out
    assert "| step / 30s / none | kvfleet |" in out and "| step / 30s / none | kubeai |" in out
    assert "- step / 30s / none: " in out and "bar held in " in out and " of 1 cases" in out
    assert (tmp_path / "results.md").read_text() in out
    assert (tmp_path / "step-30s-none.png").exists()
