"""The offline API, in vLLM's shape: LLM(model=DIR, **engine_options).generate(prompts, params)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any, TypedDict

from tqdm import tqdm

from kvfleet_agent.config import EngineConfig
from kvfleet_agent.engine.llm_engine import LLMEngine
from kvfleet_agent.models.tokenizer import Tokenizer
from kvfleet_agent.outputs import RequestOutput
from kvfleet_agent.sampling_params import SamplingParams


class TokensPrompt(TypedDict):
    """A prompt given as token ids."""

    prompt_token_ids: list[int]


Prompt = str | TokensPrompt


class LLM:
    """A model loaded for batch generation; every prompt of a call is batched continuously.

    With tensor_parallel_size=N > 1, ranks 1..N-1 run in worker processes started with
    multiprocessing's "spawn" method, which re-imports the calling script: guard the script's top
    level with `if __name__ == "__main__":`. Workers stop on shutdown(), at the end of a `with`
    block, when the LLM is garbage collected, or at interpreter exit.
    """

    def __init__(self, model: str, **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_options))
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Release the engine's worker processes (a no-op with one rank); generate() fails afterwards."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer, or None when the checkpoint has no tokenizer.json."""
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; returns outputs in prompt order."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling_params: "
                             "pass one SamplingParams or one per prompt")
        # Validate every prompt before queueing any, so a bad one leaves nothing behind.
        reqs = [self.engine.make_request(str(next(self._ids)), _prompt_of(prompt, i), p)
                for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))]
        order: dict[str, int] = {}
        for i, req in enumerate(reqs):
            self.engine.add(req)
            order[req.request_id] = i
        results: list[RequestOutput | None] = [None] * len(prompts)
        bar = tqdm(total=len(prompts), desc="generate", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        start, first = time.perf_counter(), self.engine.counters.generation_tokens
        try:
            with bar:
                while self.engine.has_unfinished():
                    for out in self.engine.step(finished_only=True):
                        results[order[out.request_id]] = out
                        bar.update(1)
                        tokens = self.engine.counters.generation_tokens - first
                        bar.set_postfix_str(f"{tokens / (time.perf_counter() - start):.0f} tok/s", refresh=False)
        except BaseException:  # interrupted (Ctrl-C) or failed: leave the engine clean for the next call
            self.engine.abort(self.engine.unfinished_ids())
            raise
        return [r for r in results if r is not None]


def _prompt_of(prompt: Prompt, index: int) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    raise ValueError(f"prompts[{index}] must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
