"""The bf16-vs-fp32 agreement bench: kvfleet run both ways on one float32 checkpoint, agreement per pair."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kvfleet_agent.bench import dtype_agreement

# A stand-in for the shared harness's workload.py: the same two functions, a few short requests.
WORKLOAD = '''
def make_model(name, out_dir, seed=0, dtype="float32"):
    return out_dir

def requests(workload="cpu-mix", seed=1, vocab=32000):
    return [{"prompt_ids": [5 + i, 17, 300, 42, 8 + i], "max_new_tokens": 6 + i} for i in range(3)]
'''


def test_bfloat16_outputs_are_compared_with_float32_ones(tiny_checkpoint: Callable[..., str], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    workload = tmp_path / "workload.py"
    workload.write_text(WORKLOAD)
    out = tmp_path / "agreement.json"
    assert dtype_agreement.main(["--model-dir", tiny_checkpoint("llama"), "--workload-py", str(workload),
                                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["outputs"], r["against"]) for r in rows] == [("kvfleet bfloat16", "kvfleet float32")]
    assert 0.0 <= rows[0]["requests"] <= 1.0 and 0.0 <= rows[0]["tokens"] <= 1.0
    assert "3 requests, greedy" in capsys.readouterr().out
