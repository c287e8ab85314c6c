"""Shared fixtures: tiny random checkpoints (with a locally trained tokenizer) and GPU skipping."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvfleet_agent.models.tiny import init_tiny


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` tests on machines without CUDA rather than failing them."""
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """Factory: a tiny random checkpoint of the given architecture, made once per session and arguments."""
    made: dict[tuple[Any, ...], str] = {}

    def make(arch: str = "llama", seed: int = 0, **overrides: Any) -> str:
        key = (arch, seed, tuple(sorted(overrides.items())))
        if key not in made:
            out: Path = tmp_path_factory.mktemp(f"tiny-{arch}")
            made[key] = init_tiny(str(out), arch=arch, seed=seed, **overrides)
        return made[key]

    return make
