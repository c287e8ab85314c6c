"""n and best_of: each prompt's samples as separate requests that share its KV blocks through the prefix cache.

Sample 0 of a prompt goes first; the others are queued once it has its first token, which is when
its prompt's full blocks are computed and registered in the prefix cache (KVCacheManager.commit),
so each later sample is admitted onto those same blocks (reference counted) and computes only the
prompt's last partial block. Submitting all of them at once would prefill the prompt n times: the
cache only holds blocks once they are computed. With prefix caching off, samples do not share.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from kvfleet_agent.outputs import RequestOutput
from kvfleet_agent.sampling_params import SamplingParams
from kvfleet_agent.server.api.render import cumulative_logprob
from kvfleet_agent.server.protocol import GenerateRequest


class OutputStream(Protocol):
    """What the handlers read a request's outputs from: a RequestStream, or a Prefetched one."""

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def __anext__(self) -> RequestOutput: ...

    async def aclose(self) -> None: ...


class Prefetched:
    """A stream whose first output was already read (to know the prompt is cached): it comes first again."""

    def __init__(self, stream: OutputStream, first: RequestOutput | None) -> None:
        self._stream, self._first = stream, first

    def __aiter__(self) -> Prefetched:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await anext(self._stream)

    async def aclose(self) -> None:
        """Close the underlying stream: an unfinished request is aborted."""
        await self._stream.aclose()


Start = Callable[[list[int], SamplingParams, str], OutputStream]


async def start_samples(prompt_ids: Sequence[list[int]], req: GenerateRequest, rid: str, start: Start,
                        started: list[OutputStream]) -> list[OutputStream]:
    """best_of streams per prompt, prompt-major (sample i of prompt p at p * best_of + i).

    Every stream started is also appended to `started` at once, so the caller can close them all
    whatever fails here.
    """
    per = req.best_of
    slots: list[OutputStream | None] = [None] * (len(prompt_ids) * per)

    async def one_prompt(p: int, ids: list[int]) -> None:
        head = start(ids, req.sample_params(0), f"{rid}-{p}-0")
        started.append(head)
        if per > 1:  # wait for the prompt's blocks to be computed and cached; sample 0 is the prompt's prefill
            head = Prefetched(head, await anext(head, None))
        slots[p * per] = head
        for i in range(1, per):
            s = start(ids, req.sample_params(i), f"{rid}-{p}-{i}")
            started.append(s)
            slots[p * per + i] = s

    if per == 1:  # the common case: every prompt at once, nothing to wait for
        for p, ids in enumerate(prompt_ids):
            await one_prompt(p, ids)
    else:
        await asyncio.gather(*(one_prompt(p, ids) for p, ids in enumerate(prompt_ids)))
    return [s for s in slots if s is not None]


def best(finals: list[RequestOutput], req: GenerateRequest) -> list[RequestOutput]:
    """Each prompt's n returned samples: all of them, or with best_of the n of highest cumulative logprob."""
    per = req.best_of
    if per == req.n:
        return finals
    out = []
    for p in range(0, len(finals), per):
        group = sorted(finals[p:p + per], key=cumulative_logprob, reverse=True)
        out += group[:req.n]
    return out
