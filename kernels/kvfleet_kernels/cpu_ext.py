"""The CPU C++ ops' build: compiled on first use with torch's cpp_extension, cached outside the repo, or skipped."""

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

import torch

log = logging.getLogger(__name__)

# No -march: AVX2 code is chosen at run time (target attributes), so a cached build also runs on a CPU without
# AVX2, e.g. a home directory shared between machines.
CFLAGS = ["-O3", "-fopenmp", "-DNDEBUG"]
LDFLAGS = ["-fopenmp"]  # the same libgomp torch already loaded: one OpenMP pool, torch's thread count
CACHE_ENV = "KVFLEET_EXT_CACHE"  # where builds are kept (default ~/.cache/kvfleet/ext)


def cache_root() -> Path:
    """Where builds are kept: $KVFLEET_EXT_CACHE, else $XDG_CACHE_HOME/kvfleet/ext, else ~/.cache/kvfleet/ext."""
    if root := os.environ.get(CACHE_ENV):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvfleet/ext"


class Extension:
    """One C++ source built into a shared library of torch ops (namespace = name), loaded by the first available().

    enable_env set to "0" never builds or loads it; what names the kernel in log lines, fallback what runs
    instead of it, seconds about how long a build takes.
    """

    def __init__(self, name: str, source: Path, enable_env: str, what: str, fallback: str, seconds: int) -> None:
        self.name, self.source, self.enable_env = name, source, enable_env
        self.what, self.fallback, self.seconds = what, fallback, seconds
        self._lock = threading.Lock()
        self._loaded: list[bool] = []  # [outcome] once the first call has tried

    def build_dir(self) -> Path:
        """This build's cache folder: keyed by the source, flags, torch, Python and machine, outside the repository."""
        root = cache_root()
        headers = [h.read_bytes() for h in sorted(self.source.parent.glob("*.h"))]  # cpu_simd.h, shared
        parts = [self.source.read_bytes(), *headers, " ".join(CFLAGS + LDFLAGS).encode(), torch.__version__.encode(),
                 sys.version.encode(), platform.machine().encode()]
        key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
        return Path(root) / f"{self.name}-torch{torch.__version__.replace('+', '_')}-{key}"

    def available(self) -> bool:
        """Whether the ops are loaded, building them on the first call; False means callers take their fallback."""
        with self._lock:
            if not self._loaded:
                self._loaded.append(self._load())
            return self._loaded[0]

    def _load(self) -> bool:
        if os.environ.get(self.enable_env, "1") == "0":
            return False
        try:
            where = self.build_dir()
            done = where / "built"  # written after a whole build, so a half-linked .so is never loaded
            if done.exists():
                torch.ops.load_library(str(where / f"{self.name}.so"))  # type: ignore[no-untyped-call]
                return True
            compiler = os.environ.get("CXX", "c++")
            if shutil.which(compiler) is None:
                log.warning("no C++ compiler (%s) for the %s: %s", compiler, self.what, self.fallback)
                return False
            log.warning("building the %s into %s (once per torch version; about %d s)", self.what, where, self.seconds)
            start = time.perf_counter()
            where.mkdir(parents=True, exist_ok=True)
            from torch.utils import cpp_extension

            # cpp_extension holds a lock file in the folder, so concurrent processes (TP ranks) build it once.
            cpp_extension.load(name=self.name, sources=[str(self.source)], extra_cflags=list(CFLAGS),
                               extra_ldflags=list(LDFLAGS), build_directory=str(where), is_python_module=False,
                               verbose=False)
            done.touch()
            log.warning("built the %s in %.0f s", self.what, time.perf_counter() - start)
            return True
        except Exception as e:  # a broken toolchain must not stop the engine: the fallback is correct, only slower
            log.warning("could not build the %s (%s): %s", self.what, e, self.fallback)
            return False
