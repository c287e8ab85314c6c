"""SpecSwitch: whether speculating pays at a batch size, from measured decode throughput with and without it.

The step-time model (spec_policy.py) prices a draft token at the marginal cost of a token, but turning a decode into
a verification costs more than its tokens on some hardware (a verification runs as a short prefill: its own
attention call and bookkeeping), so at large batch the model can keep speculating where it loses. The switch needs
no model: per batch-size bucket (powers of two) it keeps the better mode and tries the other for EXPLORE_RUN steps in
EXPLORE_EVERY so that a change (acceptance, batch mix) is seen.

Which mode is better is evidence gathered over exploring runs, not the last run's reading: each run is compared
with the stable mode's PAIR steps just before it and PAIR just after (the machine's speed drifts by tens of percent
within seconds, so only neighbouring steps share its speed), and the log of that ratio joins an exponentially
weighted mean over runs (RUN_WEIGHT). Judged alone, a 3-step run read a mode 5% behind as ahead often enough to
take it up for a stretch, each take-up costing a draft model its catch-up and a closed batch its tail; pooled, one
lucky run moves the verdict by a fraction of its reading. The first verdict comes from the learning phase's
MIN_SAMPLES steps of each mode. Runs, not single steps: a draft model that was off
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
from dataclasses import dataclass, field

EXPLORE_EVERY = 64
EXPLORE_EVERY_FAR = 256
EXPLORE_RUN = 3
FAR = 0.75  # the worse mode's share of the better's rate below which it is explored EXPLORE_EVERY_FAR
MARGIN = 0.05  # speculating must deliver this much more than not to be chosen
EXPLORE_BUDGET = 0.01  # the share of the time that exploring runs (transitions and their steps) may lose while off
MIN_SAMPLES = 8  # steps of each mode in a bucket before the comparison is trusted (a verification yields 0..k)
# Per step of the bucket, whichever mode ran it: a mode's rate (what a step costs, for the runs' spacing) forgets with
# age, not with its own observations.
DECAY = 0.95
PAIR = 3  # stable steps before and after an exploring run that it is compared with
# Neighbours count only within this many measured steps (of any bucket) of the run: a bucket seen in a batch's tail
# (its last requests, at a smaller size) meets its steps of other batches seconds apart, whose comparison is noise.
# Judged so, such readings once turned a draft model off at batch 1, where it won 1.4x, for a whole bench.
NEAR = 2 * PAIR
RUN_WEIGHT = 0.3  # a run's share of the evidence: about the last three runs decide


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


@dataclass
class _Run:
    """An exploring run: its mode, its tokens and seconds, and the stable mode's steps before and after it."""

    mode: bool
    before: list[tuple[float, float]]
    last: int  # the switch's clock at the run's last step (or its start)
    tokens: float = 0.0
    seconds: float = 0.0
    after: list[tuple[float, float]] = field(default_factory=list)


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
        self.evidence: dict[int, float] = {}  # log(on's rate / off's): the learning phase's, then runs' weighted mean
        self._clock = 0  # measured steps of every bucket so far
        # The last PAIR steps of each bucket and mode: (tokens, seconds, the clock after it).
        self._recent: dict[tuple[int, bool], list[tuple[float, float, int]]] = {}
        self._runs: dict[int, _Run] = {}  # the bucket's exploring run, until PAIR stable steps have followed it
        self._surprised: dict[int, bool] = {}  # the last run read the mode not chosen ahead: check it again soon
        self._ended: dict[int, int] = {}  # the bucket's step where its last exploring run ended

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
        ev = self.evidence.setdefault(b, math.log(on.rate / off.rate) if on.rate > 0 and off.rate > 0 else 0.0)
        # Hysteresis: speculation is taken up when it wins by MARGIN and given up only when it stops winning, so
        # evidence that wanders about the margin does not flip the mode every few runs; a flip costs a draft model a
        # catch-up of every token it skipped.
        best = self.speculating[b] = ev > (0.0 if self.speculating.get(b) else math.log1p(MARGIN))
        # The worse mode's rate as a share of the better's; after a run that read the other mode ahead, as if they
        # were level, so that another run checks that reading soon rather than after the far spacing.
        worse = 1.0 if self._surprised.get(b) else math.exp(-abs(ev))
        every = EXPLORE_EVERY
        if not best and off.step_s > 0:
            # What an exploring run costs against staying off: the transition (a draft model's catch-up), and its
            # steps' shortfall in tokens (EXPLORE_RUN steps at on's rate instead of off's), spaced to the budget.
            # A known transition is the run's first step whole (its catch-up and its tokens): the rest are charged.
            every = EXPLORE_EVERY_FAR if worse < FAR and ev < 0 else EXPLORE_EVERY
            shortfall = EXPLORE_RUN * on.step_s * (1.0 - worse) if ev < 0 else 0.0
            every = max(every, math.ceil((self.transition_s.get(b, 0.0) + shortfall) / (EXPLORE_BUDGET * off.step_s)))
        elif best and on.step_s > 0:
            # Exploring off while speculating costs no transition, only its steps' shortfall: spaced by the budget
            # alone (off's runs are the only check that speculation still pays).
            cost = EXPLORE_RUN * off.step_s * (1.0 - worse)
            every = max(every, math.ceil(cost / (EXPLORE_BUDGET * on.step_s)))
        # A draft model's run starts with its transition, which is not measured: one step more measures as many.
        run = EXPLORE_RUN + (1 if b in self.transition_s else 0)
        at = self.explore_at.setdefault(b, every)
        if count >= at + run:
            at = self.explore_at[b] = max(at + every, count)
        elif self._surprised.get(b) and count < at:  # judged after the next run was set: bring that run forward
            at = self.explore_at[b] = max(count, min(at, self._ended.get(b, 0) + every))
        if count == at + run - 1:
            self._ended[b] = count + 1
        exploring = count >= at
        if exploring and (b not in self._runs or self._runs[b].mode == best):
            # A run begins: compared with the stable mode's steps just before it (and, when they come, after it).
            self._judge(b)  # one still waiting for its after-steps is judged on what it has
            near = [(t, sec) for t, sec, at_ in self._recent.get((b, best), []) if at_ > self._clock - NEAR]
            self._runs[b] = _Run(not best, near, last=self._clock)
            self._surprised[b] = False
        return not best if exploring else best

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
        if not (tokens > 0 and seconds > 0):
            return
        b = bucket(batch)
        self._clock += 1
        self.rates.setdefault((b, speculated), _Rate()).add(tokens, seconds, self.decisions.get(b, 0))
        run = self._runs.get(b)
        if run is not None and self._clock - run.last > NEAR:  # the bucket went quiet: its neighbours are gone
            self._judge(b)
            run = None
        if run is not None and run.mode == speculated and not run.after:
            run.tokens += tokens
            run.seconds += seconds
            run.last = self._clock
            return
        recent = self._recent.setdefault((b, speculated), [])
        recent.append((tokens, seconds, self._clock))
        del recent[:-PAIR]
        if run is not None and run.mode != speculated:
            run.after.append((tokens, seconds))
            if len(run.after) >= PAIR:
                self._judge(b)

    def _judge(self, b: int) -> None:
        """Fold the bucket's exploring run into the evidence: log(its rate / its neighbours'), signed for on / off."""
        run = self._runs.pop(b, None)
        around = [] if run is None else run.before + run.after
        if run is None or run.seconds <= 0 or not around:
            return
        reading = math.log((run.tokens / run.seconds) / (sum(t for t, _ in around) / sum(s for _, s in around)))
        signed = reading if run.mode else -reading  # log(on / off) as this run saw it
        old = self.evidence.get(b, 0.0)
        self.evidence[b] = (1 - RUN_WEIGHT) * old + RUN_WEIGHT * signed
        self._surprised[b] = (signed > math.log1p(MARGIN)) != self.speculating.get(b, False) and abs(signed) > MARGIN

    def observe_transition(self, batch: int, seconds: float) -> None:
        """The first step of speculation after steps without took `seconds`, its catch-up included."""
        b = bucket(batch)
        old = self.transition_s.get(b)
        self.transition_s[b] = seconds if old is None else 0.5 * (old + seconds)

    def summary(self) -> dict[str, float]:
        """Each bucket's measured tokens/s with and without speculation, for logs."""
        return {f"b{b}_{'on' if s else 'off'}": r.rate for (b, s), r in sorted(self.rates.items())}
