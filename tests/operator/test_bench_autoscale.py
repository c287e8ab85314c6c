"""bench/autoscale: the simulated replica is faithful to the agent's metrics, and on a shortened step trace the real
decision function never flaps and meets the TTFT target at least as often as the better baseline."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "autoscale"))

import replica
import run as autoscale_run
import scoring
from policies import Hpa
from simulator import Fleet, simulate
from workload import RequestMix, Trace, traces

from kvfleet_contract import metrics as contract
from kvfleet_operator.autoscaling.scrape import MetricsWindow

GPU = replica.PRESETS["gpu-8b"]


def drain(pod: replica.Replica, t: float = 0.0) -> tuple[list[replica.Request], float]:
    """Run one replica through its own events until it holds nothing."""
    done: list[replica.Request] = []
    while pod.load:
        nxt = pod.step_events(t, done)
        if nxt is None:  # nothing scheduled: it must hold nothing
            assert not pod.load
            break
        assert nxt >= t
        t = nxt
    return done, t


def test_replica_serves_everything_and_its_histograms_count_each_request() -> None:
    result = simulate(Trace("const", 300.0, autoscale_run._constant(6.0), 6.0),
                                    autoscale_run._Fixed(), GPU, 1, RequestMix(), seed=3)
    assert result.requests
    for r in result.requests:
        assert r.first_token is not None and r.finish is not None
        assert r.arrival <= r.first_token <= r.finish
    pod = replica.Replica("p", GPU, 0.0, 0.0)
    for i in range(150):  # more than max_num_seqs: some wait for a slot
        pod.add(replica.Request(0.0, 100 + i, 10), 0.0)
    assert pod.snapshot(0.0).waiting == 150 - GPU.max_num_seqs
    done, t = drain(pod)
    firsts = [r.first_token for r in done]
    assert len(done) == 150 and None not in firsts
    snap = pod.snapshot(t)
    ttft = snap.histograms["ttft"]
    assert ttft.count == 150 and ttft.buckets[-1] == 150 and list(ttft.buckets) == sorted(ttft.buckets)
    assert snap.histograms["itl"].count == 150 * 9  # one gap per token after the first
    assert snap.histograms["e2e"].count == 150 and snap.queue_depth == 0


def test_depth_grows_faster_than_load_as_the_autoscaler_assumes() -> None:
    """The 1.5 exponent of autoscaler.QUEUE_DEPTH_EXPONENT, measured on the simulated replica near the target."""
    held = {}
    for rate in (4.0, 8.0):
        trace = Trace("const", 900.0, autoscale_run._constant(rate), rate)
        result = simulate(trace, autoscale_run._Fixed(), GPU, 1, RequestMix(), seed=5)
        held[rate] = sum(r.finish - r.arrival for r in result.requests if r.finish) / 900.0
    assert 2 ** 1.3 < held[8.0] / held[4.0] < 2 ** 1.8


def test_hpa_baseline_counts_a_loading_pod_as_zero_on_scale_up() -> None:
    fleet = Fleet(GPU, 2, seed=1, horizon=100.0)
    for p in fleet.pods:
        p.ready = True
    fleet.scale(3, 0.0)  # one pod loading, no /metrics yet
    for pod in fleet.pods[:2]:
        pod.waiting.extend(replica.Request(0.0, 10, 10) for _ in range(30))
    # Ready pods hold 30 each (ratio 2 at target 15); with the missing pod at 0: 60 / 3 / 15 = 1.33 → ceil(4).
    assert Hpa(15.0, 1, 10).tick(1.0, fleet) == 4


@pytest.fixture(scope="module")
def step_scores() -> list[scoring.Score]:
    setup = autoscale_run.Setup(GPU)
    results = autoscale_run.compare(setup, [traces(setup.unit, scale=0.4)["step"]], seeds=[1])
    return [s for s, _ in results["step"]]


def test_kvfleet_never_flaps_on_the_step(step_scores: list[scoring.Score]) -> None:
    kv = next(s for s in step_scores if s.policy == "kvfleet")
    assert kv.flaps == 0
    assert kv.scale_events > 0  # it did scale: a policy that never moves cannot flap either


def test_kvfleet_meets_the_slo_at_least_as_often_as_the_better_baseline(step_scores: list[scoring.Score]) -> None:
    """As the bar judges it: the share of 1-minute windows whose TTFT p95 met the target."""
    kv = next(s for s in step_scores if s.policy == "kvfleet")
    best = scoring.better_baseline(step_scores)
    assert kv.window_share >= best.window_share, (kv, best)


def test_window_quantile_path_sees_the_simulated_latency() -> None:
    """The simulator feeds kvfleet through the same MetricsWindow quantile path the operator uses."""
    pod = replica.Replica("p", GPU, 0.0, 0.0)
    window = MetricsWindow(60.0)
    window.update([pod.snapshot(0.0)], now=0.0)
    for _ in range(20):
        pod.add(replica.Request(0.0, 500, 20), 0.0)
    done, t = drain(pod)
    window.update([pod.snapshot(t)], now=t)
    ttfts = sorted(r.first_token for r in done if r.first_token is not None)
    p50 = window.quantile("ttft", 0.5)
    # Interpolated inside the bucket that holds the true median, so within that bucket's bounds.
    lo = max((b for b in contract.TTFT_BUCKETS if b < ttfts[10]), default=0.0)
    hi = min(b for b in contract.TTFT_BUCKETS if b >= ttfts[9])
    assert p50 is not None and lo <= p50 <= hi


def test_trace_case_marks_the_windows_the_score_counts_as_missed(capsys: pytest.CaptureFixture[str]) -> None:
    import trace_case
    from policies import Setup, make_policies
    from suite import Case, Runner

    setup, case, seed, scale = Setup(GPU), Case("step", "2m", "none"), 1, 0.2
    assert trace_case.main(["step", "2m", "none", str(seed), "--scale", str(scale), "--decisions", "0", "120"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line[:3].strip().isdigit() and "|" in line]
    # The tracer's own reading of each window must agree with the score's: kvfleet's column marks as over the target
    # exactly the windows the bar counts as missed.
    run = Runner(setup, scale).simulate(case, make_policies(setup)[0], seed)
    met, windows = scoring.window_slo(run.requests, setup.ttft_target)
    kv_cells = [row.split("|")[1] for row in rows]
    assert len(rows) == windows > 0
    assert sum("x" not in cell for cell in kv_cells) == met < windows  # the step loses some windows
    assert any(line.startswith("kvfleet events") and "+" in line for line in out)  # it scaled up
    decisions = [line for line in out if "->" in line]
    assert decisions and all(0 <= float(line.split()[0]) <= 120 for line in decisions)
