"""Draft model for speculative decoding: a small model on rank 0 that proposes each decode's next k tokens."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvfleet_agent.core.scheduler_output import ScheduledChunk
from kvfleet_agent.core.speculator import speculates
from kvfleet_agent.layers.attention import PagedAttention
from kvfleet_agent.layers.linear import weight_bytes
from kvfleet_agent.layers.tp_group import TPGroup
from kvfleet_agent.models.config import ModelConfig
from kvfleet_agent.models.fused_decode import FusedDecode
from kvfleet_agent.models.llama import LlamaForCausalLM
from kvfleet_agent.models.loader import load_weights
from kvfleet_agent.sampling_params import SamplingParams
from kvfleet_agent.spec_config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from kvfleet_agent.worker.draft_slots import DraftSlots
from kvfleet_agent.worker.sampler import Sampler, sampling_probs
from kvfleet_agent.worker.step_batch import StepBatch, StepInputs, plan_batch
from kvfleet_kernels.dispatch import argmax

log = logging.getLogger(__name__)
CATCH_UP_ROWS = MAX_SPECULATIVE_TOKENS + 1  # the most positions one verification can leave stale (k drafts, bonus)


def draft_config(model_dir: str, target: ModelConfig, target_dir: str, max_model_len: int) -> ModelConfig:
    """The draft checkpoint's config, after checking that it can serve this target."""
    cfg = ModelConfig.from_dir(model_dir)
    where = f"speculative_config.model={model_dir!r}"
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"{where} has vocab_size {cfg.vocab_size} but the target {target_dir!r} has "
                         f"{target.vocab_size}: a draft model must share the target's tokenizer and vocabulary; use a "
                         "smaller model of the same family, or method 'ngram' or 'suffix'")
    limit = min(cfg.max_position_embeddings, cfg.sliding_window or cfg.max_position_embeddings)
    if limit < max_model_len:
        raise ValueError(f"{where} holds {limit} positions (config.json max_position_embeddings / sliding_window), "
                         f"fewer than max_model_len={max_model_len}: lower max_model_len or use a draft with a longer "
                         "context")
    return cfg


@dataclass(eq=False)
class _Row:
    """One request proposing this step: where its newest token sits and what it has drafted so far."""

    request_id: str
    params: SamplingParams
    generator: torch.Generator
    pos: int  # position of the request's newest token (not computed by either model yet)
    count: int  # proposals to make
    table: list[int]
    tokens: list[int] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)  # the draft distribution of each proposal (random only)


def _block_tables(rows: Sequence[_Row]) -> np.ndarray:
    """The rows' block tables as one int64 [rows, longest] array, zero-padded."""
    tables = np.zeros((len(rows), max(len(r.table) for r in rows)), dtype=np.int64)
    for i, r in enumerate(rows):
        tables[i, :len(r.table)] = r.table
    return tables


