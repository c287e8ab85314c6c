"""Speculation policy: how many draft tokens each decode gets per step, from measured step times and acceptance."""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


class StepTimeModel:
    """Exponentially weighted least-squares fit of seconds ≈ a + b * num_tokens over measured steps.

    Until the fit has seen `min_steps` steps with a weighted spread of at least `min_token_spread`
    tokens, it reports b = 0 (a = the mean step time): verification is then modelled as free, which
    favours speculating. That is what memory-bound hardware at small batch really does (a step reads
    all the weights whatever its token count), and speculating is also what makes num_tokens vary, so
    the fit learns the real b from the steps it causes. Likewise, when speculation is off for long
    enough that the spread decays away, b falls back to 0 and speculation is tried again.
    """

    def __init__(self, half_life_steps: float = 200.0, min_steps: int = 16, min_token_spread: float = 4.0) -> None:
        self.decay = 0.5 ** (1.0 / half_life_steps)
        self.min_steps = min_steps
        self.min_token_spread = min_token_spread
        self.steps = 0
        # Weighted mean and co-moments (West's update: stable where raw sums of x² would cancel).
        self._w = 0.0
        self._mx = 0.0
        self._my = 0.0
        self._cxx = 0.0
        self._cxy = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Add one step's duration; empty steps and non-finite or non-positive times are ignored."""
        if num_tokens <= 0 or not math.isfinite(seconds) or seconds <= 0.0:
            return
        x, y = float(num_tokens), seconds
        self._w = self.decay * self._w + 1.0
        dx = x - self._mx
        self._mx += dx / self._w
        self._my += (y - self._my) / self._w
        self._cxx = self.decay * self._cxx + dx * (x - self._mx)
        self._cxy = self.decay * self._cxy + dx * (y - self._my)
        self.steps += 1

    @property
    def fitted(self) -> bool:
        """Whether enough steps with enough spread in num_tokens were seen to trust the slope."""
        return self.steps >= self.min_steps and self._cxx / self._w >= self.min_token_spread ** 2

    def coefficients(self) -> tuple[float, float]:
        """(a, b), both >= 0: the fit, clamped, or the b = 0 prior before the fit is trusted."""
        if self.steps == 0:
            return 0.0, 0.0
        if not self.fitted:
            return self._my, 0.0
        b = self._cxy / self._cxx
        if b <= 0.0:  # noise, or step time really flat: the best fit with b = 0 is the mean
            return self._my, 0.0
        a = self._my - b * self._mx
        if a < 0.0:  # refit through the origin: b = E[xy] / E[x²]
            var, cov = self._cxx / self._w, self._cxy / self._w
            return 0.0, (cov + self._mx * self._my) / (var + self._mx ** 2)
        return a, b


@dataclass(slots=True)
class _Counts:
    """Exponentially forgotten Bernoulli trials: draft tokens accepted (successes) and first rejections (failures)."""

    hits: float = 0.0
    misses: float = 0.0

    def add(self, hits: int, misses: int, decay: float) -> None:
        keep = decay ** (hits + misses)  # forget per trial, so a long history fades at the rate new evidence comes
        self.hits = self.hits * keep + hits
        self.misses = self.misses * keep + misses


