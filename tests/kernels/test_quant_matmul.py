"""W8A16/W4A16 Triton matmuls and FP8 linear against their fp32 references: small cases on CPU, 8B shapes on a GPU."""

# Tolerances (kernel_helpers.REL_TOL, ‖y − ref‖ / ‖ref‖): float32 1e-5, since the kernel's dequantized weights
# equal the reference's bit for bit and only the summation order differs (~2e-7 seen); float16 2e-3, one
# rounding of each weight and of y to 2^-11 (~3e-4 seen); bfloat16 1e-2, the same at 2^-8 (~3e-3 seen; the
# interpreter's conversion to bfloat16 truncates, up to 2^-7). FP8 against the unquantized reference: 6e-2,
# since E4M3 rounds each activation by up to 2^-4 (~2.5e-2 seen); against the emulated per-token quantization
# it computes: REL_TOL of the output dtype.

from __future__ import annotations

import io
import re
import subprocess
import tempfile
from collections.abc import Callable
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
from kernel_helpers import REL_TOL, assert_matches, device_gen, randn, rel_err, small_case_runner, triton_ops

from kvfleet_kernels import quant_pack as qp

pytest.importorskip("triton")

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
Run = Callable[..., None]
FP8_TOL = 6e-2


@pytest.fixture(scope="module")
def small() -> Run:
    """Runs a check on the small cases: in-process on a GPU, else in Triton's interpreter (a worker process)."""
    return small_case_runner()


