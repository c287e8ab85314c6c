"""`python -m kvfleet_kernels.build_cpu`: build every CPU C++ op ahead of use (make setup, the image build).

Built here they are loaded, not compiled, when an engine starts: a fresh pod then serves its first token in seconds,
and a runtime image needs no C++ compiler. A build that fails leaves its ops to their PyTorch fallback (it says so).
"""

from __future__ import annotations

import logging
import sys
import time

from kvfleet_kernels import cpu_argmax, cpu_attention, cpu_decode, cpu_f32, cpu_fused, cpu_int8
from kvfleet_kernels.cpu_ext import cache_root


def main() -> int:
    """Build (or find cached) each extension; one line per extension; exit 0 (a missing build is a fallback)."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    print(f"CPU C++ ops in {cache_root()}")
    for module in (cpu_attention, cpu_fused, cpu_int8, cpu_f32, cpu_argmax, cpu_decode):
        start = time.perf_counter()
        state = "ready" if module.available() else "not built (its PyTorch fallback runs)"
        print(f"  {module.__name__.rsplit('.', 1)[1]}: {state} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
