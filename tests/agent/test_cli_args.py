"""The agent CLI reads arguments from @FILE (one per line), as the operator's extraArgs ConfigMap passes them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_arguments_from_a_file(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    args = tmp_path / "extra-args"
    args.write_text(f"{out}\n--arch\nqwen2\n")  # what builders.args_config_map writes
    agent = Path(sys.executable).parent / "kvfleet-agent"
    proc = subprocess.run([str(agent), "model", "init-tiny", f"@{args}"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"
