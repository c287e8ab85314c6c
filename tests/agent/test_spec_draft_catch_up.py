"""A draft model that runs only when the next step speculates: DraftSlots' rules on their own, and through the engine
the draft catching its K/V up after steps it skipped (and over prefix-cache hits on blocks it never computed), in
parts where the catch-up exceeds a step's token budget, so that the target as its own draft is still always right;
and the number of tokens it proposes, from acceptance and costs."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import numpy as np
import pytest
from spec_helpers import drafted, run, same

from kvfleet_agent.core.scheduler_output import ScheduledChunk, SchedulerOutput
from kvfleet_agent.core.spec_policy import SpecPolicy
from kvfleet_agent.core.spec_switch import SpecSwitch
from kvfleet_agent.core.speculator import Speculator
from kvfleet_agent.sampling_params import SamplingParams
from kvfleet_agent.spec_config import SpeculativeConfig
from kvfleet_agent.worker.draft_slots import MAX_PENDING, DraftSlots

GREEDY = SamplingParams(temperature=0.0, max_tokens=50)
TABLE = [5, 2, 7]  # block size 4: positions 0-3 in block 5, 4-7 in block 2, 8-11 in block 7


def chunk(tokens: list[int], start: int, draft: int = 0) -> ScheduledChunk:
    return ScheduledChunk("r", tokens, start, TABLE, True, GREEDY, draft=tokens[len(tokens) - draft:] if draft else [])


def wrote(slots: DraftSlots, c: ScheduledChunk, emitted: list[int]) -> None:
    """The target ran chunk c alone and emitted these tokens."""
    where = slots.slots(c.block_table, c.start_pos, c.start_pos + len(c.token_ids))
    slots.target_wrote(np.asarray(c.token_ids), where, [c], {"r": emitted})


def test_a_prompt_is_stale_until_the_draft_computes_it() -> None:
    s = DraftSlots(8, 4)
    wrote(s, chunk([1, 2, 3, 4, 5, 6], 0), [9])
    assert s.first_stale("r", TABLE, 6) == 0 and s.tokens(TABLE, 0, 6) == [1, 2, 3, 4, 5, 6]
    s.computed("r", TABLE, 0, 7)  # the catch-up, with the newest token 9 at position 6
    assert s.first_stale("r", TABLE, 6) == 6


def test_steps_the_draft_skips_queue_their_writes_in_order_and_in_bounded_memory() -> None:
    """While the draft is off a step only queues what the target wrote; read back, a slot written twice (a block
    reused) holds the later token, and a long stretch off never queues more than MAX_PENDING steps."""
    s = DraftSlots(128, 4)
    wrote(s, chunk([1, 2, 3, 4, 5, 6], 0), [7])
    wrote(s, chunk([11, 12], 0), [13])  # the same slots, rewritten before anything read them
    assert s.pending and s.tokens(TABLE, 0, 6) == [11, 12, 3, 4, 5, 6] and not s.pending
    table = list(range(100))
    for pos in range(MAX_PENDING + 10):
        c = ScheduledChunk("r", [1000 + pos], pos, table, True, GREEDY)
        s.target_wrote(np.asarray(c.token_ids), s.slots(table, pos, pos + 1), [c], {"r": [1001 + pos]})
        assert len(s.pending) < MAX_PENDING
    assert s.tokens(table, 0, MAX_PENDING + 10) == [1000 + p for p in range(MAX_PENDING + 10)]
    assert s.first_stale("r", table, MAX_PENDING + 10) == 0


def test_accepted_guesses_stay_valid_and_rejected_ones_do_not() -> None:
    s = DraftSlots(8, 4)
    wrote(s, chunk([1, 2, 3, 4, 5, 6], 0), [9])
    s.computed("r", TABLE, 0, 7)
    s.proposed("r", 6, [9, 10, 11, 12])  # the draft wrote 9 at 6 and its guesses 10, 11, 12 at 7, 8, 9
    # Verified [9, 10, 11, 12, 13]: accepts 10 and 11, rejects 12 (emits 20 at position 9).
    wrote(s, chunk([9, 10, 11, 12, 13], 6, draft=4), [10, 11, 20])
    assert s.first_stale("r", TABLE, 9) == 9  # positions 6..8 hold the draft's K/V of the kept tokens
    assert not s.ok[s.slots(TABLE, 9, 11)].any()  # the rejected guess's slot (and the one after) are stale


def test_a_skipped_step_leaves_its_token_stale_and_a_plain_decode_of_a_computed_token_does_not() -> None:
    s = DraftSlots(8, 4)
    wrote(s, chunk([1, 2, 3], 0), [4])
    s.computed("r", TABLE, 0, 4)
    s.proposed("r", 3, [4, 8])
    wrote(s, chunk([4], 3), [5])  # no drafts sent, but the draft had computed 4 at position 3
    wrote(s, chunk([5], 4), [6])  # the draft did not run after the last step: 5 at position 4 is new to it
    assert s.first_stale("r", TABLE, 5) == 4


def test_a_new_prompt_in_reused_blocks_is_stale_and_rescanned_from_its_start() -> None:
    s = DraftSlots(8, 4)
    wrote(s, chunk([1, 2, 3, 4, 5], 0), [6])
    s.computed("r", TABLE, 0, 6)
    assert s.first_stale("r", TABLE, 5) == 5
    wrote(s, chunk([1, 2, 9, 4, 5], 0), [6])  # a recomputation (or another sequence) over the same slots
    assert s.first_stale("r", TABLE, 5) == 0


def every_other_pair() -> Callable[[SpecSwitch, int, bool], bool]:
    """A switch that speculates two steps in five: the draft skips three steps of every five."""
    pattern = itertools.cycle([False, False, True, False, True])
    return lambda self, batch, measured=True: next(pattern)


@pytest.mark.parametrize("budget", [64, 16])
def test_the_draft_catches_up_after_skipped_steps_and_over_prefix_hits(tiny_checkpoint: Callable[..., str],
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        budget: int) -> None:
    target = tiny_checkpoint("llama")
    rng = random.Random(1)
    shared = [rng.randrange(4, 512) for _ in range(36)]  # blocks the first request computes, the others hit
    prompts = [{"prompt_token_ids": shared + [rng.randrange(4, 512) for _ in range(rng.randint(1, 20))]}
               for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    options = {"max_num_batched_tokens": budget, "max_num_seqs": 4}
    plain, _ = run(target, prompts, params, None, **options)
    monkeypatch.setattr(SpecSwitch, "choose", every_other_pair())
    monkeypatch.setattr(Speculator, "_best_k", lambda self, decodes: -1)  # all k drafts whenever the draft runs
    # ...and every draft is sent: the policy's cost model reads this machine's step times, and where a step's time
    # grows with its tokens it sends none beside prefill chunks (a CI machine sent 9 drafts in the whole run).
    monkeypatch.setattr(SpecPolicy, "plan", lambda self, candidates, other, **_: dict(candidates))
    spec = {"method": "draft_model", "model": target, "num_speculative_tokens": 3, "adaptive": True}
    outs, llm = run(target, prompts, params, spec, **options)
    same(plain, outs)
    proposed, accepted = drafted(llm)
    # Right every time (up to float rounding) only if what the draft caught up on is the target's own sequence.
    assert proposed > 40 and accepted >= 0.95 * proposed, (proposed, accepted)
    assert llm.engine.kv.prefix_hits > 0


def test_the_draft_proposes_more_the_cheaper_its_forward_and_the_likelier_acceptance() -> None:
    config = {"method": "draft_model", "model": "unused", "num_speculative_tokens": 5}
    spec = Speculator(SpeculativeConfig.parse(config))
    assert spec._best_k(1) == -1  # nothing measured yet: all of k
    for _ in range(32):  # a target step of 10 ms whatever its tokens (batch 1: memory-bound)
        spec.policy.observe_step(6, 0.010)
    spec._overhead_s = 0.0
    spec.policy.observe("r", 5, 5)  # every draft accepted, many times over: α near 1
    for _ in range(40):
        spec.policy.observe("r", 5, 5)
    spec.observe_draft(0.001 * 3, 3)  # a draft forward a tenth of the target's
    assert spec._best_k(1) == 5
    for _ in range(200):
        spec.policy.observe("r", 5, 0)  # now nothing is accepted
    spec.observe_draft(0.009 * 3, 3)
    for _ in range(60):
        spec.observe_draft(0.009 * 3, 3)  # and a draft forward costs nearly a target step
    assert spec._best_k(1) == 1


def test_a_dear_catch_up_and_cheap_further_proposals_favour_more_of_them() -> None:
    """Where the proposal loop runs in one call, the first proposal (the catch-up forward and the step's
    bookkeeping) costs far more than each further one: priced apart, k is chosen for what the next one costs."""
    config = {"method": "draft_model", "model": "unused", "num_speculative_tokens": 5}
    apart, averaged = (Speculator(SpeculativeConfig.parse(config)) for _ in range(2))
    for spec in (apart, averaged):
        for _ in range(32):
            spec.policy.observe_step(6, 0.010)  # a 10 ms target step
        spec._overhead_s = 0.0
        for _ in range(40):
            spec.policy.observe("r", 5, 3)  # α = 3/4
    apart.observe_draft(0.011, 5, first_s=0.009)  # 9 ms to the first proposal, 0.5 ms each after
    averaged.observe_draft(0.011, 5)  # the same 11 ms spread evenly: 2.2 ms a forward
    # Tokens per second under α = 3/4: 5 drafts give 3.29 tokens in 21 ms apart (the best j), and j = 3 gives
    # 2.73 in 16.6 ms when every forward is priced at 2.2 ms.
    assert (apart._best_k(1), averaged._best_k(1)) == (5, 3)


def test_a_transitions_catch_up_does_not_price_the_proposals() -> None:
    """The draft's run after a step without speculation catches up on every token it skipped: that is the switch's
    transition cost, and k is chosen from the steady runs' costs alone."""
    spec = Speculator(SpeculativeConfig.parse({"method": "draft_model", "model": "unused",
                                               "num_speculative_tokens": 4}))
    out = SchedulerOutput([], 1)
    spec.choice = (1, False)  # this step did not speculate; the draft ran after it, for the next
    spec.observe_step(out, 1, 0.020, 0.021, draft_s=0.015, draft_forwards=4, draft_first_s=0.012)
    assert spec._first_s is None and spec._forward_s is None
    spec.choice = (1, True)
    spec.observe_step(out, 3, 0.006, 0.0061, draft_s=0.002, draft_forwards=4, draft_first_s=0.0011)
    assert spec._first_s == pytest.approx(0.0011) and spec._forward_s == pytest.approx(0.0003)