def canonical(g: torch.Generator, bits: int, n: int, k: int, gs: int,
              asym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A random canonical weight: int4 zeros are integers (AWQ/GPTQ, on-load int4), int8's fractional."""
    dev, groups = g.device, k // gs
    lo, hi = (-128, 128) if bits == 8 else (0, 16)
    q = torch.randint(lo, hi, (n, k), generator=g, device=dev).to(torch.int8)
    scale = torch.rand((n, groups), generator=g, device=dev) * 0.02 + 0.002
    if not asym:
        return q, scale, None
    if bits == 4:
        return q, scale, torch.randint(0, 16, (n, groups), generator=g, device=dev).to(torch.float32)
    return q, scale, torch.randn((n, groups), generator=g, device=dev) * 3


def check_matmul(device: torch.device, bits: int, dtype: torch.dtype, m: int, n: int, k: int, gs: int,
                 asym: bool, seed: int, tiles: tuple[int, ...] | None = None, lead: tuple[int, ...] = ()) -> None:
    g = device_gen(device, seed)
    q, scale, zero = canonical(g, bits, n, k, gs, asym)
    x = randn((*lead, m, k + 8), g, dtype)[..., 4:k + 4]  # a strided view: rows k + 8 apart
    ops = triton_ops("quant_matmul")
    packed = (ops.pack_int8 if bits == 8 else ops.pack_int4)(q, scale, zero, gs)
    matmul = ops.w8a16_matmul if bits == 8 else ops.w4a16_matmul
    got = matmul(x, packed, tiles=None if tiles is None else ops.Tiles(*tiles))
    assert got.dtype == dtype and got.shape == (*lead, m, n)
    assert_matches(got.float(), qp.ref_w8a16(x.float(), q, scale, zero, gs), dtype)


# ---------------------------------------------------------------------------------------------
# CPU, Triton's interpreter


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("gs", [32, 64, 128, 256])  # 256 = in: one scale per output channel
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize(("m", "n"), [(1, 96), (3, 136), (17, 192)])  # decode (split-K), ragged out, small batch
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_matches_reference(small: Run, bits: int, gs: int, asym: bool, m: int, n: int,
                                  dtype: torch.dtype) -> None:
    small(check_matmul, bits, dtype, m, n, 256, gs, asym, seed=bits + gs + m)


@pytest.mark.parametrize("bits", [8, 4])
def test_float16_prefill_tiles_splits_and_leading_dims(small: Run, bits: int) -> None:
    small(check_matmul, bits, torch.float16, 80, 160, 256, 64, True, seed=1)  # M > 64: the prefill tiles
    for swap in (False, True):  # K split 3, 3, 2 tiles; the weight as either operand
        small(check_matmul, bits, torch.float16, 5, 96, 256, 128, True, seed=2, tiles=(16, 32, 32, 3, 4, 2, swap))
    small(check_matmul, bits, torch.bfloat16, 4, 64, 192, 192, False, seed=3, lead=(2,))  # K not a power of two


def check_empty_and_supports(device: torch.device) -> None:
    ops = triton_ops("quant_matmul")
    g = device_gen(device, 0)
    packed = ops.pack_int4(*canonical(g, 4, 64, 128, 32, True), 32)
    assert ops.w4a16_matmul(torch.empty(0, 128, device=device), packed).shape == (0, 64)
    with pytest.raises(ValueError, match="inputs"):
        ops.w4a16_matmul(torch.empty(1, 64, device=device), packed)
    with pytest.raises(ValueError, match="block_k"):  # a K tile across two groups of 32
        ops.w4a16_matmul(torch.empty(1, 128, device=device), packed, tiles=ops.Tiles(16, 32, 64, 1, 4, 2))


def test_empty_batch_and_bad_arguments(small: Run) -> None:
    small(check_empty_and_supports)


def test_supports_follows_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFLEET_FORCE_TRITON", raising=False)
    assert not qp.supports(torch.ones(2, 8))  # CPU tensors take the caller's reference unless forced
    assert not qp.supports(torch.ones(2, 8, dtype=torch.float64))
    if torch.cuda.is_available():
        assert qp.supports(torch.ones(2, 8, device=CUDA, dtype=torch.bfloat16))


def test_tile_choice() -> None:
    ops = triton_ops("quant_matmul")
    for m, n, k, gs in ((1, 4096, 4096, 4096), (1, 14336, 4096, 128), (16, 4096, 14336, 128), (64, 6144, 4096, 32)):
        for bits in (8, 4):
            t = ops.choose_tiles(m, n, k, gs, bits, torch.bfloat16, 132)
            k_tiles, programs = k // t.block_k, -(-n // t.block_n) * t.split_k
            assert t.block_m == (16 if m <= 16 else 64) and min(gs, k) % t.block_k == 0
            assert programs >= 132 and k_tiles // t.split_k >= ops.MIN_TILES_PER_SPLIT  # fills the GPU, no tiny splits
    big = ops.choose_tiles(2048, 14336, 4096, 128, 4, torch.bfloat16, 132)
    assert (big.block_m, big.block_n, big.block_k, big.split_k) == (128, 128, 64, 1)
    assert ops.choose_tiles(1, 4096, 4096, 32, 4, torch.bfloat16, 132).block_k == 32  # a tile within a group


# ---------------------------------------------------------------------------------------------
# Packing (plain PyTorch)


@pytest.mark.parametrize("asym", [False, True])
def test_pack_round_trips_and_layouts(asym: bool) -> None:
    g = device_gen(CPU, 5)
    q8, s, z = canonical(g, 8, 48, 128, 32, asym)
    p8 = qp.pack_int8(q8, s, z, 32)
    assert p8.qweight.dtype == torch.uint8 and p8.shape == (48, 128) and p8.scale.shape == (4, 48)
    assert torch.equal(qp.unpack_int8(p8), q8) and torch.equal(p8.scale, s.t())
    assert torch.equal(p8.qweight[0, 0].to(torch.int16), q8[0, 0].to(torch.int16) + 128)  # offset-binary
    assert p8.zero is None if z is None else p8.zero is not None and torch.equal(p8.zero, z.t())
    q4 = canonical(g, 4, 48, 128, 32, asym)[0]
    p4 = qp.pack_int4(q4, s, z, 32)
    assert p4.qweight.shape == (48, 64) and p4.shape == (48, 128) and torch.equal(qp.unpack_int4(p4), q4)
    assert int(p4.qweight[3, 5]) == int(q4[3, 10]) | int(q4[3, 11]) << 4  # low nibble first


def test_dequantize_and_validation() -> None:
    g = device_gen(CPU, 6)
    q, s, z = canonical(g, 4, 16, 64, 32, True)
    assert z is not None
    want = (q.float() - z.repeat_interleave(32, 1)) * s.repeat_interleave(32, 1)
    assert torch.equal(qp.dequantize(q, s, z, 32), want)
    with pytest.raises(ValueError, match="divide"):
        qp.pack_int8(q, s, z, 48)
    with pytest.raises(ValueError, match="multiple of 16"):
        qp.pack_int8(q[:, :48], s.repeat(1, 2)[:, :2], None, 24)
    with pytest.raises(ValueError, match=r"0\.\.15"):
        qp.pack_int4(q - 1, s, z, 32)
    with pytest.raises(ValueError, match="even"):
        qp.pack_int4(q[:, :63], s[:, :1], None, 63)
    with pytest.raises(ValueError, match="must be"):
        qp.pack_int4(q, s[:, :1], None, 32)


# ---------------------------------------------------------------------------------------------
# FP8: the reference on CPU, and torch._scaled_mm where it runs (CPU builds have it too)


def fp8_case(device: torch.device, m: int, n: int, k: int, dtype: torch.dtype, per_channel: bool,
             seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = device_gen(device, seed)
    w = randn((n, k), g, torch.float32, 0.05)
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
    w_scale = amax / qp.FP8_MAX
    w_fp8 = (w / (w_scale if per_channel else w_scale[0])).to(qp.FP8)
    x = randn((m, k), g, dtype)
    x[0, 3] = 40.0  # an outlier in one token only: per-token scales keep the others' resolution
    return x, w_fp8, w_scale


def test_fp8_activation_quantization_per_token() -> None:
    x = randn((5, 64), device_gen(CPU, 1), torch.bfloat16) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 5.0])[:, None]
    x_fp8, s = qp.quantize_fp8_per_token(x)
    assert x_fp8.dtype == qp.FP8 and s.shape == (5, 1)
    assert torch.equal(x_fp8[3].float(), torch.zeros(64))  # an all-zero row stays zero (no 0/0)
    assert torch.equal(x_fp8.float().abs().amax(dim=1)[[0, 1, 2, 4]], torch.full((4,), qp.FP8_MAX))
    err = (x_fp8.float() * s - x.float()).abs()
    assert (err <= 2 ** -4 * x.float().abs() + 2 ** -10 * s).all()  # half an E4M3 step; subnormals absolutely


@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_reference_and_paths_on_cpu(per_channel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    x, w_fp8, w_scale = fp8_case(CPU, 7, 48, 64, torch.bfloat16, per_channel, seed=2)
    dense = w_fp8.float() * (w_scale if per_channel else w_scale[0])
    want = x.float() @ dense.t()
    assert rel_err(qp.ref_fp8_linear(x, w_fp8, w_scale).float(), want) < REL_TOL[torch.bfloat16]
    assert torch.equal(qp.fp8_linear(x, w_fp8, w_scale), qp.ref_fp8_linear(x, w_fp8, w_scale))  # no fast path here
    emulated = qp.emulate_fp8_linear(x.float(), w_fp8, w_scale)
    assert 1e-3 < rel_err(emulated, want) < FP8_TOL  # activation rounding shows, within E4M3's step
    for mode in ("rowwise", "epilogue"):
        monkeypatch.setitem(qp._MODES, ("cpu", torch.bfloat16), mode)
        try:
            got = qp.fp8_linear(x[None], w_fp8, w_scale, scaled_mm=True)[0]
        except (RuntimeError, NotImplementedError) as e:
            pytest.skip(f"this torch build has no CPU _scaled_mm: {e}")
        assert rel_err(got.float(), emulated) < REL_TOL[torch.bfloat16]


# ---------------------------------------------------------------------------------------------
# Without a GPU: the 16-bit tiles compile for the H200 (sm_90) without spills, or with the few bytes measured
# harmless: int8 decode spills 16 bytes under Triton 3.9's ptxas, yet ran 4-8% faster on the H200 (Triton 3.6)
# than the spill-free swapped tile.
STACK_ALLOWED = {"DECODE_INT8": 64}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the gpu tests compile and run the kernels")
@pytest.mark.parametrize("regime", ["DECODE_INT8", "DECODE_INT4", "SMALL", "PREFILL_INT8", "PREFILL_INT4"])
def test_tiles_compile_without_spills(regime: str) -> None:
    target = pytest.importorskip("triton.backends.compiler").GPUTarget("cuda", 90, 32)  # Triton's AOT compiler
    tc = pytest.importorskip("triton.compiler")
    ops = triton_ops("quant_matmul")
    t, kernel, names = getattr(ops, regime), ops._wq_matmul_kernel, ops._wq_matmul_kernel.arg_names
    ptrs = {"x_ptr": "bf16", "w_ptr": "u8", "s_ptr": "fp32", "z_ptr": "fp32", "out_ptr": "fp32"}
    cuobjdump = Path(tc.__file__).parents[1] / "backends" / "nvidia" / "bin" / "cuobjdump"
    for bits, has_zero in [(b, z) for b in (8, 4) for z in (False, True) if f"INT{b}" in regime or "INT" not in regime]:
        consts = {"BITS": bits, "HAS_ZERO": has_zero, "BLOCK_M": t.block_m, "BLOCK_N": t.block_n,
                  "BLOCK_K": t.block_k, "GROUP_M": 8, "DOT_F32": False, "PRECISION": "ieee", "SWAP_AB": t.swap_ab,
                  "EVEN": True}  # as at the 8B shapes
        sig = {a: "constexpr" if a in consts else "*" + ptrs[a] if a in ptrs else "i32" for a in names}
        aligned = {(names.index(a),): [["tt.divisibility", 16]] for a in ptrs}
        compiled = tc.compile(tc.ASTSource(kernel, sig, consts, aligned), target=target, options={
            "num_warps": t.num_warps, "num_stages": t.num_stages, "enable_fp_fusion": True})
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "k.cubin").write_bytes(compiled.asm["cubin"])
            usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(Path(tmp) / "k.cubin")],
                                   capture_output=True, text=True, check=True, timeout=60).stdout
        stack = re.search(r"STACK:(\d+)", usage)
        assert stack and int(stack[1]) <= STACK_ALLOWED.get(regime, 0), f"{regime}, {bits} bits, {has_zero}: {usage}"