class DraftModel:
    """The draft: the target's model class on a smaller checkpoint, unsharded, with its own paged K/V.

    Its K/V pool mirrors the target's block for block (same number of blocks, same block size) and is addressed by
    the target's block tables. It runs only after steps whose next step speculates (k > 0): then, for each
    eligible request that sampled, it catches its K/V up from the first stale position (DraftSlots: what it skipped
    while off, a new prompt, a prefix-cache hit on blocks it never computed) to the request's newest token, in one
    forward with every other such request, which yields the first proposal; k - 1 batched decode forwards give the
    rest, at the positions the scheduler's lookahead blocks cover. Rank 0 alone holds it: it runs no collectives.
    """

    def __init__(self, spec: SpeculativeConfig, target: ModelConfig, target_dir: str, max_model_len: int,
                 block_size: int, device: torch.device, dtype: torch.dtype,
                 step_inputs: Callable[[StepBatch], StepInputs], max_batched_tokens: int) -> None:
        assert spec.model is not None  # SpeculativeConfig.parse requires it for draft_model
        self.cfg = draft_config(spec.model, target, target_dir, max_model_len)
        self.k = spec.num_speculative_tokens
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device, self.dtype = device, dtype
        self.step_inputs = step_inputs
        self.max_batched_tokens = max_batched_tokens  # a step's catch-up stays within what the profile pass ran
        self.slots = DraftSlots(0, block_size)
        self.forwards = 0  # forwards the last step ran (the catch-up's, then one per further proposal)
        self.first_s = 0.0  # the last step's seconds until its first proposals (the catch-up forward included)
        with torch.device(device):
            self.model = LlamaForCausalLM(self.cfg, max_model_len, dtype, TPGroup()).to(dtype)
        self.loaded_bytes = load_weights(self.model, spec.model)
        self.model.eval()
        for module in self.model.modules():  # CPU: oneDNN-prepacked GEMM weights, as the target's
            pack_weights = getattr(module, "pack_weights", None)
            if callable(pack_weights):
                pack_weights()
        FusedDecode.attach(self.model)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        # Proposals of random requests and the distributions they were drawn from, for the next step's verification;
        # replaced every step, as the speculator's proposals are.
        self.proposed: dict[str, tuple[list[int], torch.Tensor]] = {}
        self.num_output: dict[str, int] = {}  # output tokens per request so far: max_tokens bounds its proposals
        params = sum(p.numel() for p in self.model.parameters())
        log.info("draft model %s: %s, %.2fM parameters (%.1f MiB in %s), %d layers", spec.model, self.cfg.architecture,
                 params / 1e6, self.param_bytes() / 2**20, dtype, self.cfg.num_layers)

    def param_bytes(self) -> int:
        """Bytes of the draft's weights as held (a prepacked linear's packed copy, not a meta parameter)."""
        return weight_bytes(self.model)

    def bytes_per_block(self) -> int:
        """The draft's KV bytes for one block of the shared pool (keys and values, every layer)."""
        a = self.attn_layers[0]
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * len(self.attn_layers) * self.block_size * a.num_kv_heads * a.head_dim * elem

    def allocate(self, num_blocks: int, stand_in: bool = False) -> None:
        """Zero-filled K and V tensors of num_blocks blocks for every layer (one-block stand-ins for a profile pass)."""
        for layer in self.attn_layers:  # the draft's K/V keeps its dtype: small, and its guesses stay its own
            layer.allocate(num_blocks, self.block_size, self.dtype, self.device)
        self.slots = DraftSlots(num_blocks, self.block_size)
        if not stand_in:
            log.info("draft model KV: %d blocks x %d B = %.1f MiB beside the target's", num_blocks,
                     self.bytes_per_block(), num_blocks * self.bytes_per_block() / 2**20)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop finished requests' state."""
        for rid in request_ids:
            self.proposed.pop(rid, None)
            self.num_output.pop(rid, None)
            self.slots.forget(rid)

    def draft_probs(self, chunk: ScheduledChunk) -> torch.Tensor | None:
        """The draft distributions [len(draft), V] behind a verification chunk's drafts (None for greedy requests,
        whose verification reads none). The drafts are a prefix of the last proposal: the scheduler may send fewer."""
        if chunk.sampling_params.greedy:
            return None
        tokens, q = self.proposed.get(chunk.request_id, ([], None))
        n = len(chunk.draft)
        if q is None or tokens[:n] != chunk.draft:
            # Verifying sampled drafts as if deterministic would bias the output: never guess.
            raise RuntimeError(f"draft model: no draft distribution for request {chunk.request_id!r}'s drafts "
                               f"{chunk.draft} (last proposal {tokens})")
        return q[:n]

    @torch.inference_mode()
    def profile(self, batch: StepBatch) -> None:
        """The profiling pass's draft part: a forward over the largest batch, and its sample rows' distributions."""
        ids, positions, rows, meta = self.step_inputs(batch)
        hidden = self.model(ids, positions, meta)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        del hidden
        sampling_probs(logits.float(), [SamplingParams(temperature=1.0, top_k=50, top_p=0.9)] * logits.shape[0])

    @torch.inference_mode()
    def step(self, batch: StepBatch, samplers: Sequence[ScheduledChunk], emitted: Mapping[str, Sequence[int]],
             sampler: Sampler, k: int = -1) -> dict[str, list[int]]:
        """Note what the target wrote and kept; when the next step speculates (k != 0), catch up and propose up to k
        tokens (-1: the configured k) for the eligible requests that sampled."""
        started = time.perf_counter()
        self.slots.target_wrote(batch.input_ids, batch.slot_mapping, samplers, emitted)
        self.proposed = {}
        self.forwards = 0
        self.first_s = 0.0
        k = self.k if k < 0 else min(k, self.k)
        counts = self.num_output  # output tokens so far, counted whether or not it runs: max_tokens bounds proposals
        for rid, new in emitted.items():
            counts[rid] = counts.get(rid, 0) + len(new)
        if k == 0:  # off for the next step
            return {}
        rows: list[_Row] = []
        for c in samplers:
            out = emitted.get(c.request_id)
            if not out:
                continue
            count = counts[c.request_id]
            pos = c.start_pos + len(c.token_ids) - len(c.draft) + len(out) - 1
            # The speculator's room (max_tokens, max_model_len) and the blocks the scheduler's lookahead got.
            n = min(k, c.sampling_params.max_tokens - count - 1, self.max_model_len - pos - 2,
                    len(c.block_table) * self.block_size - pos)
            if n > 0 and speculates(c.sampling_params):
                rows.append(_Row(c.request_id, c.sampling_params, sampler.generator(c.request_id, c.sampling_params),
                                 pos, n, c.block_table, [out[-1]]))
        if not rows:
            return {}
        chunks, rows = self._catch_up(rows)
        if len(rows) == len(chunks) and self._in_one_call(chunks, rows, started):
            return {r.request_id: r.tokens[1:] for r in rows}
        # What a verification leaves stale is a few tokens: they run as decode rows (one call of decode attention
        # in place, the one-call stack on CPU) rather than a prefill; a new prompt's catch-up stays a prefill.
        plan, order = plan_batch(chunks, self.block_size, CATCH_UP_ROWS)
        ids, positions, sample_rows, meta = self.step_inputs(plan)
        hidden = self.model(ids, positions, meta)
        self.forwards = 1
        for c in chunks:
            self.slots.computed(c.request_id, c.block_table, c.start_pos, c.start_pos + len(c.token_ids))
        if not rows:
            return {}
        by_id = {r.request_id: r for r in rows}
        rows = [by_id[c.request_id] for c in order]  # in the order of the sample rows
        first = self._pick(self.model.compute_logits(hidden.index_select(0, sample_rows)), rows)
        self.first_s = time.perf_counter() - started
        self._propose(rows, first)
        for r in rows:
            self.slots.proposed(r.request_id, r.pos, r.tokens[:-1])
            if r.q:
                self.proposed[r.request_id] = (r.tokens[1:], torch.stack(r.q))
        return {r.request_id: r.tokens[1:] for r in rows}

    def _in_one_call(self, chunks: list[ScheduledChunk], rows: list[_Row], started: float) -> bool:
        """The whole run in one C++ call where it can go (FusedDecode.propose_greedy: greedy rows on CPU, every
        catch-up a few decode rows): the first forward over each row's catch-up, then the proposals after it. The
        rows keep plan_batch's order (by where the catch-up starts), so every row's bits are the Python path's."""
        fused = self.model.fused_decode
        if not isinstance(fused, FusedDecode) or not all(r.params.greedy for r in rows) or \
                any(len(c.token_ids) > CATCH_UP_ROWS for c in chunks):
            return False
        pairs = sorted(zip(chunks, rows, strict=True), key=lambda p: p[0].start_pos)
        tables = _block_tables([r for _, r in pairs])
        ids = torch.tensor([t for c, _ in pairs for t in c.token_ids], dtype=torch.long, device=self.device)
        before = time.perf_counter()
        run = fused.propose_greedy(ids, [c.start_pos for c, _ in pairs], [len(c.token_ids) for c, _ in pairs],
                                   [r.count for _, r in pairs], torch.from_numpy(tables).to(self.device),
                                   self.block_size)
        if run is None:
            return False
        out, first_s = run
        self.forwards = max(r.count for r in rows)
        self.first_s = before - started + first_s
        for (c, r), proposed in zip(pairs, out.tolist(), strict=True):
            self.slots.computed(c.request_id, c.block_table, c.start_pos, c.start_pos + len(c.token_ids))
            r.tokens += proposed[:r.count]
            self.slots.proposed(r.request_id, r.pos, r.tokens[:-1])
        return True

    def _catch_up(self, rows: list[_Row]) -> tuple[list[ScheduledChunk], list[_Row]]:
        """Each row's chunk for the draft's first forward: its stale positions (the tokens the target wrote there),
        then its newest token, sampling. Within max_batched_tokens: a row that does not fit catches up part of the
        way and proposes another time; one that fits nothing waits."""
        chunks: list[ScheduledChunk] = []
        ready: list[_Row] = []
        left = self.max_batched_tokens
        for r in sorted(rows, key=lambda r: r.pos):
            first = self.slots.first_stale(r.request_id, r.table, r.pos)
            need = r.pos - first + 1
            if need <= left:
                tokens = self.slots.tokens(r.table, first, r.pos) + r.tokens[:1]
                chunks.append(ScheduledChunk(r.request_id, tokens, first, r.table, True, r.params))
                ready.append(r)
                left -= need
            elif left > 0:
                chunks.append(ScheduledChunk(r.request_id, self.slots.tokens(r.table, first, first + left), first,
                                             r.table, False, r.params))
                left = 0
        return chunks, ready

    def _propose(self, rows: list[_Row], first: torch.Tensor) -> None:
        """The proposals after the first: step j runs each row's proposal j at pos + j, batched as decodes.

        Greedy rows on CPU run the whole loop in one call (FusedDecode.propose_greedy); elsewhere the tokens stay on
        the device from step to step, and one host transfer at the end reads them all.
        """
        tables = _block_tables(rows)
        fused = self.model.fused_decode
        if isinstance(fused, FusedDecode) and all(r.params.greedy for r in rows):
            more = [i for i, r in enumerate(rows) if r.count > 1]
            run = fused.propose_greedy(first[more], [rows[i].pos + 1 for i in more], [1] * len(more),
                                       [rows[i].count - 1 for i in more], torch.from_numpy(tables[more]).to(
                                           self.device), self.block_size) if more else None
            if run is not None or not more:  # the whole loop ran in one call
                self.forwards += max(r.count for r in rows) - 1
                rest = dict(zip(more, run[0].tolist(), strict=True)) if run is not None else {}
                for i, (r, t) in enumerate(zip(rows, first.tolist(), strict=True)):
                    r.tokens += [t, *rest.get(i, [])[:r.count - 1]]
                return
        base = np.asarray([r.pos for r in rows], dtype=np.int64)
        counts = np.asarray([r.count for r in rows])
        tokens, active = first, np.arange(len(rows))
        picked: list[tuple[np.ndarray, torch.Tensor]] = [(active, tokens)]
        for j in range(1, int(counts.max())):
            keep = counts[active] > j
            if not keep.all():
                tokens = tokens[torch.from_numpy(np.flatnonzero(keep)).to(self.device)]
                active = active[keep]
            pos = base[active] + j
            rt = tables[active]
            slots = rt[np.arange(len(active)), pos // self.block_size] * self.block_size + pos % self.block_size
            step = StepBatch(np.zeros(len(active), dtype=np.int64), pos, slots, rt, [],
                             np.arange(len(active), dtype=np.int64))
            _, positions, _, meta = self.step_inputs(step)
            logits = self.model.compute_logits(self.model(tokens, positions, meta))
            self.forwards += 1
            tokens = self._pick(logits, [rows[i] for i in active])
            picked.append((active, tokens))
        flat: list[int] = torch.cat([t for _, t in picked]).tolist()
        start = 0
        for idx, _ in picked:
            for i, t in zip(idx.tolist(), flat[start:start + len(idx)], strict=True):
                rows[i].tokens.append(t)
            start += len(idx)

    def _pick(self, logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        """Each row's proposal: the argmax for greedy requests; for random ones a draw from the draft's distribution
        under the request's own sampling params (what verification compares with the target's), by its generator."""
        tokens = argmax(logits)
        rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        if rand:
            idx = torch.tensor(rand, device=logits.device)
            q = sampling_probs(logits[idx].float(), [rows[i].params for i in rand])
            # The Sampler's exponential race, one noise row per request from its own generator.
            noise = torch.empty_like(q)
            for b, i in enumerate(rand):
                noise[b].exponential_(generator=rows[i].generator)
            tokens[idx] = (q / noise).argmax(dim=-1)
            for b, i in enumerate(rand):
                rows[i].q.append(q[b])
        return tokens

