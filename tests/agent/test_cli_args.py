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


def test_abbreviated_flags_are_refused_not_guessed(tmp_path: Path) -> None:
    # argparse would take --api-k for --api-key; the operator's rule against --api-key in extraArgs relies on
    # flags matching whole.
    agent = Path(sys.executable).parent / "kvfleet-agent"
    for argv in (["serve", "--model", str(tmp_path), "--api-k", "secret"], ["model", "init-tiny", "--ar", "qwen2",
                                                                            str(tmp_path / "ckpt")]):
        proc = subprocess.run([str(agent), *argv], capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 2 and "unrecognized arguments" in proc.stderr, proc.stderr
    assert not (tmp_path / "ckpt").exists()
