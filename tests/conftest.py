"""Shared fixtures: tiny random checkpoints (with a locally trained tokenizer), an LLM on one, and GPU skipping."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from llm_helpers import ENGINE_OPTIONS

from kvfleet_agent.llm import LLM
from kvfleet_agent.models.tiny import ARCHS, init_tiny

# Asserts in the shared helper modules report their operands too, as the tests' own asserts do.
pytest.register_assert_rewrite("bookkeeping_helpers", "kernel_helpers", "loader_helpers")


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


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint: Callable[..., str]) -> Path:
    """The tiny llama checkpoint; tests that need a variant of it edit a copy."""
    return Path(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def llm(ckpt: Path) -> LLM:
    """An LLM on `ckpt` with llm_helpers.ENGINE_OPTIONS, one per test module."""
    return LLM(model=str(ckpt), **ENGINE_OPTIONS)


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """For the loader tests: a good checkpoint per architecture and a 2-shard llama; tests edit copies, never these."""
    root = tmp_path_factory.mktemp("loader_ckpts")
    out = {arch: Path(init_tiny(str(root / arch), arch, seed=11)) for arch in ARCHS}
    out["llama-sharded"] = Path(init_tiny(str(root / "llama-sharded"), "llama", seed=11, num_shards=2))
    return out
