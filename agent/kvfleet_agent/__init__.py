"""kvfleet agent: the runtime (the offline `LLM` API, `AsyncLLM`) and the serving process."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "AsyncLLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams"]

if TYPE_CHECKING:
    from kvfleet_agent.config import EngineConfig
    from kvfleet_agent.engine.async_llm import AsyncLLM
    from kvfleet_agent.llm import LLM
    from kvfleet_agent.outputs import CompletionOutput, RequestOutput
    from kvfleet_agent.sampling_params import SamplingParams

# Imported lazily so that `import kvfleet_agent.core.kv_cache` (pure bookkeeping) never loads torch.
_WHERE = {
    "LLM": "kvfleet_agent.llm",
    "AsyncLLM": "kvfleet_agent.engine.async_llm",
    "EngineConfig": "kvfleet_agent.config",
    "SamplingParams": "kvfleet_agent.sampling_params",
    "RequestOutput": "kvfleet_agent.outputs",
    "CompletionOutput": "kvfleet_agent.outputs",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'kvfleet_agent' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_WHERE[name]), name)
