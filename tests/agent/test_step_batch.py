"""plan_batch: decodes and verifications as decode rows, prefills after them; a verification's logits and K/V are
those of its tokens decoded one step at a time."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from runner_helpers import BLOCK_SIZE, GREEDY, Sequences, make_runner, snapshot

from kvfleet_agent.core.scheduler_output import ScheduledChunk
from kvfleet_agent.layers import gemm_crossover
from kvfleet_agent.worker.step_batch import plan_batch


@pytest.fixture(autouse=True)
def same_kernels_for_every_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """1-row steps and a 12-row batch on the linears' same few-row path: a crossover measured by timing can land
    between them on a loaded machine, and the tiles and oneDNN agree to rounding, not to the 1e-5 held here."""
    monkeypatch.setenv(gemm_crossover.PIN_ENV, "32")


def chunk(rid: str, tokens: list[int], start: int, table: list[int], draft: int = 0, sample: bool = True) -> \
        ScheduledChunk:
    """A chunk whose last `draft` tokens are drafts (a verification when draft > 0)."""
    drafts = tokens[len(tokens) - draft:] if draft else []
    return ScheduledChunk(rid, tokens, start, table, sample, GREEDY, draft=drafts)


def test_verification_rows_are_decode_rows_in_the_order_the_sampler_reads() -> None:
    bs = 4
    verify = chunk("v", [7, 8, 9, 10], 6, [3, 5, 2], draft=3)  # positions 6..9: block 5 then block 2
    decode = chunk("d", [11], 9, [0, 1, 4])
    prefill = chunk("p", [1, 2, 3, 4, 5], 0, [6, 7])
    partial = chunk("q", [6, 6], 4, [8, 9], sample=False)  # a prompt chunk that does not reach its end
    batch, samplers = plan_batch([prefill, decode, partial, verify], bs)
    # Decode rows sorted by their chunk's start (the verification at 6 before the decode at 9), prefills after.
    assert batch.input_ids.tolist() == [7, 8, 9, 10, 11, 1, 2, 3, 4, 5, 6, 6]
    assert batch.positions.tolist() == [6, 7, 8, 9, 9, 0, 1, 2, 3, 4, 4, 5]
    assert batch.slot_mapping.tolist() == [5 * bs + 2, 5 * bs + 3, 2 * bs + 0, 2 * bs + 1, 4 * bs + 1,
                                           24, 25, 26, 27, 28, 36, 37]
    assert batch.decode_tables.tolist() == [[3, 5, 2]] * 4 + [[0, 1, 4]]
    assert [(s, n, ctx, t.tolist()) for s, n, ctx, t in batch.prefills] == [(5, 5, 0, [6, 7]), (10, 2, 4, [8, 9])]
    # Every row of the verification samples ([last, *draft]), then the decode, then the prefill's last row.
    assert batch.sample_rows.tolist() == [0, 1, 2, 3, 4, 9]
    assert [c.request_id for c in samplers] == ["v", "d", "p"]


def test_plain_decodes_keep_one_row_each() -> None:
    batch, samplers = plan_batch([chunk("a", [5], 3, [1]), chunk("b", [6], 1, [2])], 4)
    assert batch.input_ids.tolist() == [6, 5] and batch.positions.tolist() == [1, 3]
    assert batch.decode_tables.tolist() == [[2], [1]] and batch.sample_rows.tolist() == [0, 1]
    assert [c.request_id for c in samplers] == ["b", "a"]


def test_a_prompts_first_tokens_run_as_decode_rows_and_a_chunk_past_them_as_a_prefill() -> None:
    """rows_within: a chunk ending by that position runs as decode rows (its last row samples); one that ends past
    it, even a short one after a long context (each row would read that context itself), stays a prefill."""
    bs = 4
    head = chunk("head", [1, 2, 3, 4, 5, 6], 0, [0, 1])  # positions 0-5: within 8
    tail = chunk("tail", [7, 8], 9, [2, 3, 4])  # positions 9-10: past 8
    decode = chunk("d", [9], 3, [5])
    batch, samplers = plan_batch([head, tail, decode], bs, rows_within=8)
    assert batch.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 9, 7, 8]
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 5, 3, 9, 10]
    assert batch.decode_tables.tolist() == [[0, 1]] * 6 + [[5, 0]]
    assert [(s, n, ctx) for s, n, ctx, _ in batch.prefills] == [(7, 2, 9)]
    assert batch.sample_rows.tolist() == [5, 6, 8] and [c.request_id for c in samplers] == ["head", "d", "tail"]
    plain, _ = plan_batch([head, tail, decode], bs)
    assert [(s, n, ctx) for s, n, ctx, _ in plain.prefills] == [(1, 6, 0), (7, 2, 9)]


def test_a_verification_equals_its_tokens_decoded_one_by_one(ckpt: Path) -> None:
    """Logits at every position and the K/V written: one step of [last, *4 drafts] (beside another request's decode
    and a new prompt) against five single-token steps. Contexts cross block boundaries (block size 4)."""
    stepwise, verified = make_runner(ckpt), make_runner(ckpt)
    a, b = Sequences(stepwise, seed=3), Sequences(verified, seed=3)
    names = a.prefill([10, 5])
    assert b.prefill([10, 5]) == names
    seq, other = names
    new = [a.rng.randrange(4, a.vocab) for _ in range(5)]
    start = len(a.tokens[seq])
    expected = []
    for i, tok in enumerate(new):
        logits = stepwise.forward(plan_batch([chunk(seq, [tok], start + i, a.tables[seq])], BLOCK_SIZE)[0])
        assert logits is not None
        expected.append(logits[0])
    other_tok = a.rng.randrange(4, a.vocab)
    alone = stepwise.forward(plan_batch([chunk(other, [other_tok], 5, a.tables[other])], BLOCK_SIZE)[0])
    prompt_table = list(range(b.next_block, b.next_block + 4))
    prompt = [3, 9, 27, 81 % b.vocab, 5, 6]
    alone_prompt = stepwise.forward(plan_batch([chunk("new", prompt, 0, prompt_table)], BLOCK_SIZE)[0])
    batch, _ = plan_batch([chunk("new", prompt, 0, prompt_table), chunk(other, [other_tok], 5, b.tables[other]),
                           chunk(seq, new, start, b.tables[seq], draft=4)], BLOCK_SIZE)
    got = verified.forward(batch)
    assert got is not None and alone is not None and alone_prompt is not None
    # Sample rows in decode order (the other request starts earlier), then the prompt's last row.
    torch.testing.assert_close(got[0], alone[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1:6], torch.stack(expected), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[6], alone_prompt[0], rtol=1e-5, atol=1e-5)
    slots = np.asarray(b.tables[seq])[np.arange(start, start + 5) // BLOCK_SIZE] * BLOCK_SIZE + \
        np.arange(start, start + 5) % BLOCK_SIZE
    for mine, theirs in zip(snapshot(verified), snapshot(stepwise), strict=True):
        flat_mine, flat_theirs = mine.flatten(0, 1), theirs.flatten(0, 1)
        torch.testing.assert_close(flat_mine[slots], flat_theirs[slots], rtol=1e-5, atol=1e-5)
