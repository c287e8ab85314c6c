"""On-load INT8/INT4 quantization, the canonical QuantWeight, and the CPU kernels against the dequantized reference."""

from __future__ import annotations

import pytest
import torch

from kvfleet_agent.layers.quant.matmul import QuantMatmul
from kvfleet_agent.layers.quant.onload import int4_group, quantize_int4, quantize_int8
from kvfleet_agent.layers.quant.weight import QuantWeight, cat_rows

# bf16 activations (W8A16 / W4A16): about 2^-9 relative per element, a few of them over a sum.
REL = 1e-2


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


def weight(out: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, cols, generator=g) * 0.05 + torch.randn(out, 1, generator=g) * 0.01


def test_int8_is_symmetric_per_channel_and_rounds_to_nearest() -> None:
    w = weight(48, 64)
    qw = quantize_int8(w)
    assert qw.q.dtype == torch.int8 and qw.zero is None and qw.scale.shape == (48, 1) and qw.group_size == 64
    assert int(qw.q.abs().max()) == 127  # each row's largest weight lands on the grid's end
    err = (qw.dequantize() - w).abs()
    assert bool((err <= qw.scale / 2 + 1e-7).all()), "round to nearest: at most half a step off"


def test_int4_groups_span_each_groups_range_with_an_integer_zero() -> None:
    w = weight(32, 256) + 0.03  # off-centre groups: the zero point is not 8
    qw = quantize_int4(w)
    assert qw.group_size == 128 and qw.scale.shape == (32, 2) and qw.zero is not None
    assert int(qw.q.min()) >= 0 and int(qw.q.max()) <= 15
    assert torch.equal(qw.zero, qw.zero.round()) and bool((qw.zero != 8).any())
    err = (qw.dequantize() - w).abs().view(32, 2, 128)
    assert bool((err <= qw.scale[..., None] / 2 + 1e-6).all())


@pytest.mark.parametrize(("cols", "group"), [(256, 128), (704, 64), (96, 32), (176, 16)])
def test_int4_takes_the_largest_group_that_divides_the_inputs(cols: int, group: int) -> None:
    assert int4_group(cols) == group


def test_int4_refuses_inputs_no_group_divides_and_names_the_fix() -> None:
    with pytest.raises(ValueError, match=r"multiple of 16.*--quantization int8"):
        int4_group(100)


def test_narrow_then_dequantize_equals_dequantize_then_narrow() -> None:
    qw = quantize_int4(weight(32, 256))
    dense = qw.dequantize()
    assert torch.equal(qw.narrow(0, 8, 16).dequantize(), dense[8:24])
    assert torch.equal(qw.narrow(1, 128, 128).dequantize(), dense[:, 128:])
    per_channel = quantize_int8(weight(16, 64))
    assert torch.equal(per_channel.narrow(1, 32, 32).dequantize(), per_channel.dequantize()[:, 32:])


def test_a_shard_that_would_split_a_group_is_refused() -> None:
    with pytest.raises(ValueError, match="split a quantization group of 128 columns"):
        quantize_int4(weight(16, 256)).narrow(1, 64, 128)


