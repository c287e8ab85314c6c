"""Shared by the loader tests: broken checkpoints are made by editing a copy of a good tiny one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any


def copy_of(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def read_config(d: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((d / "config.json").read_text(encoding="utf-8"))
    return config


def edit_config(d: Path, **changes: Any) -> None:
    config = read_config(d)
    for key, value in changes.items():
        if value is DELETE:
            del config[key]
        else:
            config[key] = value
    (d / "config.json").write_text(json.dumps(config), encoding="utf-8")


DELETE = object()
