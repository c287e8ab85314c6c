"""alerts/kvfleet-rules.yaml: a valid PrometheusRule whose rules promtool checks, and whose promtool unit tests pass."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml
from prom_helpers import ROOT, prometheus_bin

RULES = ROOT / "alerts" / "kvfleet-rules.yaml"


def rule_spec(dest: Path) -> Path:
    """The PrometheusRule's spec (promtool's own format) written to dest/kvfleet-rules.spec.yaml."""
    doc = yaml.safe_load(RULES.read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    out = dest / "kvfleet-rules.spec.yaml"
    out.write_text(yaml.safe_dump(doc["spec"]))
    return out


def test_rules_pass_promtool_check_and_every_alert_has_a_unit_test(tmp_path: Path) -> None:
    spec = rule_spec(tmp_path)
    check = subprocess.run([prometheus_bin("promtool"), "check", "rules", str(spec)], capture_output=True, text=True,
                           timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    alerts = {r["alert"] for g in yaml.safe_load(spec.read_text())["groups"] for r in g["rules"] if "alert" in r}
    tests = yaml.safe_load((ROOT / "alerts" / "kvfleet-rules.test.yaml").read_text())["tests"]
    fired = {a["alertname"] for t in tests for a in t["alert_rule_test"] if a.get("exp_alerts")}
    assert fired == alerts  # each alert is shown to fire at least once (and the same tests show who does not)


def test_promtool_unit_tests_pass(tmp_path: Path) -> None:
    rule_spec(tmp_path)
    shutil.copy(ROOT / "alerts" / "kvfleet-rules.test.yaml", tmp_path)
    run = subprocess.run([prometheus_bin("promtool"), "test", "rules", "kvfleet-rules.test.yaml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout
