"""Without a GPU: each Triton kernel compiles for the H200 (sm_90) at its 8B configuration, with no register spills."""

# The interpreter tests check what the kernels compute; this checks that the compiler accepts them (types,
# constexprs, layouts) and that the tile sizes fit in registers, which the interpreter cannot tell. It uses
# Triton's ahead-of-time entry points and the cuobjdump in Triton's wheel; on a GPU the `gpu` tests compile
# and run the kernels for real, so it is skipped there.

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

triton = pytest.importorskip("triton")
if torch.cuda.is_available():
    pytest.skip("a GPU is here: the gpu tests compile and run the kernels", allow_module_level=True)
try:
    from triton.backends.compiler import GPUTarget  # type: ignore[import-untyped]
    from triton.compiler import ASTSource  # type: ignore[import-untyped]
    from triton.compiler import compile as triton_compile
except ImportError as e:  # Triton moved its ahead-of-time API
    pytest.skip(f"Triton's ahead-of-time compiler API is not where this test expects it: {e}", allow_module_level=True)

from kvfleet_kernels import fused, kv_write  # noqa: E402
from kvfleet_kernels import paged_attention as pa  # noqa: E402

H200 = GPUTarget("cuda", 90, 32)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
SHARED_LIMIT = 227 * 1024  # opt-in shared memory per block on sm_90
TY = {torch.bfloat16: "bf16", torch.float32: "fp32"}
# A quantized KV cache as the kernels address it (kv_write.as_codes): int8, or fp8's bytes; 0 is a float cache.
KV = {0: None, 1: "i8", 2: "u8"}


def compile_h200(kernel: Any, pointers: dict[str, str], floats: set[str], constexprs: dict[str, Any],
                 num_warps: int) -> tuple[int, int]:
    """(dynamic shared memory bytes, stack frame bytes) of kernel compiled for sm_90; other arguments are i32."""
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else "*" + pointers[n] if n in pointers
                 else "fp32" if n in floats else "i32" for n in names}
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in pointers}  # as torch's allocations are
    compiled = triton_compile(ASTSource(kernel, signature, constexprs, aligned), target=H200,
                              options={"num_warps": num_warps, "enable_fp_fusion": True})  # Triton's default
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", str(cubin)], capture_output=True,
                               text=True, check=True, timeout=60).stdout
    stack = re.search(r"STACK:(\d+)", usage)
    assert stack is not None, usage
    return int(compiled.metadata.shared), int(stack.group(1))


def assert_fits(shared: int, stack: int) -> None:
    assert shared <= SHARED_LIMIT, f"{shared} bytes of shared memory"
    assert stack == 0, f"{stack}-byte stack frame: registers spill"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("use_valid", "split", "kv_quant"), [(True, True, 0), (False, False, 0), (True, True, 1),
                                                              (False, False, 2)])
def test_decode_compiles_without_spills(dtype: torch.dtype, use_valid: bool, split: bool, kv_quant: int) -> None:
    e = TY[dtype]
    kv = KV[kv_quant] or e
    part = "fp32" if split else e
    assert_fits(*compile_h200(
        pa._decode_kernel,
        {"q_ptr": e, "k_ptr": kv, "v_ptr": kv, "ks_ptr": "fp32", "vs_ptr": "fp32", "tables_ptr": "i64",
         "lens_ptr": "i64", "valid_ptr": "u8", "out_ptr": e, "part_ml_ptr": part, "part_acc_ptr": part},
        {"scale_log2e"},
        {"GROUP": 4, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_G": 16, "BLOCK_SIZE": 16,
         "BLOCK_N": pa._block_n(dtype, kv_quant > 0),
         "USE_VALID": use_valid, "SPLIT": split, "PRECISION": pa._precision(dtype), "CHUNK": pa.MASK_CHUNK,
         "KV_QUANT": kv_quant}, pa.DECODE_WARPS))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("paged", "kv_quant"), [(True, 0), (False, 0), (True, 1), (True, 2)])
def test_prefill_compiles_without_spills(dtype: torch.dtype, paged: bool, kv_quant: int) -> None:
    e = TY[dtype]
    kv = KV[kv_quant] or e
    assert_fits(*compile_h200(
        pa._prefill_kernel, {"q_ptr": e, "k_ptr": kv, "v_ptr": kv, "ks_ptr": "fp32", "vs_ptr": "fp32",
                             "table_ptr": "i64", "out_ptr": e}, {"scale_log2e"},
        {"GROUP": 4, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_SIZE": 16 if paged else 1, "PAGED": paged,
         "BLOCK_M": pa._prefill_block_m(dtype, kv_quant > 0, 4096), "BLOCK_N": pa._block_n(dtype, kv_quant > 0, True),
         "PRECISION": pa._precision(dtype), "KV_QUANT": kv_quant},
        pa.PREFILL_WARPS))


def test_combine_kv_write_norm_rotary_compile() -> None:
    e = "bf16"
    assert_fits(*compile_h200(pa._combine_kernel, {"part_ml_ptr": "fp32", "part_acc_ptr": "fp32", "out_ptr": e},
                              set(), {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_S": 16}, 4))
    for mode, kv in KV.items():
        scale = "fp32" if kv else e
        assert_fits(*compile_h200(kv_write._write_kv_kernel,
                                  {"k_ptr": e, "v_ptr": e, "k_cache_ptr": kv or e, "v_cache_ptr": kv or e,
                                   "k_scale_ptr": scale, "v_scale_ptr": scale, "slot_ptr": "i64"}, set(),
                                  {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_H": 8, "BLOCK_SIZE": 16, "KV_QUANT": mode,
                                   "QMAX": 127.0 if mode == 1 else 448.0, "MIN_AMAX": 1e-12}, 4))
    assert_fits(*compile_h200(fused._rms_norm_kernel,
                              {"x_ptr": e, "res_ptr": e, "w_ptr": e, "out_ptr": e, "res_out_ptr": e}, {"eps"},
                              {"HAS_RESIDUAL": True, "BLOCK": 4096}, 16))
    assert_fits(*compile_h200(fused._rotary_kernel, {"x_ptr": e, "cos_ptr": e, "sin_ptr": e, "out_ptr": e}, set(),
                              {"HALF": 64, "BLOCK_HALF": 64, "BLOCK_H": 16}, 4))
