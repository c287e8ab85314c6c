"""The tiers' cost report end to end on two tiny random checkpoints: its JSON adds up, class by class and tier by tier,
and its held-out text is the text train-tiny held out."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvfleet_agent.models.stdlib_corpus import is_eval, source_files
from kvfleet_router.cost_workload import held_out_files, quotas

REQUESTS = 20


def test_the_held_out_files_are_the_ones_train_tiny_holds_out() -> None:
    assert held_out_files() == [p for p in source_files() if is_eval(p)]
    assert held_out_files()  # a stdlib without held-out files would make every prompt fail to generate


def test_the_report_adds_up(tiny_checkpoint: Callable[..., str], tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    # Length scale 0.2: the tiny tokenizer spends about 1.5 characters a token, its context is 512.
    proc = subprocess.run([sys.executable, "-m", "kvfleet_router.cost_report", "--small", tiny_checkpoint("llama"),
                           "--large", tiny_checkpoint("llama", seed=1), "--requests", str(REQUESTS),
                           "--sample-rate", "1.0", "--length-scale", "0.2", "--json", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "replica-seconds (busy time)" in proc.stdout
    f: dict[str, Any] = json.loads(out.read_text())
    classes = f["classes"]
    mix = quotas(REQUESTS)
    assert sum(mix.values()) == REQUESTS and mix == {"simple": 12, "medium": 4, "complex": 3, "expert": 1}
    assert f["requests_per_class"] == mix and {c: classes[c]["requests"] for c in mix} == mix
    assert f["errors"] == {"tiered": 0, "top_only": 0}
    # The classifier's mapping: simple and medium on code-small, complex and expert unmatched on code-large.
    for cls, assigned, tier in (("simple", "simple", "code-small"), ("medium", "medium", "code-small"),
                                ("complex", "unmatched", "code-large"), ("expert", "unmatched", "code-large")):
        assert classes[cls]["assigned"] == {assigned: mix[cls]}, classes[cls]
        assert classes[cls]["served_by"] == {tier: mix[cls]}, classes[cls]
    lower, top = mix["simple"] + mix["medium"], mix["complex"] + mix["expert"]
    assert f["router_tier_requests"] == {"simple": {"code-small": 12, "code-large": 0},
                                         "medium": {"code-small": 4, "code-large": 0},
                                         "unmatched": {"code-small": 0, "code-large": top}}
    # The agents' own counters: each lower-tier answer replayed once on the top tier, then all 20 on it alone.
    assert f["runs"]["tiered"]["agent_requests"] == {"code-small": lower, "code-large": top + lower}
    assert f["runs"]["top_only"]["agent_requests"] == {"code-small": 0, "code-large": REQUESTS}
    per_k = f["replica_seconds_per_1000"]
    assert per_k["tiered"]["code-small"] > 0 and per_k["tiered"]["code-large"] > 0
    assert per_k["top_only"]["code-large"] > 0 and "code-small" not in per_k["top_only"]  # a fleet of code-large
    cpu = f["cpu_seconds_per_1000"]
    assert cpu["tiered"]["total"] > 0 and cpu["top_only"]["total"] > 0
    assert f["ratio"]["total"] == per_k["tiered"]["total"] / per_k["top_only"]["total"]
    assert f["models"]["code-large"]["cost"] == 1.0  # two checkpoints of one shape: the parameter ratio is 1
    # Every sampled (here: every) lower-tier answer replayed and scored, none after the drain.
    assert f["replays"] == lower and f["late_replays"] == 0
    assert f["verifications"] == {"scored": lower}
    assert f["monitor_at_or_below"]["n"] == lower == f["recomputed_below"]["n"]
    assert sum(classes[c]["monitor_at_or_below"]["n"] for c in ("simple", "medium")) == lower
    lo, hi = f["monitor_at_or_below"]["wilson95"]
    assert lo <= f["monitor_at_or_below"]["share"] <= hi
    assert f["promoted"] is False and f["promoted_requests"] == 0
