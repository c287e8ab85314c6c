"""The CPU GEMM fast path: oneDNN-prepacked weights give fp32 results and are used after loading."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvfleet_agent import LLM
from kvfleet_agent.layers.linear import can_pack, linear, pack

pytestmark = pytest.mark.skipif(not can_pack(torch.empty(1, 1)), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_fp32_accurate(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=g), torch.randn(200, 96, generator=g)
    b = torch.randn(200, generator=g) if bias else None
    want = x.double() @ w.double().t() + (b.double() if b is not None else 0)
    got = linear(x, w, b, packed=pack(w))
    assert got.dtype == torch.float32 and got.shape == (rows, 200)
    # fp32 accuracy (a bf16 shortcut would be off by ~1e-2 here)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)


def test_packed_linear_takes_a_strided_input() -> None:
    g = torch.Generator().manual_seed(7)
    wide, w = torch.randn(8, 160, generator=g), torch.randn(40, 96, generator=g)
    x = wide[:, 32:128]  # rows not contiguous, as for a q/k/v slice of a packed projection
    torch.testing.assert_close(linear(x, w, packed=pack(w)), x @ w.t(), atol=1e-4, rtol=1e-5)


def test_loaded_fp32_model_uses_packed_weights_and_bf16_does_not(tiny_checkpoint: Callable[..., str]) -> None:
    path = tiny_checkpoint("qwen2")
    model = LLM(model=path, dtype="float32").engine.runner.model
    linears = [m for m in model.modules() if hasattr(m, "pack_weights")]
    assert linears and all(getattr(m, "packed", None) is not None for m in linears)
    model16 = LLM(model=path, dtype="bfloat16").engine.runner.model
    assert all(getattr(m, "packed", None) is None for m in model16.modules() if hasattr(m, "pack_weights"))