# ---------------------------------------------------------------------------------------------
# The benchmark's quant cases at tiny shapes (test_bench.py runs the others)


def check_bench_quant(device: torch.device) -> None:
    from kvfleet_kernels import bench

    saved = bench.time_ms, bench.graph_ms, bench.rotations
    bench.rotations = lambda bytes_per_call: 2
    if device.type != "cuda":
        bench.time_ms = bench.graph_ms = lambda fn, warmup, reps: (fn(), 1.0)[1]
    try:
        b = bench.Bench(torch.float16, 1, 2, device=device.type)
        b.copy_gbs, b.matmul_tflops = 1000.0, 100.0
        out = io.StringIO()
        with redirect_stdout(out):
            for op, m in (("w8a16", 1), ("w4a16", 80), ("fp8", 3)):  # decode, prefill (TFLOP/s), FP8
                b.quant(op, m, 64, 256)
        lines = out.getvalue().splitlines()
        assert len(lines) == 3 and not [line for line in lines if "FAILED" in line], lines
    finally:
        bench.time_ms, bench.graph_ms, bench.rotations = saved


def test_bench_quant_cases_run(small: Run) -> None:
    small(check_bench_quant)


# ---------------------------------------------------------------------------------------------
# GPU, Llama-3-8B shapes: int8 per channel (symmetric) and int4 in groups of 128 (zeros), the on-load defaults


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("m", [1, 16, 512])
@pytest.mark.parametrize(("n", "k"), [(14336, 4096), (4096, 4096)])
def test_matmul_full_size(bits: int, m: int, n: int, k: int) -> None:
    check_matmul(CUDA, bits, torch.bfloat16, m, n, k, k if bits == 8 else 128, bits == 4, seed=m + bits)


@pytest.mark.gpu
@pytest.mark.parametrize("gs", [32, 64])
def test_int4_small_groups_and_float16_full_size(gs: int) -> None:
    check_matmul(CUDA, 4, torch.float16, 16, 4096, 4096, gs, True, seed=gs)
    check_matmul(CUDA, 8, torch.float16, 1, 4096, 14336, gs, False, seed=gs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("m", [1, 16, 512])
def test_fp8_scaled_mm_full_size(dtype: torch.dtype, per_channel: bool, m: int) -> None:
    if not qp.fp8_scaled_mm_supported(CUDA):
        pytest.skip(f"torch._scaled_mm needs compute capability ≥ 8.9, not {torch.cuda.get_device_capability()}")
    x, w_fp8, w_scale = fp8_case(CUDA, m, 14336, 4096, dtype, per_channel, seed=m)
    got = qp.fp8_linear(x, w_fp8, w_scale)
    assert got.dtype == dtype and got.shape == (m, 14336)
    assert_matches(got.float(), qp.emulate_fp8_linear(x.float(), w_fp8, w_scale), dtype)
    assert rel_err(got.float(), qp.ref_fp8_linear(x.float(), w_fp8, w_scale)) < FP8_TOL
    assert torch.equal(qp.fp8_linear(x, w_fp8, w_scale, scaled_mm=False), qp.ref_fp8_linear(x, w_fp8, w_scale))
