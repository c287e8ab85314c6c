"""The requests of a load test (synthetic prompts or a prompt file) and their Poisson arrival schedule."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

__all__ = [
    "WORDS",
    "LengthDist",
    "RequestSpec",
    "arrival_schedule",
    "file_requests",
    "load_prompt_file",
    "poisson_arrivals",
    "synthetic_requests",
]

# Common short English words: almost all are a single token (with their leading space) in the usual BPE
# vocabularies, so a prompt of N words is about N tokens whatever model the server runs.
_WORD_TEXT = """
the of and to in is it you that he was for on are with as his they be at one have this from or had by word but what
some we can out other were all there when up use your how said an each she which do their time if will way about many
then them write would like so these her long make thing see him two has look more day could go come did number sound no
most people my over know water than call first who may down side been now find any new work part take get place made
live where after back little only round man year came show every good me give our under name very through just form
great think say help low line turn cause much mean before move right boy old too same tell does set three want air well
also play small end put home read hand port large add even land here must big high such follow act why ask men change
went light kind off need house picture try us again animal point mother world near build self earth father head stand
own page should country found answer school grow study still learn plant cover food sun four between state keep eye
never last let thought city tree cross farm hard start might story saw far sea draw left late run while press close
night real life few north open seem together next white children begin got walk example paper group always music those
both mark often letter until mile river car feet care second book carry took science eat room friend began idea fish
mountain stop once base hear horse cut sure watch color face wood main enough plain girl usual young ready above ever
red list though feel talk bird soon body dog family direct leave song measure door product black short class wind
question happen complete ship area half rock order fire south problem piece told knew pass since top whole king space
heard best hour better true during hundred five remember step early hold west ground interest reach fast sing listen
six table travel less morning ten simple several toward war lay against pattern slow center love person money serve
appear road map rain rule pull cold notice voice unit power town fine certain fly fall lead cry dark machine note wait
plan figure star box field rest correct able pound done drive stood front teach week final gave green quick develop
ocean warm free minute strong special mind behind clear tail produce fact street inch nothing course stay wheel full
force blue object decide surface deep moon island foot system busy test record boat common gold possible plane dry
wonder laugh thousand ago ran check game shape hot miss brought heat snow tire bring yes distant fill east paint
language among"""
WORDS: tuple[str, ...] = tuple(dict.fromkeys(_WORD_TEXT.split()))

# Independent random streams per purpose, so that e.g. changing the request rate leaves the prompts unchanged.
_PROMPT_STREAM = 1
_ARRIVAL_STREAM = 2

@dataclass(frozen=True)
class LengthDist:
    """Integer lengths in [lo, hi] with mean `mean`: a Beta(2p, 2(1-p)) scaled onto the range.

    That is the uniform distribution when the mean is the range's midpoint and skews towards the mean
    otherwise, so --x MEAN --x-range LO HI means what it says for any MEAN inside the range.
    """

    mean: float
    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not 1 <= self.lo <= self.mean <= self.hi:
            raise ValueError(f"need 1 <= LO <= MEAN <= HI, got LO={self.lo} MEAN={self.mean} HI={self.hi}")

    @classmethod
    def build(cls, mean: float | None, bounds: list[int] | None, default: int) -> LengthDist:
        if bounds is None:
            m = int(default if mean is None else mean)
            return cls(m, m, m)
        lo, hi = bounds
        return cls((lo + hi) / 2 if mean is None else mean, lo, hi)

    def sample(self, rng: np.random.Generator) -> int:
        span = self.hi - self.lo
        p = (self.mean - self.lo) / span if span else 0.0
        if p <= 0.0:
            return self.lo
        if p >= 1.0:
            return self.hi
        return self.lo + round(float(rng.beta(2 * p, 2 * (1 - p))) * span)

    def to_json(self) -> dict[str, float]:
        return {"mean": self.mean, "lo": self.lo, "hi": self.hi}


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: the prompt and its max_tokens."""

    index: int
    prompt: str
    max_tokens: int
    prompt_words: int | None = None  # synthetic prompts only


def synthetic_requests(seed: int, prompt_len: LengthDist, max_tokens: LengthDist) -> Iterator[RequestSpec]:
    """Endless random-word prompts, the same for the same seed and lengths."""
    rng = np.random.default_rng([seed, _PROMPT_STREAM])
    for i in itertools.count():
        n = prompt_len.sample(rng)
        m = max_tokens.sample(rng)
        words = rng.integers(0, len(WORDS), size=n)
        yield RequestSpec(i, " ".join(WORDS[int(w)] for w in words), m, n)


def load_prompt_file(path: str) -> list[tuple[str, int | None]]:
    """(prompt, max_tokens or None) from a JSONL file of {"prompt": str, "max_tokens": int (optional)}."""
    entries: list[tuple[str, int | None]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ValueError(f"{path}:{lineno}: expected an object with a string \"prompt\"")
            mt = obj.get("max_tokens")
            if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt < 1):
                raise ValueError(f"{path}:{lineno}: \"max_tokens\" must be a positive integer")
            entries.append((obj["prompt"], mt))
    if not entries:
        raise ValueError(f"{path}: no prompts")
    return entries


def file_requests(entries: list[tuple[str, int | None]], seed: int, max_tokens: LengthDist) -> Iterator[RequestSpec]:
    """The file's prompts in order, cycled; entries without max_tokens draw it from max_tokens."""
    rng = np.random.default_rng([seed, _PROMPT_STREAM])
    for i, (prompt, mt) in zip(itertools.count(), itertools.cycle(entries), strict=False):
        yield RequestSpec(i, prompt, mt if mt is not None else max_tokens.sample(rng))


def poisson_arrivals(rate: float, seed: int) -> Iterator[float]:
    """Endless arrival times (seconds from the start) of a Poisson process of `rate` per second; inf: all at 0."""
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if math.isinf(rate):
        yield from itertools.repeat(0.0)
        return
    rng = np.random.default_rng([seed, _ARRIVAL_STREAM])
    t = 0.0
    while True:
        for gap in rng.exponential(1.0 / rate, size=1024):  # drawn in blocks: one numpy call per 1024 arrivals
            t += float(gap)
            yield t


def arrival_schedule(n: int, rate: float, seed: int) -> list[float]:
    """The first n arrival times of poisson_arrivals."""
    return list(itertools.islice(poisson_arrivals(rate, seed), n))
