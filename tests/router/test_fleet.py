"""The router's view of a replica: scraped gauges, corrected for what finished since, and readiness releasing holds."""

from __future__ import annotations

from kvfleet_contract import metrics as contract
from kvfleet_router.fleet import Fleet, Replica, parse_gauges


def test_requests_that_finished_since_the_scrape_no_longer_count() -> None:
    r = Replica("a", "http://a", waiting=2.0, running=3.0, in_flight=5)
    assert r.load().load == 5
    for _ in range(4):  # four of ours finished after the scrape counted them
        r.finished()
    assert r.in_flight == 1 and r.load().load == 1  # 5 scraped - 4 gone, and our own 1 in flight
    for _ in range(3):
        r.finished()
    assert r.load().waiting == 0 and r.load().running == 0  # never below zero


def test_gauges_are_read_by_the_contract_names() -> None:
    text = (f"# TYPE {contract.REQUESTS_WAITING} gauge\n{contract.REQUESTS_WAITING}{{model=\"m\"}} 4.0\n"
            f"# TYPE {contract.REQUESTS_RUNNING} gauge\n{contract.REQUESTS_RUNNING}{{model=\"m\"}} 2.0\n"
            f"# TYPE {contract.KV_CACHE_USAGE} gauge\n{contract.KV_CACHE_USAGE}{{model=\"m\"}} 0.5\n"
            "# TYPE other gauge\nother 9.0\n")
    assert parse_gauges(text) == {contract.REQUESTS_WAITING: 4.0, contract.REQUESTS_RUNNING: 2.0,
                                  contract.KV_CACHE_USAGE: 0.5}


def test_the_first_ready_replica_of_a_model_releases_its_held_requests() -> None:
    woken: list[str] = []
    fleet = Fleet(on_ready=woken.append)
    fleet.set_endpoints("m", {"a": "http://a", "b": "http://b"})
    a, b = fleet.models["m"]["a"], fleet.models["m"]["b"]
    fleet.mark("m", a, True)
    fleet.mark("m", b, True)  # not the first: nothing more to release
    assert woken == ["m"] and [r.name for r in fleet.ready("m")] == ["a", "b"]
    fleet.set_endpoints("m", {"a": "http://a", "c": "http://c"})  # a keeps its state, b goes, c starts unready
    assert [r.name for r in fleet.ready("m")] == ["a"] and fleet.models["m"]["a"] is a
