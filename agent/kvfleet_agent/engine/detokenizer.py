"""Incremental detokenization for streaming: UTF-8-safe text deltas and stop-string detection."""

from __future__ import annotations

from kvfleet_agent.models.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]

# Prompt tokens decoded as left context for the first output tokens, so tokenizers whose decoder
# depends on what precedes a token (SentencePiece's leading-space rule) render it as in the full text.
_PROMPT_CONTEXT_TOKENS = 5
# Ids before the decode window are dropped once this many have piled up, keeping memory O(window).
_TRIM_THRESHOLD = 256
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, one request at a time.

    Decoding uses two small windows over the ids (vLLM's prefix/read offsets): `prefix` ids already
    turned into text, kept as context, and `read` ids not yet emitted. Only the new ids are
    decoded each step, so the cost per token does not grow with the output length.

    Text is held back from deltas while (a) it ends in U+FFFD, i.e. a multi-byte character whose
    remaining bytes have not been generated yet, or (b) it ends with something that could be the
    start of a stop string. Call `flush()` when the request ends without a stop string to get
    what is still held back; afterwards the concatenated deltas equal `text`.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        stop: list[str],
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        for i, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop[{i}] must be a non-empty string, got {s!r}; remove it from stop")
        self._tokenizer = tokenizer
        self._stop = list(dict.fromkeys(stop))
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._include_stop = include_stop_str_in_output
        self._skip_special = skip_special_tokens

        context = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        # A prompt cut inside a multi-byte character would make the context text end in U+FFFD that
        # the first output bytes then complete; the completed character belongs to neither side, so
        # such a context is dropped and the output decodes on its own.
        if context and self._decode(context).endswith(_REPLACEMENT):
            context = []
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text: str | None = None  # decode(ids[prefix:read]); cached until the offsets move

        # Output text = emitted chunks + pending. Only `pending` (held back, at most one stop string
        # long) and `tail` (the last max_stop_len - 1 chars, where a stop string may have begun)
        # are touched per step, so long outputs are never copied as a whole.
        self._emitted_chunks: list[str] = []
        self._pending = ""
        self._tail = ""
        self._finished = False
        self.stopped: str | None = None  # the stop string that ended the output, if any
        # False while min_tokens is not reached: text is searched for stop strings only from then on (as vLLM).
        self.stops_active = True

    @property
    def text(self) -> str:
        """Output text so far, cut at the stop string; includes held-back text but no unfinished character."""
        if len(self._emitted_chunks) > 1:
            self._emitted_chunks = ["".join(self._emitted_chunks)]
        return (self._emitted_chunks[0] if self._emitted_chunks else "") + self._pending

    @property
    def finished(self) -> bool:
        """True once a stop string matched or flush() was called."""
        return self._finished

    def add_tokens(self, new_ids: list[int]) -> str:
        """Append generated ids and return the text delta that is now safe to stream."""
        if self._finished:
            # The engine may have sampled a few more tokens in the step that hit the stop string.
            return ""
        if not new_ids:
            return ""
        self._ids.extend(new_ids)
        prefix_text = self._cached_prefix_text()
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            self._append(new_text[len(prefix_text) :])
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._prefix_text = None
            self._maybe_trim()
        return self._take_delta(final=False)

    def flush(self) -> str:
        """End of output without a stop string: return the held-back rest (including a trailing U+FFFD)."""
        if self._finished:
            return ""
        prefix_text = self._cached_prefix_text()
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text):
            self._append(new_text[len(prefix_text) :])
        self._prefix_offset = self._read_offset = len(self._ids)
        self._prefix_text = None
        delta = self._take_delta(final=True)
        self._finished = True
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _cached_prefix_text(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return self._prefix_text

    def _maybe_trim(self) -> None:
        if self._prefix_offset >= _TRIM_THRESHOLD:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _append(self, piece: str) -> None:
        """Add decoded text and cut it at the first stop string that now appears."""
        if not self._stop:
            self._pending += piece
            return
        # Any new match must end inside `piece`, so only the tail that can reach into it is searched.
        window = self._tail + piece
        if not self.stops_active:
            self._pending += piece
            self._tail = window[max(0, len(window) - (self._max_stop_len - 1)) :]
            return
        best: tuple[int, int, str] | None = None  # (end, start, stop) of the earliest-ending match
        for s in self._stop:
            start = window.find(s)
            if start < 0:
                continue
            # Earliest end is what a character-by-character stream would hit first; on a tie the
            # longer (earlier-starting) stop string wins.
            key = (start + len(s), start, s)
            if best is None or key[:2] < best[:2]:
                best = key
        if best is None:
            self._pending += piece
            self._tail = window[max(0, len(window) - (self._max_stop_len - 1)) :]
            return
        end, start, s = best
        self.stopped = s
        self._finished = True
        # Characters of `window` that are cut off. They are all pending: a stop string can only start
        # in text that was held back (or, when it is included in the output, end in the new piece).
        cut = len(window) - (end if self._include_stop else start)
        pending = self._pending + piece
        self._pending = pending[: len(pending) - cut]

    def _take_delta(self, final: bool) -> str:
        hold = 0
        # With include_stop_str_in_output a stop prefix is valid output either way, so nothing is held.
        if not final and not self._finished and self._stop and not self._include_stop:
            hold = self._stop_prefix_len()
        n = max(0, len(self._pending) - hold)
        delta = self._pending[:n]
        self._pending = self._pending[n:]
        if delta:
            self._emitted_chunks.append(delta)
        return delta

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of some stop string."""
        text = self._tail  # the last max_stop_len - 1 chars: as long as a proper prefix can be
        longest = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest
