"""Speculator: which running decodes speculate this step and with which draft tokens (n-gram prompt lookup and suffix
decoding here; a draft model's proposals handed in by the engine), and vLLM's speculative-decoding counters."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvfleet_agent.core.ngram import NgramIndex
from kvfleet_agent.core.request import Request
from kvfleet_agent.core.scheduler_output import SchedulerOutput
from kvfleet_agent.core.spec_policy import SpecPolicy
from kvfleet_agent.core.spec_switch import SpecSwitch
from kvfleet_agent.core.suffix import SuffixCache
from kvfleet_agent.sampling_params import SamplingParams
from kvfleet_agent.spec_config import MODEL_FREE, SpeculativeConfig

# A suffix proposal's kind (SpecPolicy): its match length, capped, and whether the shared cache or the request's own
# tokens gave it; the two sources' acceptance differ at the same match length.
SUFFIX_KINDS = 8
# Ended requests' output tokens indexed into suffix decoding's shared trie per step (~4 us each at depth 8): 64
# requests ending together share their 4,096 tokens over 16 steps rather than stall one by ~15 ms. A backlog drains
# at a sixteenth a step at least, so it stays bounded (16 steps' output) whatever the output rate.
SUFFIX_FLUSH_TOKENS = 256
SUFFIX_FLUSH_STEPS = 16


@dataclass
class SpecCounters:
    """Monotonic totals with vLLM's meaning: verifications (drafts), draft tokens, accepted draft tokens, and
    accepted tokens by draft position (position i counts verifications that accepted at least i + 1 drafts)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, proposed: int, accepted: int, k: int) -> None:
        """One verification of `proposed` drafts that accepted `accepted`."""
        if len(self.accepted_per_position) < k:
            self.accepted_per_position += [0] * (k - len(self.accepted_per_position))
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_position[i] += 1


def speculates(params: SamplingParams) -> bool:
    """Whether requests with these params may speculate: their tokens are sampled from the model's distribution
    alone. Logits processing, grammars and logprobs read or report per-position state the verification does not
    rebuild, so those requests decode one token a step (exactly as before), in the same steps as speculating ones."""
    return not params.needs_history and params.logprobs is None and params.prompt_logprobs is None


def eligible(req: Request) -> bool:
    """Whether a request may speculate now: its params allow it (speculates) and max_tokens leaves room for a draft."""
    return speculates(req.sampling_params) and req.num_output_tokens + 1 < req.sampling_params.max_tokens


