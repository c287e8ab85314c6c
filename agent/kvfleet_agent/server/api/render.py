"""OpenAI response bodies from engine outputs: choices (whole or as stream deltas), logprobs, usage, envelopes."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from kvfleet_agent.outputs import CompletionOutput, Logprob, RequestOutput

Decode = Callable[[int], str]


def new_id(chat: bool) -> str:
    """An OpenAI-looking response id."""
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(outputs: Sequence[RequestOutput], samples_per_prompt: int = 1) -> dict[str, int]:
    """Token counts of a response: each prompt once (its samples share it), every sample's generated tokens."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs[::samples_per_prompt])
    completion = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _logprobs(c: CompletionOutput, start: int, chat: bool, decode: Decode, offset: int) -> dict[str, Any] | None:
    if c.logprobs is None:
        return None
    steps = c.logprobs[start:]
    if chat:
        return {"content": [{"token": decode(lp.token_id), "logprob": lp.logprob,
                             "top_logprobs": [{"token": decode(t), "logprob": v} for t, v in lp.top.items()]}
                            for lp in steps]}
    return _legacy(list(steps), [lp.token_id for lp in steps], decode, offset)


def _legacy(steps: list[Logprob | None], ids: list[int], decode: Decode, offset: int) -> dict[str, Any]:
    """Completions' logprobs: the chosen token always among top_logprobs (up to k + 1 entries, as OpenAI and vLLM)."""
    tokens = [decode(t) for t in ids]
    offsets = []
    for t in tokens:  # where each token starts in the choice's text, as vLLM: from the tokens' own strings
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [None if lp is None else lp.logprob for lp in steps],
            "top_logprobs": [None if lp is None else {**{decode(t): v for t, v in lp.top.items()},
                                                      decode(lp.token_id): lp.logprob} for lp in steps],
            "text_offset": offsets}


def echoed(out: RequestOutput, prompt_text: str, piece: dict[str, Any], decode: Decode,
           top_k: int | None = None) -> dict[str, Any]:
    """A completions choice (or a stream's first piece of it) with the prompt, and its logprobs, in front.

    top_k: the alternatives logprobs asked for, when prompt_logprobs asked the engine for more.
    """
    lp = piece["logprobs"]
    piece = {**piece, "text": prompt_text + piece["text"]}
    if lp is not None:
        ids = out.prompt_token_ids
        steps = list(out.prompt_logprobs or [None] * len(ids))
        if top_k is not None:  # top is in descending order (torch.topk's)
            steps = [None if s is None else replace(s, top=dict(list(s.top.items())[:top_k])) for s in steps]
        head = _legacy(steps, ids, decode, 0)
        end = head["text_offset"][-1] + len(head["tokens"][-1])
        piece["logprobs"] = {key: head[key] + ([o + end for o in lp[key]] if key == "text_offset" else lp[key])
                             for key in head}
    return piece


def prompt_only(out: RequestOutput) -> RequestOutput:
    """The output of a max_tokens 0 request (run with one token, as the engine needs): that token dropped."""
    c = out.outputs[0]
    empty = replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None,
                    finish_reason="length" if out.finished and c.finish_reason != "abort" else c.finish_reason,
                    stop_reason=None)
    return replace(out, outputs=[empty])


def choice(index: int, out: RequestOutput, chat: bool, decode: Decode, text: str | None = None,
           logprob_start: int = 0, delta: bool = False, first: bool = False, text_offset: int = 0,
           with_logprobs: bool = True) -> dict[str, Any]:
    """One entry of `choices`, whole or as a stream delta; text_offset: where this piece starts in the text."""
    c = out.outputs[0]
    text = c.text if text is None else text
    # "abort" too (as vLLM): a stream cut by a drain says so in its last chunk rather than just stopping.
    finish = c.finish_reason if out.finished else None
    lp = _logprobs(c, logprob_start, chat, decode, text_offset) if with_logprobs else None
    if not chat:
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
    if delta:
        d: dict[str, str] = {"role": "assistant"} if first else {}
        if text:
            d["content"] = text
        return {"index": index, "delta": d, "logprobs": lp, "finish_reason": finish}
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": lp,
            "finish_reason": finish}


def envelope(rid: str, model: str, chat: bool, choices: list[dict[str, Any]], stream: bool,
             usage_: dict[str, int] | None = None, created: int | None = None) -> dict[str, Any]:
    """The response object around a list of choices (`created` fixed per response, as OpenAI's)."""
    kind = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
    body: dict[str, Any] = {"id": rid, "object": kind, "created": created or int(time.time()), "model": model,
                            "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def cumulative_logprob(out: RequestOutput) -> float:
    """The sum of a sample's token logprobs: how best_of ranks its samples (vLLM's cumulative_logprob)."""
    return sum(lp.logprob for lp in out.outputs[0].logprobs or [])


def prompt_logprobs(out: RequestOutput, k: int, decode: Decode) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: per prompt token (None first), {token id: {logprob, rank, decoded_token}} of the token
    itself and its top k alternatives; an alternative's rank is its place among the top (ties share a rank)."""
    rendered: list[dict[str, dict[str, Any]] | None] = []
    for lp in out.prompt_logprobs or [None] * len(out.prompt_token_ids):
        if lp is None:
            rendered.append(None)
            continue
        # The prompt token first, then its alternatives (as vLLM orders them).
        entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": decode(lp.token_id)}}
        top = list(lp.top.items())[:k]
        for t, v in top:
            # Every vocabulary entry above a top-k value is itself in the top k, so counting there is exact.
            entry.setdefault(str(t), {"logprob": v, "rank": 1 + sum(o > v for _, o in top), "decoded_token": decode(t)})
        rendered.append(entry)
    return rendered
