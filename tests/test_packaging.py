"""Layout guarantees: pure bookkeeping stays torch-free, and operator/ never shadows the standard library."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    """Run code in a fresh interpreter from the repository root, as a user would."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_bookkeeping_modules_import_no_torch() -> None:
    p = run_python(
        "import sys\n"
        "import kvfleet_agent\n"
        "import kvfleet_agent.core.kv_cache, kvfleet_agent.core.scheduler, kvfleet_agent.core.request\n"
        "import kvfleet_agent.core.scheduler_output, kvfleet_agent.sampling_params, kvfleet_agent.config\n"
        "import kvfleet_contract.metrics\n"
        "print('torch' in sys.modules)\n")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "False", "the scheduler / KV bookkeeping pulled in torch"


def test_public_api_is_importable_lazily() -> None:
    p = run_python("from kvfleet_agent import LLM, SamplingParams, AsyncLLM, EngineConfig, RequestOutput\n"
                   "print(LLM.__module__, SamplingParams.__module__)\n")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["kvfleet_agent.llm", "kvfleet_agent.sampling_params"]


def test_operator_folder_has_no_init_and_stdlib_operator_wins() -> None:
    assert not (ROOT / "operator" / "__init__.py").exists(), "operator/__init__.py shadows the stdlib module"
    p = run_python("import operator, re, enum\nprint(hasattr(operator, 'itemgetter'))\n")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "True"
    assert run_python("import kvfleet_operator").returncode == 0
