"""Quantized engines on a GPU: each format takes its kernel (Triton W8A16/W4A16, FP8 _scaled_mm) and computes what
its dequantized weights do, in bf16."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_quant_engine import OPTIONS, dequantized_copy, hf_ckpt, prompt_logprobs

from kvfleet_agent import LLM

pytestmark = pytest.mark.gpu  # conftest skips these without CUDA ("needs a CUDA GPU")
__all__ = ["hf_ckpt"]  # the module fixture, shared with the CPU tests
GPU = {**OPTIONS, "dtype": "bfloat16", "device": "cuda", "enforce_eager": False}
PATHS = {"int8": "triton-w8a16", "int4": "triton-w4a16", "fp8": "fp8-scaled-mm"}


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_each_format_runs_its_gpu_kernel_and_matches_its_dequantized_weights(
        hf_ckpt: Path, tmp_path: Path, method: str, tiny_checkpoint: Callable[..., str]) -> None:
    if method == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 matmuls need compute capability 8.9 or later")
    quant = LLM(model=str(hf_ckpt), quantization=method, **GPU)
    paths = {m.qmm.path for m in quant.engine.runner.model.modules() if getattr(m, "qmm", None) is not None}
    assert paths == {PATHS[method]}
    reference = LLM(model=str(dequantized_copy(hf_ckpt, tmp_path / "deq", method)), **GPU)
    got, want = prompt_logprobs(quant), prompt_logprobs(reference)
    # bf16 throughout; FP8 also rounds each activation to E4M3 (dynamic per-token scales).
    bound = 0.5 if method == "fp8" else 0.1
    assert (got - want).abs().max().item() < bound