def test_act_order_columns_keep_their_groups_when_narrowed() -> None:
    base = quantize_int4(weight(16, 128), group_size=32)
    perm = torch.randperm(128, generator=torch.Generator().manual_seed(3))
    shuffled = QuantWeight(q=base.q[:, perm], scale=base.scale, zero=base.zero, bits=4, group_size=32,
                           g_idx=torch.arange(128)[perm] // 32)
    assert torch.equal(shuffled.dequantize(), base.dequantize()[:, perm])
    assert torch.equal(shuffled.narrow(1, 40, 50).dequantize(), shuffled.dequantize()[:, 40:90])


def test_cat_rows_stacks_parts_and_refuses_different_grids() -> None:
    a, b = quantize_int8(weight(16, 64, 1)), quantize_int8(weight(8, 64, 2))
    assert torch.equal(cat_rows([a, b]).dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    with pytest.raises(ValueError, match="quantized differently"):
        cat_rows([a, quantize_int4(weight(16, 64))])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_cpu_int8_kernel_matches_the_dequantized_weight(dtype: torch.dtype, rows: int) -> None:
    qw = quantize_int8(weight(96, 256))
    mm = QuantMatmul(qw, dtype)
    assert mm.path == "cpu-int8" and mm.dense is None
    x = torch.randn(rows, 256).to(dtype)
    y = mm(x)
    assert y.dtype == dtype and y.shape == (rows, 96)
    assert rel_err(y, x.float() @ qw.dequantize().T) < REL
    assert mm.nbytes < 96 * 256 * 4 / 3  # int8 values, fp32 scales: about a quarter of fp32


@pytest.mark.parametrize("rows", [4, 40])  # the kernel, and a prefill-sized step that dequantizes for the step
def test_cpu_int8_kernel_applies_a_zero_point(rows: int) -> None:
    qw = quantize_int8(weight(32, 64))
    shifted = QuantWeight(q=qw.q, scale=qw.scale, zero=torch.full((32, 1), 3.0), bits=8, group_size=64)
    mm = QuantMatmul(shifted, torch.float32)
    assert mm.path == "cpu-int8"
    x = torch.randn(rows, 64)
    assert rel_err(mm(x), x @ shifted.dequantize().T) < REL


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_cpu_int4_kernel_matches_the_dequantized_weight(rows: int) -> None:
    qw = quantize_int4(weight(96, 256) + 0.02)
    mm = QuantMatmul(qw, torch.float32)
    assert mm.path == "cpu-int4"
    x = torch.randn(rows, 256)
    assert rel_err(mm(x), x @ qw.dequantize().T) < REL
    assert mm.nbytes < 96 * 256 * 4 / 6  # two values a byte, bf16 scales and zeros per group of 128


def test_cpu_int4_kernel_runs_act_order_by_permuting_the_activations() -> None:
    base = quantize_int4(weight(32, 128), group_size=32)
    perm = torch.randperm(128, generator=torch.Generator().manual_seed(5))
    act_order = QuantWeight(q=base.q[:, perm], scale=base.scale, zero=base.zero, bits=4, group_size=32,
                            g_idx=torch.arange(128)[perm] // 32)
    mm = QuantMatmul(act_order, torch.float32)
    assert mm.path == "cpu-int4" and mm.perm is not None
    x = torch.randn(3, 128)
    assert rel_err(mm(x), x @ act_order.dequantize().T) < REL


def test_cpu_int4_kernel_takes_a_signed_grid() -> None:
    qw = quantize_int4(weight(32, 128))
    signed = QuantWeight(q=qw.q - 8, scale=qw.scale, zero=None if qw.zero is None else qw.zero - 8, bits=4,
                         group_size=128)
    mm = QuantMatmul(signed, torch.float32)
    x = torch.randn(2, 128)
    assert rel_err(mm(x), x @ signed.dequantize().T) < REL


@pytest.mark.parametrize(("qw", "why"), [
    (quantize_int8(weight(16, 100)), "the int8 kernel reads K in steps of 8"),
    (quantize_int4(weight(24, 64)), "the int4 kernel needs 16 | out"),
    (quantize_int4(weight(32, 176)), "group 16 has no CPU kernel"),
])
def test_weights_no_kernel_fits_run_dequantized_and_stay_exact(qw: QuantWeight, why: str) -> None:
    mm = QuantMatmul(qw, torch.float32)
    assert mm.path == "dense" and mm.dense is not None, why
    x = torch.randn(3, qw.shape[1])
    torch.testing.assert_close(mm(x), x @ qw.dequantize().T, rtol=1e-5, atol=1e-5)


CHILD = """
import torch
from kvfleet_agent.layers.quant.matmul import QuantMatmul
from kvfleet_agent.layers.quant.onload import quantize_int4, quantize_int8
g = torch.Generator().manual_seed(0)
w = torch.randn(48, 128, generator=g) * 0.05
x = torch.randn(3, 128, generator=g)
for qw, path in ((quantize_int8(w), "triton-w8a16"), (quantize_int4(w, 32), "triton-w4a16")):
    mm = QuantMatmul(qw, torch.float32)
    assert mm.path == path, mm.path
    err = float((mm(x) - x @ qw.dequantize().T).abs().max())
    assert err < 1e-4, (path, err)
    print(path, "ok")
"""


def test_where_triton_runs_the_weights_take_its_dequant_gemms() -> None:
    """The GPU path, chosen and exact, through Triton's interpreter (KVFLEET_FORCE_TRITON=1 on CPU tensors)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "KVFLEET_FORCE_TRITON": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["triton-w8a16", "ok", "triton-w4a16", "ok"]


def test_on_load_fp8_keeps_e4m3_values_and_a_scale_per_row() -> None:
    from kvfleet_agent.layers.quant.onload import quantize_fp8

    w = weight(16, 64)
    qw = quantize_fp8(w)
    assert qw.is_fp8 and qw.scale.shape == (16, 1) and qw.zero is None
    assert float(qw.q.float().abs().amax(dim=1).min()) == 448.0
    rel = (qw.dequantize() - w).abs() / w.abs().clamp(min=1e-3)
    assert float(rel.median()) < 2**-4  # three mantissa bits: half a step is 2^-4 of the value at most
    assert QuantMatmul(qw, torch.float32).path == "dense"  # no FP8 matmul on CPU: it runs dequantized
