"""SpecSwitch: whether speculating pays at a batch size, from measured decode throughput with and without it.

The step-time model (spec_policy.py) prices a draft token at the marginal cost of a token, but turning a decode into
a verification costs more than its tokens on some hardware (a verification runs as a short prefill: its own
attention call and bookkeeping), so at large batch the model can keep speculating where it loses. The switch needs
no model: per batch-size bucket (powers of two) it keeps the exponentially weighted tokens/s of pure-decode steps
that speculated and of those that did not, takes the better mode, and tries the other for EXPLORE_RUN steps in
EXPLORE_EVERY so that a change (acceptance, batch mix) is seen. Runs, not single steps: a draft model that was off
must first catch up, so the first step of a run is a transition its caller may leave unmeasured, and the rest show
the mode's steady rate. Exploring costs at most EXPLORE_RUN/EXPLORE_EVERY of the loss between the two modes; where
one mode is far behind (below FAR of the other's rate) a change large enough to reverse the order is unlikely and
each exploring step costs more, so it explores every EXPLORE_EVERY_FAR steps instead. A draft model's transition
(its catch-up over every token it skipped while off) can cost many steps' time at large batch: the caller reports
it (observe_transition), and exploring runs are spaced so that what they lose against staying off (the transition,
and the run's steps at the worse rate) is at most EXPLORE_BUDGET of the time.

A step that mixes in prefill chunks is not measured (its time is mostly the prefill's), so it cannot teach its bucket,
and learning there would never end: such steps take the verdict of the nearest bucket that has learnt both modes (the
larger on a tie: not speculating is the cheaper bet), or do not speculate while none has. A draft model would
otherwise speculate in every mixed step at the start of a batch, and pay a catch-up for each.

Speculation must win by MARGIN to be taken up (and is kept while it wins at all): a step's tokens per second do not
see all it costs. Requests that speculate finish at different times, so a batch runs its tail smaller; a
verification's ITL varies more; rejected drafts take KV slots. Where the two modes are within the margin, not
speculating is the cheaper bet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

EXPLORE_EVERY = 64
EXPLORE_EVERY_FAR = 256
EXPLORE_RUN = 3
FAR = 0.75  # the worse mode's share of the better's rate below which it is explored EXPLORE_EVERY_FAR
MARGIN = 0.05  # speculating must deliver this much more than not to be chosen
EXPLORE_BUDGET = 0.01  # the share of the time that exploring runs (transitions and their steps) may lose while off
MIN_SAMPLES = 8  # steps of each mode in a bucket before the comparison is trusted (a verification yields 0..k)
# Per step of the bucket, whichever mode ran it: a mode's rate forgets with age, not with its own observations, so
# an exploring run is judged by what it measures now rather than by the same mode's steps from runs ago.
DECAY = 0.95


@dataclass
class _Rate:
    """An exponentially weighted tokens/s and step time, how many steps it has seen and the bucket's step of the
    last."""

    tokens: float = 0.0
    seconds: float = 0.0
    weight: float = 0.0
    n: int = 0
    last: int = 0

    def add(self, tokens: float, seconds: float, step: int) -> None:
        keep = DECAY ** max(0, step - self.last)
        self.tokens = keep * self.tokens + tokens
        self.seconds = keep * self.seconds + seconds
        self.weight = keep * self.weight + 1.0
        self.n += 1
        self.last = step

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def step_s(self) -> float:
        return self.seconds / self.weight if self.weight > 0 else 0.0


def bucket(batch: int) -> int:
    """The bucket of a batch size: its power of two (1, 2, 4, ...)."""
    return 1 << max(0, batch.bit_length() - 1)


class SpecSwitch:
    """Speculate or not, per batch-size bucket, from measured throughput."""

    def __init__(self) -> None:
        self.rates: dict[tuple[int, bool], _Rate] = {}
        self.decisions: dict[int, int] = {}
        self.speculating: dict[int, bool] = {}  # the bucket's chosen mode, outside its exploring runs
        self.explore_at: dict[int, int] = {}  # the bucket's step where its next exploring run starts
        self.transition_s: dict[int, float] = {}  # the seconds of a transition into speculation, weighted

    def choose(self, batch: int, measured: bool = True) -> bool:
        """Whether this step should speculate (a step of `batch` decode requests; measured: it will be observed, no
        prefill chunk in it)."""
        b = bucket(batch)
        if not measured:
            return self._borrowed(b)
        on, off = self.rates.get((b, True), _Rate()), self.rates.get((b, False), _Rate())
        count = self.decisions[b] = self.decisions.get(b, 0) + 1
        if on.n < MIN_SAMPLES:
            return True  # learn what speculating does here first: it is what the operator asked for
        if off.n < MIN_SAMPLES:
            return False
        # Hysteresis: speculation is taken up when it wins by MARGIN and given up only when it stops winning, so
        # rates that wander about the margin (a verification yields 0..k tokens) do not flip the mode every few
        # steps; a flip costs a draft model a catch-up of every token it skipped.
        best = self.speculating[b] = on.rate > off.rate * (1 + (0.0 if self.speculating.get(b) else MARGIN))
        every = EXPLORE_EVERY
        if not best and off.step_s > 0 and off.rate > 0:
            # What an exploring run costs against staying off: the transition (a draft model's catch-up), and its
            # steps' shortfall in tokens (EXPLORE_RUN steps at on's rate instead of off's), spaced to the budget.
            # A known transition is the run's first step whole (its catch-up and its tokens): the rest are charged.
            every = EXPLORE_EVERY_FAR if on.rate < FAR * off.rate else EXPLORE_EVERY
            cost = self.transition_s.get(b, 0.0) + EXPLORE_RUN * on.step_s * max(0.0, 1.0 - on.rate / off.rate)
            every = max(every, math.ceil(cost / (EXPLORE_BUDGET * off.step_s)))
        elif best and on.step_s > 0 and on.rate > 0:
            # Exploring off while speculating costs no transition, only its steps' shortfall: spaced by the budget
            # alone. One run in a slow spell can read off as far behind, and off's runs are the only check that
            # speculation still pays: spaced EXPLORE_EVERY_FAR, such a reading stood for hundreds of steps.
            cost = EXPLORE_RUN * off.step_s * max(0.0, 1.0 - off.rate / on.rate)
            every = max(every, math.ceil(cost / (EXPLORE_BUDGET * on.step_s)))
        # A draft model's run starts with its transition, which is not measured: one step more measures as many.
        run = EXPLORE_RUN + (1 if b in self.transition_s else 0)
        at = self.explore_at.setdefault(b, every)
        if count >= at + run:
            at = self.explore_at[b] = max(at + every, count)
        return not best if count >= at else best

    def _trusted(self, b: int) -> bool:
        return min(self.rates.get((b, True), _Rate()).n, self.rates.get((b, False), _Rate()).n) >= MIN_SAMPLES

    def _borrowed(self, b: int) -> bool:
        """The verdict of the nearest bucket that has learnt both modes (b itself if it has), False if none has."""
        learnt = [c for c in self.speculating if self._trusted(c)]
        if not learnt:
            return False
        return self.speculating[min(learnt, key=lambda c: (abs(c.bit_length() - b.bit_length()), -c))]

    def observe(self, batch: int, speculated: bool, tokens: float, seconds: float) -> None:
        """A pure-decode step of `batch` requests delivered `tokens` tokens in `seconds`."""
        if tokens > 0 and seconds > 0:
            b = bucket(batch)
            self.rates.setdefault((b, speculated), _Rate()).add(tokens, seconds, self.decisions.get(b, 0))

    def observe_transition(self, batch: int, seconds: float) -> None:
        """The first step of speculation after steps without took `seconds`, its catch-up included."""
        b = bucket(batch)
        old = self.transition_s.get(b)
        self.transition_s[b] = seconds if old is None else 0.5 * (old + seconds)

    def summary(self) -> dict[str, float]:
        """Each bucket's measured tokens/s with and without speculation, for logs."""
        return {f"b{b}_{'on' if s else 'off'}": r.rate for (b, s), r in sorted(self.rates.items())}
