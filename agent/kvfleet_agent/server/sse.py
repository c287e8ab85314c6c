"""Streamed completions as server-sent events: each prompt's new text as OpenAI chunks, usage, then `data: [DONE]`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from kvfleet_agent.engine.async_llm import EngineDeadError
from kvfleet_agent.engine.request_stream import RequestStream
from kvfleet_agent.outputs import RequestOutput
from kvfleet_agent.server import protocol
from kvfleet_agent.server.protocol import APIError

log = logging.getLogger(__name__)


async def stream(request: web.Request, rid: str, streams: list[RequestStream], req: protocol.GenerateRequest,
                 model: str, decode: Callable[[int], str]) -> web.StreamResponse:
    """Send the streams' outputs as chunks; a request aborted by a drain ends with finish_reason "abort"."""
    merged = merge(streams)
    first = await anext(merged, None)  # invalid input raises here, before any header is sent
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    finals: dict[int, RequestOutput] = {}
    try:
        await _pump(resp, rid, req, model, decode, merged, first, finals)
    except Exception as e:  # headers are out: report it inside the stream, then end the stream properly
        if not isinstance(e, EngineDeadError):
            log.exception("error while streaming %s", rid)
        await send(resp, APIError("the engine failed mid-stream" if isinstance(e, EngineDeadError) else
                                  "internal error mid-stream; the server logged it", status=503,
                                  type_="server_error").body())
    if req.include_usage and finals:
        await send(resp, protocol.envelope(rid, model, req.chat, [], True,
                                           protocol.usage([finals[i] for i in sorted(finals)]), req.created))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _pump(resp: web.StreamResponse, rid: str, req: protocol.GenerateRequest, model: str,
                decode: Callable[[int], str], merged: AsyncIterator[tuple[int, RequestOutput]],
                item: tuple[int, RequestOutput] | None, finals: dict[int, RequestOutput]) -> None:
    sent_text = [0] * len(req.prompts)
    sent_lp = [0] * len(req.prompts)
    sent_role = [not req.chat] * len(req.prompts)  # chat streams name the role once, in the first delta
    while item is not None:
        i, out = item
        c = out.outputs[0]
        delta = c.text[sent_text[i]:]
        piece = protocol.choice(i, out, req.chat, decode, text=delta, logprob_start=sent_lp[i], delta=True,
                                first=not sent_role[i])
        new_lp = len(c.logprobs or []) > sent_lp[i]
        sent_text[i], sent_lp[i] = len(c.text), len(c.logprobs or [])
        if delta or out.finished or new_lp:
            sent_role[i] = True
            await send(resp, protocol.envelope(rid, model, req.chat, [piece], True, created=req.created))
        if out.finished:
            finals[i] = out
        item = await anext(merged, None)


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (index, output), in arrival order."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                await queue.put((i, out))
        except BaseException as e:  # hand errors (bad input, dead engine) to the consumer
            await queue.put(e)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        done = 0
        while done < len(streams):
            item = await queue.get()
            if item is None:
                done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)


async def send(resp: web.StreamResponse, obj: dict[str, Any]) -> None:
    """One SSE event carrying obj as compact JSON."""
    await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")
