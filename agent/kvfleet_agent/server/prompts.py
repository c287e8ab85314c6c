"""Prompt text to token ids for both front ends: bounded first, tokenized off the event loop, fitted to the context;
and output constraints compiled off the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvfleet_agent.engine.async_llm import AsyncLLM
from kvfleet_agent.server.protocol import APIError
from kvfleet_agent.server.token_bound import max_chars_per_token
from kvfleet_agent.structured_outputs import StructuredOutputs

T = TypeVar("T")


class PromptEncoder:
    """Turns text prompts (and chat messages) into token ids without stalling the event loop.

    A text that cannot fit is refused from its length in characters alone (token_bound.py), so
    the largest text ever tokenized is max_model_len times the characters-per-token bound. The
    tokenizing itself (and chat-template rendering) runs on a small thread pool: the event loop
    keeps answering /health meanwhile, as far as the tokenizer releases the GIL while it works.
    """

    def __init__(self, llm: AsyncLLM, threads: int = 2) -> None:
        self.tokenizer, self.grammars = llm.tokenizer, llm.grammars
        self.max_model_len = llm.max_model_len
        bound = max_chars_per_token(self.tokenizer.backend) if self.tokenizer is not None else None
        self.chars_per_token = bound
        self.max_chars = None if bound is None else self.max_model_len * bound
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvfleet-tokenize")

    def close(self) -> None:
        """Stop the tokenizing threads (work already running finishes; queued work is dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def check_chars(self, chars: int, name: str) -> None:
        """Refuse text that has too many characters to fit in the context, whatever its tokens."""
        if self.max_chars is not None and chars > self.max_chars:
            raise APIError(f"'{name}' has {chars} characters; no more than {self.max_chars} can fit in this model's "
                           f"context (max_model_len={self.max_model_len} tokens of at most {self.chars_per_token} "
                           "characters each): shorten it", name)

    async def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                          tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation as prompt text, through the model's chat template, off the event loop."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise APIError("this model has no tokenizer.json, so chat is unavailable; use /v1/completions "
                           "with prompt token ids", "messages")
        self.check_chars(sum(len(m["content"]) for m in messages), "messages")
        try:
            text = await self._off_loop(tokenizer.apply_chat_template, messages, add_generation_prompt, tools)
        except ValueError as e:  # the template refused the conversation (raise_exception) or failed to render
            raise APIError(str(e), "messages") from None
        self.check_chars(len(text), "messages")
        return text

    async def encode(self, prompts: Sequence[str | list[int]], name: str, add_special_tokens: bool = True
                     ) -> list[list[int]]:
        """Token ids of each prompt (token-id prompts pass through); refuses those that cannot fit."""
        texts = [p for p in prompts if isinstance(p, str)]
        for text in texts:
            self.check_chars(len(text), name)
        encoded: Iterator[list[int]] = iter(())
        if texts:
            tokenizer = self.tokenizer
            if tokenizer is None:
                raise APIError("this model has no tokenizer.json, so prompts must be token ids", name)
            encoded = iter(await self._off_loop(lambda: [tokenizer.encode(t, add_special_tokens) for t in texts]))
        out = [next(encoded) if isinstance(p, str) else p for p in prompts]
        for ids in out:
            if not ids:
                raise APIError(f"'{name}' is empty once tokenized: give at least one token", name)
            if len(ids) >= self.max_model_len:
                raise APIError(f"'{name}' has {len(ids)} tokens; this model's context is max_model_len="
                               f"{self.max_model_len} tokens, and the prompt must leave room for at least one "
                               "generated token: shorten it", name)
        return out

    async def compile(self, spec: StructuredOutputs | None, name: str) -> None:
        """The constraint compiled (or found in the cache) on a worker thread: never the loop or the engine."""
        if spec is None:
            return
        if self.grammars is None:
            raise APIError(f"'{name}' needs the model's tokenizer.json, which this model lacks: remove it", name)
        try:
            await asyncio.to_thread(self.grammars.compile, spec)
        except ValueError as e:
            what = "the tool's parameters schema" if name == "tool_choice" else "it"
            raise APIError(f"'{name}' cannot be enforced: {e}. Fix {what} (llguidance's JSON schema, regex and Lark "
                           "support) or remove it", name) from None

    def check_fits(self, prompt_tokens: int, max_tokens: int, prompt_name: str, max_tokens_name: str) -> None:
        """Refuse (as vLLM does) a request whose prompt plus max_tokens exceeds the context, naming both."""
        if prompt_tokens + max_tokens > self.max_model_len:
            raise APIError(f"this model's maximum context length is {self.max_model_len} tokens, but the request asks "
                           f"for {prompt_tokens + max_tokens} ({prompt_tokens} in '{prompt_name}' and {max_tokens} in "
                           f"'{max_tokens_name}'): lower '{max_tokens_name}' to at most "
                           f"{self.max_model_len - prompt_tokens} or shorten the prompt", max_tokens_name)

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
