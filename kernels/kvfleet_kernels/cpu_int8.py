"""INT8 weight-only matmul on CPU with fp32 activations: cpu_int8.cpp, compiled on first use and cached."""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_int8.cpp")
NAME = "kvfleet_cpu_int8"  # the extension's file name and its torch.ops namespace
TILE = 16  # output columns per packed tile (NR in the source)
# No -march: the AVX2 code is chosen at run time (target attributes), so a cached build also runs on a CPU
# without AVX2, e.g. a home directory shared between machines.
CFLAGS = ["-O3", "-fopenmp", "-DNDEBUG"]
LDFLAGS = ["-fopenmp"]  # the same libgomp torch already loaded: one OpenMP pool, torch's thread count
CACHE_ENV = "KVFLEET_EXT_CACHE"  # where builds are kept (default ~/.cache/kvfleet/ext)
ENABLE_ENV = "KVFLEET_CPU_INT8_EXT"  # "0": never build or load it (PyTorch's kernels run instead)

_lock = threading.Lock()
_loaded: list[bool] = []  # [outcome] once the first call has tried


def build_dir() -> Path:
    """This build's cache folder: keyed by the source, flags, torch, Python and machine, outside the repository."""
    root = os.environ.get(CACHE_ENV) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvfleet/ext"
    parts = [SOURCE.read_bytes(), " ".join(CFLAGS + LDFLAGS).encode(), torch.__version__.encode(), sys.version.encode(),
             platform.machine().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    return Path(root) / f"{NAME}-torch{torch.__version__.replace('+', '_')}-{key}"


def available() -> bool:
    """Whether the kernel is loaded, building it on the first call; False means callers take their fallback."""
    with _lock:
        if not _loaded:
            _loaded.append(_load())
        return _loaded[0]


def _load() -> bool:
    if os.environ.get(ENABLE_ENV, "1") == "0":
        return False
    try:
        where = build_dir()
        done = where / "built"  # written after a whole build, so a half-linked .so is never loaded
        if done.exists():
            torch.ops.load_library(str(where / f"{NAME}.so"))  # type: ignore[no-untyped-call]
            return True
        compiler = os.environ.get("CXX", "c++")
        if shutil.which(compiler) is None:
            log.warning("no C++ compiler (%s) for the CPU INT8 kernel: INT8 weights run PyTorch's kernels", compiler)
            return False
        log.warning("building the CPU INT8 matmul kernel into %s (once per torch version; about 15 s)", where)
        start = time.perf_counter()
        where.mkdir(parents=True, exist_ok=True)
        from torch.utils import cpp_extension

        # cpp_extension holds a lock file in the folder, so concurrent processes (TP ranks) build it once.
        cpp_extension.load(name=NAME, sources=[str(SOURCE)], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                           build_directory=str(where), is_python_module=False, verbose=False)
        done.touch()
        log.warning("built the CPU INT8 matmul kernel in %.0f s", time.perf_counter() - start)
        return True
    except Exception as e:  # a broken toolchain must not stop the engine: the old path is correct, only slower
        log.warning("could not build the CPU INT8 matmul kernel (%s): INT8 weights run PyTorch's kernels", e)
        return False


def pack(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] int8, scale [N]) → ([ceil(N/16), K, 16] int8 tiles, scale zero-padded to a whole tile)."""
    n, k = q.shape
    pad = -n % TILE
    tiles = F.pad(q, (0, 0, 0, pad)).view((n + pad) // TILE, TILE, k).transpose(1, 2).contiguous()
    return tiles, F.pad(scale.to(torch.float32).reshape(-1), (0, pad)).contiguous()


def linear(x: torch.Tensor, tiles: torch.Tensor, scale: torch.Tensor, n: int, portable: bool = False) -> torch.Tensor:
    """x [M, K] fp32 → (x · qᵀ) · scale [M, n] fp32, for pack()'s tiles of an [n, K] weight. Needs available().

    portable: run the plain C++ loop even where the AVX2 one would (tests).
    """
    return cast(torch.Tensor, torch.ops.kvfleet_cpu_int8.int8_linear(x, tiles, scale, n, portable))