class Speculator:
    """Proposes drafts for decode requests and learns from their verification."""

    def __init__(self, config: SpeculativeConfig, policy: SpecPolicy | None = None) -> None:
        self.config = config
        self.policy = policy or SpecPolicy(adaptive=config.adaptive,
                                           disable_by_batch_size=config.disable_by_batch_size)
        self.counters = SpecCounters(accepted_per_position=[0] * config.num_speculative_tokens)
        self.indexes: dict[str, NgramIndex] = {}
        self.suffix = SuffixCache(config.suffix_max_tree_depth, config.suffix_max_cached_requests,
                                  config.suffix_max_cached_tokens) if config.method == "suffix" else None
        self.external: dict[str, list[int]] = {}  # a draft model's proposals for each request's next step
        self.shadow: dict[str, int] = {}  # first guesses not sent this step, checked against the sampled token
        # Each request's last proposal's kind (SpecPolicy): its n-gram match length, a suffix proposal's match length
        # and source; 0 for a draft model's.
        self.kinds: dict[str, int] = {}
        self.switch = SpecSwitch()
        self.choice: tuple[int, bool] | None = None  # this step's (decode requests, whether it speculates)
        # A draft model proposes after a step for the next one, and costs k forwards whether or not its drafts are
        # sent, so the switch decides one step ahead for it: draft_k is how many tokens it proposes after this step
        # (-1: its configured k, 0: it does not run).
        self.draft_k = -1
        # A draft's run, exponentially weighted: its first proposal (the catch-up forward, and the step's bookkeeping)
        # and each further one, which costs far less where the proposal loop runs in one call.
        self._first_s: float | None = None
        self._forward_s: float | None = None
        self._overhead_s: float | None = None  # a step's seconds outside the model pass, likewise
        self._draft_s = 0.0  # the draft's seconds in the last step, which served this one
        self._last_choice: bool | None = None  # the previous step's mode (a draft model's transitions go unmeasured)

    def propose(self, decodes: Sequence[Request], num_other_tokens: int, budget: int) -> dict[str, list[int]]:
        """Drafts for this step's decode requests (only those that get any), within `budget` extra tokens."""
        proposals: dict[str, list[int]] = {}
        if self.suffix is not None:
            self.suffix.flush(max(SUFFIX_FLUSH_TOKENS, self.suffix.pending_tokens // SUFFIX_FLUSH_STEPS))
        ngram, on = self.config.method in MODEL_FREE, True
        if ngram and self.config.adaptive and any(eligible(req) for req in decodes):
            # Decided before guessing: while the switch keeps speculation off, the lookups (a Python scan per request
            # per step) are skipped; its exploring runs measure acceptance afresh.
            on = self.switch.choose(len(decodes), measured=not num_other_tokens)
        # A draft model's proposals came from its last run; none (it was off) leaves nothing to look up per request.
        candidates = [req for req in decodes if eligible(req)] if on and (ngram or self.external) else []
        for req in candidates:
            room = min(self.config.num_speculative_tokens, req.sampling_params.max_tokens - req.num_output_tokens - 1,
                       req.max_model_len - req.num_tokens - 1)
            guess, kind = self._guess(req, room) if room > 0 else ([], 0)
            if guess:
                proposals[req.request_id] = guess
                self.kinds[req.request_id] = kind
        self.choice = None
        if self.config.method == "draft_model" and decodes:
            n, limit = len(decodes), self.config.disable_by_batch_size
            if self.config.adaptive:
                # This step's choice was made last step (the draft ran, or not, for it); it is measured whether or
                # not the draft had anything to propose, so the switch sees both modes.
                self.choice = (n, self.draft_k != 0)
            # A step with prefill chunks is not measured; the next one likely is not either.
            runs = (limit is None or n < limit) and (
                not self.config.adaptive or self.switch.choose(n, measured=not num_other_tokens))
            self.draft_k = (self._best_k(n) if self.config.adaptive else -1) if runs else 0
        elif self.config.adaptive and (proposals or not on):
            self.choice = (len(decodes), on)
        plan = self.policy.plan([(rid, len(d)) for rid, d in proposals.items()], num_other_tokens,
                                num_decodes=len(decodes), kinds=self.kinds) \
            if self.choice is None or self.choice[1] else {}
        drafts: dict[str, list[int]] = {}
        for rid, guess in proposals.items():
            n = min(plan.get(rid, 0), budget)
            if n > 0:
                drafts[rid] = guess[:n]
                budget -= n
            else:
                self.shadow[rid] = guess[0]
        return drafts

    def _guess(self, req: Request, room: int) -> tuple[list[int], int]:
        """Up to `room` draft tokens for the request, and their kind (SpecPolicy): the n-gram match length, or a
        suffix proposal's match length and source."""
        if self.suffix is not None:
            c = self.config
            g = self.suffix.propose(req.request_id, req.token_ids, req.num_prompt_tokens, room,
                                    c.suffix_min_token_prob, c.suffix_max_spec_factor)
            return g.tokens, min(g.matched, SUFFIX_KINDS) + (SUFFIX_KINDS if g.shared else 0)
        if self.config.method != "ngram":
            return self.external.get(req.request_id, [])[:room], 0
        index = self.indexes.get(req.request_id)
        if index is None:
            index = self.indexes[req.request_id] = NgramIndex(self.config.prompt_lookup_min,
                                                              self.config.prompt_lookup_max)
        index.sync(req.token_ids)
        return index.lookup(room)

    def verified(self, req: Request, draft: Sequence[int], accepted: int) -> None:
        """A sampling step of `req` ended: it verified `draft` and accepted the first `accepted`, or (no draft)
        decoded one token, which tells whether the first guess it was not sent would have been accepted."""
        rid = req.request_id
        kind = self.kinds.get(rid, 0)
        if draft:
            self.counters.add(len(draft), accepted, self.config.num_speculative_tokens)
            self.policy.observe(rid, len(draft), accepted, kind)
        guess = self.shadow.pop(rid, None)
        if guess is not None and req.num_new_tokens:
            self.policy.observe_shadow(rid, req.token_ids[req.num_tokens - req.num_new_tokens] == guess, kind)

    def observe_step(self, out: SchedulerOutput, tokens: int, execute_s: float, step_s: float, draft_s: float = 0.0,
                     draft_forwards: int = 0, draft_first_s: float | None = None) -> None:
        """A step ended: its model pass took execute_s, of which a draft model's proposals for the next step draft_s
        in draft_forwards forwards (draft_first_s until its first proposal), and the whole step step_s to deliver
        `tokens` tokens. The target's part teaches
        the policy's step-time model (over the tokens computed); a pure-decode step (every chunk a decode or a
        verification) that made a speculation choice teaches the switch its throughput, counting the draft work
        done for it in the previous step rather than this step's, which serves the next.

        The switch is taught the tokens the step's verifications were expected to yield under the acceptance the
        policy has learnt over every verification and shadow guess, rather than the `tokens` they happened to yield:
        one verification yields 0 to k drafts, and the switch sees few steps of the mode it is not in, so realised
        tokens would make its choice a coin toss where the measured step time is steady."""
        self.policy.observe_step(out.num_batched_tokens, execute_s - draft_s)
        overhead = max(0.0, step_s - execute_s)
        self._overhead_s = overhead if self._overhead_s is None else 0.9 * self._overhead_s + 0.1 * overhead
        served_s = step_s - draft_s + self._draft_s
        self._draft_s = draft_s
        if self.choice is None or self.choice[1]:
            # After a step without speculation the draft's run is a transition (its catch-up spans every token it
            # skipped): a cost of switching, priced by the switch, not what a proposal costs.
            self.observe_draft(draft_s, draft_forwards, draft_first_s)
        if self.choice is None:
            return
        # A draft model's first step on after steps off carries its catch-up: a cost of switching, not of the mode.
        steady = self.config.method in MODEL_FREE or self._last_choice == self.choice[1]
        if not steady and self.choice[1]:
            self.switch.observe_transition(self.choice[0], served_s)
        self._last_choice = self.choice[1]
        if steady and all(c.sample and len(c.token_ids) == 1 + len(c.draft) for c in out.chunks):
            # Without drafts each decode yields one token: no acceptance to look up.
            expected = sum(self._expected_tokens(c.request_id, len(c.draft)) for c in out.chunks) if self.choice[1] \
                else float(len(out.chunks))
            self.switch.observe(self.choice[0], self.choice[1], expected, served_s)

    def observe_draft(self, seconds: float, forwards: int, first_s: float | None = None) -> None:
        """A draft model ran `forwards` forwards in `seconds`, the first `first_s` of them until its first proposal
        (None: not told apart, each forward the same share): what proposals cost, for the choice of k."""
        if forwards <= 0:
            return
        first = seconds / forwards if first_s is None else min(first_s, seconds)
        self._first_s = first if self._first_s is None else 0.9 * self._first_s + 0.1 * first
        if forwards > 1:
            per = (seconds - first) / (forwards - 1)
            self._forward_s = per if self._forward_s is None else 0.9 * self._forward_s + 0.1 * per

    def _best_k(self, decodes: int) -> int:
        """The draft model's tokens per request for a step of `decodes` decodes: the j in 1..k that maximises the
        expected tokens per second, (decodes * (1 + α + ... + α^j)) / (step(decodes * (1 + j)) + first + (j - 1) *
        further), with the policy's step-time fit and acceptance and the draft's measured cost (its first proposal:
        the catch-up forward; each further one a forward). -1 (all k) until they are measured."""
        k = self.config.num_speculative_tokens
        if self._first_s is None or self._overhead_s is None or not self.policy.step_time.steps:
            return -1
        further = self._first_s if self._forward_s is None else self._forward_s  # unseen: as dear as the first
        a, b = self.policy.step_time.coefficients()
        alpha = self.policy.global_acceptance()
        best, best_rate = 1, 0.0
        for j in range(1, k + 1):
            tokens = decodes * sum(alpha ** i for i in range(j + 1))
            seconds = self._overhead_s + a + b * decodes * (1 + j) + self._first_s + (j - 1) * further
            if tokens / seconds > best_rate:
                best, best_rate = j, tokens / seconds
        return best

    def _expected_tokens(self, request_id: str, drafts: int) -> float:
        """1 + α + α² + ... + α^drafts: the tokens a verification of `drafts` drafts yields on average."""
        alpha = self.policy.acceptance(request_id, self.kinds.get(request_id, 0))
        return sum(alpha ** j for j in range(drafts + 1))

    def set_proposals(self, proposals: Mapping[str, list[int]]) -> None:
        """A draft model's proposals for the next step (replacing the previous ones)."""
        self.external = dict(proposals)

    def finish(self, req: Request) -> None:
        """A request ended: its state goes, but a suffix cache keeps the whole output (steps that did not speculate
        did not look it up) for its shared trie."""
        if self.suffix is not None:
            self.suffix.finish(req.request_id, req.token_ids, req.num_prompt_tokens)
        self.forget([req.request_id])

    def reset_shared_outputs(self) -> None:
        """Forget the outputs suffix decoding shares across requests, as a fresh server (nothing without suffix)."""
        if self.suffix is not None:
            self.suffix.reset_shared()

    def forget(self, request_ids: Sequence[str]) -> None:
        """Drop finished requests' state."""
        for rid in request_ids:
            if self.suffix is not None:
                self.suffix.drop(rid)  # a request forgotten without finish() leaves no trace (after it: nothing)
            self.indexes.pop(rid, None)
            self.external.pop(rid, None)
            self.shadow.pop(rid, None)
            self.kinds.pop(rid, None)
            self.policy.forget(rid)
