"""A step's batch: the scheduler's chunks flattened into numpy arrays, the synthetic steps (warm-up, profile), and
the batch's model inputs on a device."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvfleet_agent.core.scheduler_output import ScheduledChunk, SchedulerOutput
from kvfleet_agent.layers.attention import AttentionMetadata, DecodeGroup, PrefillSpan
from kvfleet_agent.sampling_params import SamplingParams
from kvfleet_agent.spec_config import MAX_SPECULATIVE_TOKENS
from kvfleet_agent.worker.device import to_device

PromptSpan = tuple[str, int, list[int], int]  # (request, position of the first target, targets, top-k)
# A step's model inputs on the device: token ids, positions, sample rows, attention metadata.
StepInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]
DECODE_GROUP = 16  # decode rows per attention call for the gathering reference (its copy stays in cache)
# With cpu_attention's kernel, which reads the cache in place, one call takes every decode row: 4 calls of 16 rows
# cost 1.3-1.4x one of 64 (Xeon with AMX, 2 threads, 40-380-token contexts; each call converts q and its output and
# wakes the thread pool).
ONE_GROUP = 1 << 30
# Where the one-call decode stack runs (CPU), a prompt chunk that ends within a prompt's first PROMPT_ROWS positions
# runs as decode rows too, so that a step mixing a new prompt with other requests' decodes stays one C++ call
# instead of running every row through the layers' modules. Each row attends to the cache up to its own position
# (the layer writes the chunk's K/V first) and reads that context itself, where a prefill reads it once for a GEMM:
# on the tiny shared model a fresh prompt of 256 tokens ran 1.04-1.07x faster so, one of 512 0.98x; a 64-token tail
# after 512 cached tokens 0.92x, after 2,048 0.73x. Hence a bound on where the chunk ends, not on its length.
PROMPT_ROWS = 256


@dataclass(slots=True)
class StepBatch:
    """A step's chunks flattened into one token batch (decode rows first, sorted by length: a verification's
    tokens are decode rows too), as numpy arrays.

    Plain data on purpose: rank 0 builds it once from the scheduler's output and sends it to the
    other ranks, which only copy it to their device. Sampling parameters stay on rank 0.
    """

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T] where each token's K/V goes in the paged pool
    decode_tables: np.ndarray  # [num_decodes, width] block tables of the decode rows
    prefills: list[tuple[int, int, int, np.ndarray]]  # (query_start, query_len, context_start, block table)
    sample_rows: np.ndarray  # [S] rows whose hidden state yields a next token (a verification's: 1 + its drafts)
    # Rows whose logits give prompt logprobs (after the sample rows' in the logits), rarely any: every rank
    # computes the same logits (the LM head gathers across ranks); rank 0 reads them by prompt_spans.
    prompt_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    prompt_spans: list[PromptSpan] = field(default_factory=list)


def plan_batch(chunks: list[ScheduledChunk], block_size: int, rows_up_to: int = 0,
               rows_within: int = 0) -> tuple[StepBatch, list[ScheduledChunk]]:
    """The step's batch, and the chunks that sample (in the order of the batch's sample rows).

    A verification ([last, *draft]) runs as one decode row per token, each attending to its own prefix of the
    same block table: a layer writes every row's K/V before any row attends, so row i sees the drafts before it.
    That makes verifying k drafts cost about a decode batch of k + 1 rows (one pass over the weights, decode
    attention reading the cache in place) instead of a prefill with its own attention call. A chunk of at most
    `rows_up_to` tokens runs so too, sampling its last row only (a draft model's catch-up: the few tokens the target
    accepted since it last ran), and so does a chunk ending by position `rows_within` (on CPU with the one-call
    stack, a prompt's first PROMPT_ROWS tokens: a step mixing them with decodes then stays one call). Other chunks,
    and every chunk by default, run as prefills.
    """
    bs = block_size

    def as_rows(c: ScheduledChunk) -> bool:
        n = len(c.token_ids)
        return n == 1 + len(c.draft) or n <= rows_up_to or c.start_pos + n <= rows_within

    decodes = sorted((c for c in chunks if as_rows(c)), key=lambda c: c.start_pos)
    prefills = [c for c in chunks if not as_rows(c)]
    counts = np.fromiter((len(c.token_ids) for c in decodes), dtype=np.int64, count=len(decodes))
    nd = int(counts.sum())
    starts = np.fromiter((c.start_pos for c in decodes), dtype=np.int64, count=len(decodes))
    width = max((len(c.block_table) for c in decodes), default=1)
    tables = np.zeros((len(decodes), width), dtype=np.int64)
    for i, c in enumerate(decodes):
        tables[i, :len(c.block_table)] = c.block_table
    ids: list[int] = []
    if nd == len(decodes):  # plain decodes only: one row each, no repeats
        d_pos = starts
        ids = [c.token_ids[0] for c in decodes]
    else:
        first = np.cumsum(counts) - counts  # each chunk's first row
        d_pos = np.repeat(starts - first, counts) + np.arange(nd, dtype=np.int64)
        tables = np.repeat(tables, counts, axis=0)
        for c in decodes:
            ids += c.token_ids
    d_slots = tables[np.arange(nd), d_pos // bs] * bs + d_pos % bs
    pos_parts, slot_parts = [d_pos], [d_slots]
    spans: list[tuple[int, int, int, np.ndarray]] = []
    sample_rows: list[int] = []
    row = 0
    for c in decodes:
        if c.sample:  # a verification's every row; another chunk's last
            sample_rows += range(row + len(c.token_ids) - 1 - len(c.draft), row + len(c.token_ids))
        row += len(c.token_ids)
    start = nd
    for c in prefills:
        n = len(c.token_ids)
        table = np.asarray(c.block_table, dtype=np.int64)
        pos = np.arange(c.start_pos, c.start_pos + n, dtype=np.int64)
        ids += c.token_ids
        pos_parts.append(pos)
        slot_parts.append(table[pos // bs] * bs + pos % bs)
        spans.append((start, n, c.start_pos, table))
        if c.sample:
            sample_rows.append(start + n - 1)
        start += n
    batch = StepBatch(np.asarray(ids, dtype=np.int64), np.concatenate(pos_parts), np.concatenate(slot_parts),
                      tables, spans, np.asarray(sample_rows, dtype=np.int64))
    if any(c.prompt_ids is not None for c in chunks):
        _plan_prompt_rows(batch, decodes + prefills)
    return batch, [c for c in decodes if c.sample] + [c for c in prefills if c.sample]


def _plan_prompt_rows(batch: StepBatch, chunks: list[ScheduledChunk]) -> None:
    """The rows of chunks asking for prompt logprobs, and each one's targets (the next prompt tokens)."""
    rows: list[int] = []
    row = 0
    for c in chunks:  # in batch order: decodes, then prefills
        if c.prompt_ids is not None:
            count = min(len(c.token_ids), len(c.prompt_ids) - 1 - c.start_pos)
            rows += range(row, row + count)
            batch.prompt_spans.append((c.request_id, c.start_pos + 1,
                                       c.prompt_ids[c.start_pos + 1:c.start_pos + 1 + count],
                                       c.sampling_params.prompt_logprobs or 0))
        row += len(c.token_ids)
    batch.prompt_rows = np.asarray(rows, dtype=np.int64)


def warmup_steps(block_size: int) -> list[SchedulerOutput]:
    """One throwaway prefill and decode, so the first real request does not pay for lazy init.

    They write K/V into block 0, which is harmless: no block is read before its owner writes it. Half a block of
    prompt and room in max_tokens: a draft model then proposes inside block 0 after each, warming its decode path.
    """
    params = SamplingParams(max_tokens=MAX_SPECULATIVE_TOKENS + 2, temperature=0.0)
    n = max(1, min(block_size // 2, 8))
    prefill = ScheduledChunk("warmup", [0] * n, 0, [0], True, params)
    decode = ScheduledChunk("warmup-decode", [0], n - 1, [0], True, params)
    return [SchedulerOutput([prefill], n), SchedulerOutput([decode], 1, finished=["warmup", "warmup-decode"])]


def profile_batch(num_tokens: int, max_num_seqs: int, max_model_len: int) -> StepBatch:
    """The largest step the scheduler can send, as dummy prompts: num_tokens tokens over up to
    max_num_seqs sequences (none longer than max_model_len), each sampling once. Every slot is -1, so
    running it writes nothing into the KV pool; from position 0, its attention reads no cache either."""
    seqs = min(max_num_seqs, num_tokens)
    lens = np.full(seqs, num_tokens // seqs, dtype=np.int64)
    lens[:num_tokens % seqs] += 1
    lens = np.minimum(lens, max_model_len)
    starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
    total = int(lens.sum())
    spans = [(int(s), int(n), 0, np.zeros(1, dtype=np.int64)) for s, n in zip(starts, lens, strict=True)]
    return StepBatch(np.zeros(total, dtype=np.int64), np.concatenate([np.arange(n) for n in lens]),
                     np.full(total, -1, dtype=np.int64), np.zeros((0, 1), dtype=np.int64), spans,
                     (starts + lens - 1).astype(np.int64))


def step_inputs(batch: StepBatch, device: torch.device, block_size: int,
                decode_group: int = DECODE_GROUP) -> StepInputs:
    """The batch on the device, for an eager forward: token ids, positions, sample rows and attention metadata.

    The metadata depends on the pool's layout alone (block size, tables, slots), not on the model, so a draft model
    whose pool has the target's blocks runs on the same inputs.
    """
    nd = batch.decode_tables.shape[0]
    arrays = [batch.input_ids, batch.positions, batch.slot_mapping, batch.sample_rows, batch.decode_tables,
              batch.positions[:nd] + 1, *(table for *_, table in batch.prefills)]
    ids, positions, slots, rows, tables, seq_lens, *prefill_tables = to_device(arrays, device)
    meta = AttentionMetadata(
        slot_mapping=slots,
        decode_groups=_decode_groups(tables, seq_lens, batch.positions[:nd], block_size, decode_group),
        prefills=[PrefillSpan(s, n, ctx, t) for (s, n, ctx, _), t in zip(batch.prefills, prefill_tables,
                                                                         strict=True)],
    )
    return ids, positions, rows, meta


def _decode_groups(tables: torch.Tensor, seq_lens: torch.Tensor, positions: np.ndarray,
                   block_size: int, group: int) -> list[DecodeGroup]:
    """Split the (length-sorted) decode rows into groups of `group` rows.

    Each group's longest context comes from the host copy of the positions: no device read.
    """
    groups = []
    for start in range(0, len(positions), group):
        end = min(start + group, len(positions))
        # Rows are sorted by their chunk's start: a verification's later rows may outrun the next chunk's.
        groups.append(DecodeGroup(start, end, tables[start:end], seq_lens[start:end],
                                  int(positions[start:end].max()) + 1, block_size))
    return groups