class SpecPolicy:
    """Decides each step how many draft tokens each decode request verifies, and learns when that pays.

    Acceptance follows the usual geometric model: each draft is accepted with probability α given the
    ones before it were, so a verification of k drafts with a accepted is a successes plus, when a < k,
    one failure (the rejected draft; later drafts were never tried). α̂ = hits / (hits + misses) is the
    maximum-likelihood estimate under that model (accepted / proposed would underestimate α). Each
    request's α_r is the posterior mean of its own forgotten counts under a prior of `prior_strength`
    trials at the global estimate, which in turn starts at `prior_acceptance`.

    A proposal may carry a kind: the proposer's own confidence class, the n-gram match length for prompt lookup (a
    4-token match's first draft was accepted 89-93% of the time on the bench's workloads, a 1-token match's 37-43%).
    Each kind has its own estimate, α_kind, with the global one as its prior, and a request's α_r,kind its prior
    α_kind: a long match then drafts deep and a short one shallow or not at all, where one α per request drafted both
    alike. Proposers without kinds use kind 0 throughout, which is the model above.

    Turning off is bounded: after a run of full acceptance a request's counts hold about 1.44 *
    request_half_life trials, and each all-rejected verification adds one failure, so α_r falls below a
    threshold θ after about request_half_life * log2(1/θ) verifications; the more a draft costs (larger
    θ), the sooner. Turning back on needs acceptance to be measured while off: observe_shadow.
    """

    def __init__(self, *, adaptive: bool = True, disable_by_batch_size: int | None = None,
                 step_half_life: float = 200.0, min_fit_steps: int = 16, min_token_spread: float = 4.0,
                 request_half_life: float = 10.0, global_half_life: float = 1000.0,
                 prior_acceptance: float = 0.6, prior_strength: float = 2.0, min_gain: float = 0.05) -> None:
        if not 0.0 <= prior_acceptance <= 1.0 or prior_strength <= 0.0:
            raise ValueError("need 0 <= prior_acceptance <= 1 and prior_strength > 0")
        self.adaptive = adaptive
        self.disable_by_batch_size = disable_by_batch_size
        self.step_time = StepTimeModel(step_half_life, min_fit_steps, min_token_spread)
        self.request_decay = 0.5 ** (1.0 / request_half_life)
        self.global_decay = 0.5 ** (1.0 / global_half_life)
        self.prior_acceptance = prior_acceptance
        self.prior_strength = prior_strength
        # Overheads the linear cost model does not see (proposing, rejection bookkeeping, KV slots of
        # rejected drafts): a draft must be expected to yield at least this much, so α → 0 turns
        # speculation off even while b is still the b = 0 prior.
        self.min_gain = min_gain
        self._global = _Counts()
        self._kinds: dict[int, _Counts] = {}
        self._requests: dict[str, dict[int, _Counts]] = {}

    # -- measurements ------------------------------------------------------------------------------

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step computed num_tokens tokens (drafts included) in `seconds`."""
        self.step_time.observe(num_tokens, seconds)

    def observe(self, request_id: str, proposed: int, accepted: int, kind: int = 0) -> None:
        """A verification of `proposed` drafts of this kind accepted the first `accepted` of them."""
        if not 0 <= accepted <= proposed:
            raise ValueError(f"need 0 <= accepted <= proposed, got {accepted} of {proposed}")
        if proposed:
            self._add(request_id, kind, accepted, int(accepted < proposed))

    def observe_shadow(self, request_id: str, hit: bool, kind: int = 0) -> None:
        """An unspeculated step whose proposer's first guess (of this kind) did (hit) or did not match the sampled
        token."""
        self._add(request_id, kind, int(hit), int(not hit))

    def _add(self, request_id: str, kind: int, hits: int, misses: int) -> None:
        per_kind = self._requests.setdefault(request_id, {})
        counts = per_kind.get(kind)
        if counts is None:  # (setdefault would build a _Counts on every call)
            counts = per_kind[kind] = _Counts()
        counts.add(hits, misses, self.request_decay)
        self._kinds.setdefault(kind, _Counts()).add(hits, misses, self.global_decay)
        self._global.add(hits, misses, self.global_decay)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's estimate (the global one keeps what it taught)."""
        self._requests.pop(request_id, None)

    # -- estimates ---------------------------------------------------------------------------------

    def global_acceptance(self) -> float:
        """Acceptance over all requests, recent trials weighing most; what a new request starts from."""
        g, s = self._global, self.prior_strength
        return (g.hits + s * self.prior_acceptance) / (g.hits + g.misses + s)

    def kind_acceptance(self, kind: int = 0) -> float:
        """α_kind: acceptance over all requests' drafts of this kind, with the global estimate as its prior."""
        g, s, k = self.global_acceptance(), self.prior_strength, self._kinds.get(kind)
        return g if k is None else (k.hits + s * g) / (k.hits + k.misses + s)

    def acceptance(self, request_id: str, kind: int = 0) -> float:
        """α_r: the request's estimated probability that a draft of this kind is accepted given the previous ones
        were."""
        g = self.kind_acceptance(kind)
        r = self._requests.get(request_id, {}).get(kind)
        if r is None:
            return g
        return (r.hits + self.prior_strength * g) / (r.hits + r.misses + self.prior_strength)

    # -- the decision ------------------------------------------------------------------------------

    def plan(self, candidates: Sequence[tuple[str, int]], num_other_tokens: int, *,
             num_decodes: int | None = None, kinds: Mapping[str, int] | None = None) -> dict[str, int]:
        """Drafts per candidate (0 = do not speculate) for a step that already holds num_other_tokens tokens.

        candidates: (request_id, the most drafts it can take). num_decodes: running decode requests,
        for disable_by_batch_size (default: the candidates). kinds: each candidate's proposal kind (default 0).

        Cost model: a step of M tokens takes a + b*M seconds and yields N expected tokens; every token
        already in the step (prefill chunk tokens too: work that must be done anyway) and each
        candidate's own decode token count 1, and the j-th draft of request r adds α_r^j. One more draft
        of gain g improves the step's tokens per second iff (N + g) / (a + b(M + 1)) > N / (a + bM),
        i.e. iff g > N*b / (a + b*M). Drafts are added in order of decreasing gain while that holds:
        gains only fall and N / (a + bM), hence the bar, only rises, so the first failure ends it, and
        the result is the best allocation under the model (for a fixed count the largest gains are best).
        """
        plan = {rid: 0 for rid, _ in candidates}
        decodes = len(candidates) if num_decodes is None else num_decodes
        if self.disable_by_batch_size is not None and decodes >= self.disable_by_batch_size:
            return plan
        if not self.adaptive:
            return {rid: max(0, most) for rid, most in candidates}
        a, b = self.step_time.coefficients()
        tokens = float(num_other_tokens + len(candidates))  # N
        work = float(num_other_tokens + len(candidates))  # M
        heap: list[tuple[float, str, float, int]] = []  # (-gain of the next draft, request, α, drafts left)
        for rid, most in candidates:
            alpha = self.acceptance(rid, kinds.get(rid, 0) if kinds else 0)
            if most > 0 and alpha > 0.0:
                heap.append((-alpha, rid, alpha, most))
        heapq.heapify(heap)
        while heap:
            neg_gain, rid, alpha, left = heap[0]
            gain = -neg_gain
            bar = tokens * b / (a + b * work) if b > 0.0 else 0.0
            if gain <= bar or gain < self.min_gain:
                break
            plan[rid] += 1
            tokens += gain
            work += 1.0
            if left > 1:
                heapq.heapreplace(heap, (-gain * alpha, rid, alpha, left - 1))
            else:
                heapq.heappop(heap)
        return plan

    def summary(self) -> dict[str, float]:
        """Plain numbers for metrics and logs."""
        a, b = self.step_time.coefficients()
        return {"a": a, "b": b, "global_acceptance": self.global_acceptance(),
                "steps_observed": float(self.step_time.steps), "step_model_fitted": float(self.step_time.fitted),
                "requests_tracked": float(len(self._requests))}
