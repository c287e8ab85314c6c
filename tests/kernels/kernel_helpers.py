"""Shared by the reference-kernel tests: seeded generators, dtype tolerances and the head layouts to cover."""

from __future__ import annotations

import atexit
import functools
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

# Tolerances against float64 references, by the dtype the kernel computed in.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
HEADS = [(4, 4), (4, 2), (8, 2)]  # (query heads, key/value heads): GQA groups 1, 2, 4


def assert_close_at(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """assert_close (NaN fails) with atol = rtol = TOL[dtype]."""
    torch.testing.assert_close(actual, expected, atol=TOL[dtype], rtol=TOL[dtype])


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# Triton kernel tests: the same checks run small on CPU (Triton's interpreter) and full size on a GPU.

# ‖out − ref‖ / ‖ref‖ allowed, by the dtype the kernel reads: float32 arithmetic, or 16-bit operands.
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
POISON = float("nan")  # outputs start as NaN: an element the kernel never wrote fails every comparison
GARBAGE = 50.0  # scale of what sits in cache slots a sequence does not own: huge if ever attended to


def triton_ops(name: str) -> Any:
    """kvfleet_kernels.<name>: compiled in this process, or interpreted in the interpreter worker."""
    from kvfleet_kernels.dispatch import kernel_module

    return kernel_module(name)


# The worker: Triton's interpreter is chosen per process, before triton is first imported (its own tl.*
# helpers are @triton.jit functions, compiled or interpreted from then on), and by the time these tests
# run, earlier ones have imported triton (transformers' Llama does). So the small CPU cases run in one
# child Python started with TRITON_INTERPRET=1; this process's environment is never changed.
_WORKER_CODE = r"""
import importlib, pickle, sys, traceback
sys.path[:0] = pickle.loads(bytes.fromhex(sys.argv[1]))
inp, out = sys.stdin.buffer, sys.stdout.buffer
sys.stdout = sys.stderr  # whatever a check prints must not corrupt the reply pipe
while True:
    try:
        module, name, args, kwargs = pickle.load(inp)
    except EOFError:
        break
    try:
        getattr(importlib.import_module(module), name)(*args, **kwargs)
        reply = None
    except BaseException:
        reply = traceback.format_exc()
    pickle.dump(reply, out)
    out.flush()
"""


class InterpreterWorker:
    """A child Python with TRITON_INTERPRET=1 that runs module-level check functions on request."""

    def __init__(self) -> None:
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER_CODE, pickle.dumps(sys.path).hex()],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)

    def run(self, fn: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        """fn(*args, **kwargs) in the worker; its traceback fails the calling test."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        pickle.dump((fn.__module__, fn.__name__, args, kwargs), self.proc.stdin)
        self.proc.stdin.flush()
        try:
            reply = pickle.load(self.proc.stdout)
        except EOFError:
            pytest.fail(f"the interpreter worker died (exit code {self.proc.wait()})")
        if reply is not None:
            pytest.fail(f"in the interpreter worker:\n{reply}", pytrace=False)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@functools.cache
def interpreter_worker() -> InterpreterWorker:
    """One worker for the whole session (starting one costs the imports of torch and triton)."""
    worker = InterpreterWorker()
    atexit.register(worker.close)
    return worker


def small_case_runner() -> Callable[..., None]:
    """Runs check(device, ...) for the small cases: on the GPU when there is one, else in the interpreter worker."""
    if torch.cuda.is_available():
        return lambda check, *args, **kwargs: check(torch.device("cuda"), *args, **kwargs)
    worker = interpreter_worker()
    return lambda check, *args, **kwargs: worker.run(check, torch.device("cpu"), *args, **kwargs)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ in float64; NaN anywhere gives NaN, which fails every `<` check."""
    a, e = actual.double(), expected.double()
    return float((a - e).norm() / e.norm().clamp_min(1e-30))


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Same shape, no NaN or inf, and relative error under REL_TOL[dtype]."""
    assert actual.shape == expected.shape
    assert torch.isfinite(actual).all(), "non-finite output (unwritten, or a NaN from the kernel)"
    err = rel_err(actual, expected)
    assert err < REL_TOL[dtype], f"relative error {err:.3g} ≥ {REL_TOL[dtype]:g} ({dtype})"


def randn(shape: tuple[int, ...], g: torch.Generator, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Standard normal on g's device (full-size GPU cases never build their inputs on the CPU)."""
    return (torch.randn(shape, generator=g, device=g.device) * scale).to(dtype)


def device_gen(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def paged_pool(lengths: list[int], bs: int, kvh: int, d: int, dtype: torch.dtype, g: torch.Generator,
               spare_blocks: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V pools of garbage with each sequence's random K/V in a random permutation of blocks.

    Returns (k_cache, v_cache, block_tables): tables [B, width + 1] padded with random valid ids, and a
    column slice of a wider tensor, so their row stride is not their width.
    """
    dev = g.device
    need = [-(-n // bs) for n in lengths]
    num_blocks = sum(need) + spare_blocks
    k_cache = randn((num_blocks, bs, kvh, d), g, dtype, GARBAGE)
    v_cache = randn((num_blocks, bs, kvh, d), g, dtype, GARBAGE)
    perm = torch.randperm(num_blocks, generator=g, device=dev)
    width = max(need) + 1
    wide = torch.randint(0, num_blocks, (len(lengths), width + 3), generator=g, device=dev)
    tables = wide[:, :width]
    start = 0
    for i, (n, nb) in enumerate(zip(lengths, need, strict=True)):
        tables[i, :nb] = perm[start:start + nb]
        start += nb
        pos = torch.arange(n, device=dev)
        slots = tables[i, pos // bs] * bs + pos % bs
        k_cache.view(-1, kvh, d)[slots] = randn((n, kvh, d), g, dtype)
        v_cache.view(-1, kvh, d)[slots] = randn((n, kvh, d), g, dtype)
    return k_cache, v_cache, tables


def strided_heads(t: int, h: int, d: int, g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """[t, h, d] viewed out of a wider packed tensor, as the model slices q out of its QKV projection."""
    return randn((t, h + 3, d), g, dtype)[:, 1:h + 1]


# The tiled CPU GEMMs' cases (cpu_int8, cpu_f32): (M, N, K) around the 6-row register block and the 96-row pass, N and
# K off every 16-column tile.
TILE_SHAPES = [(1, 16, 64), (1, 1, 1), (1, 17, 33), (2, 48, 100), (3, 100, 300), (5, 16, 8), (6, 31, 7), (7, 40, 65),
               (13, 47, 129), (16, 1024, 512), (33, 64, 80), (97, 20, 16), (130, 70, 600)]


def assert_fp32_near(y: torch.Tensor, ref: torch.Tensor) -> None:
    """y is fp32 of ref's shape and within fp32 accumulation of the float64 reference: relative norm error and each
    element below 1e-5 (TOL[float32]; ~1e-7 seen)."""
    rel = TOL[torch.float32]
    assert y.dtype == torch.float32 and y.shape == ref.shape
    if ref.numel():
        assert float((y.double() - ref).norm() / ref.norm().clamp(min=1e-30)) < rel
        torch.testing.assert_close(y.double(), ref, rtol=rel, atol=rel * float(ref.abs().max()))


def assert_fallback_runs(script: str, why: str, tmp_path: Path, enable_env: str, name: str) -> None:
    """A C++ op's fallback, in a fresh process: `script` (which prints "fallback ok") runs without a compiler (why
    "no-compiler") or with the op turned off by `enable_env` ("disabled"), says why only in the first case, and
    builds nothing into the cache at tmp_path (no `name`-* folder)."""
    env = {**os.environ, "KVFLEET_EXT_CACHE": str(tmp_path)}
    if why == "no-compiler":
        env["CXX"] = str(tmp_path / "no-such-compiler")
    else:
        env[enable_env] = "0"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["fallback", "ok"]
    assert ("no C++ compiler" in done.stderr) == (why == "no-compiler")
    assert not any(tmp_path.glob(f"{name}-*")), "nothing is built"
