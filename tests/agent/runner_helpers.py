"""Shared by the model-runner tests: a runner on a tiny checkpoint with its own KV pool, and sequences in it."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from kvfleet_agent.config import EngineConfig
from kvfleet_agent.core.scheduler_output import ScheduledChunk
from kvfleet_agent.models.config import ModelConfig
from kvfleet_agent.sampling_params import SamplingParams
from kvfleet_agent.worker.model_runner import ModelRunner
from kvfleet_agent.worker.step_batch import StepBatch, plan_batch

MAX_MODEL_LEN = 64
BLOCK_SIZE = 4  # small, so that contexts span several blocks
NUM_BLOCKS = 16 * MAX_MODEL_LEN // BLOCK_SIZE + 1
GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


def make_runner(ckpt: Path | str, device: str = "cpu", num_blocks: int | None = NUM_BLOCKS,
                **options: Any) -> ModelRunner:
    """A float32 runner with a pool of num_blocks blocks, or none yet (every engine option can be overridden)."""
    opts: dict[str, Any] = {"dtype": "float32", "block_size": BLOCK_SIZE, "max_model_len": MAX_MODEL_LEN,
                            "max_num_seqs": 16, "kv_cache_memory_bytes": 1 << 20, **options}
    config = EngineConfig(model=str(ckpt), device=device, **opts)
    config.resolve(torch.device(device).type, opts["max_model_len"])
    runner = ModelRunner(config, ModelConfig.from_dir(str(ckpt)), opts["max_model_len"])
    if num_blocks is not None:
        runner.allocate_kv_cache(num_blocks)
    return runner


class Sequences:
    """Sequences in a runner's pool, each with blocks of its own: prefilled, then decoded a token at a time."""

    def __init__(self, runner: ModelRunner, seed: int) -> None:
        self.runner = runner
        self.rng = random.Random(seed)
        self.vocab = runner.model_cfg.vocab_size
        self.next_block = 0  # block 0 holds a real sequence, as in the engine: padding rows read it
        self.tokens: dict[str, list[int]] = {}
        self.tables: dict[str, list[int]] = {}

    def prefill(self, lengths: list[int]) -> list[str]:
        """New sequences of random tokens, written into the pool by one step; returns their names."""
        chunks = []
        for length in lengths:
            name = f"seq{len(self.tokens)}"
            nb = self.runner.max_model_len // self.runner.block_size  # room to decode up to max_model_len
            self.tables[name] = list(range(self.next_block, self.next_block + nb))
            self.next_block += nb
            self.tokens[name] = [self.rng.randrange(4, self.vocab) for _ in range(length)]
            chunks.append(ScheduledChunk(name, self.tokens[name], 0, self.tables[name], True, GREEDY))
        self.runner.forward(plan_batch(chunks, self.runner.block_size)[0])
        return [c.request_id for c in chunks]

    def rewrite(self, name: str) -> None:
        """Replace a sequence's tokens with new random ones of the same length (its cached K/V changes)."""
        self.tokens[name] = [self.rng.randrange(4, self.vocab) for _ in self.tokens[name]]
        chunk = ScheduledChunk(name, self.tokens[name], 0, self.tables[name], True, GREEDY)
        self.runner.forward(plan_batch([chunk], self.runner.block_size)[0])

    def decode_chunks(self, names: list[str]) -> list[ScheduledChunk]:
        """One new token for each sequence, at its next position (recorded, so the next call moves on)."""
        chunks = []
        for name in names:
            token = self.rng.randrange(4, self.vocab)
            chunks.append(ScheduledChunk(name, [token], len(self.tokens[name]), self.tables[name], True, GREEDY))
            self.tokens[name].append(token)
        return chunks

    def decode_batch(self, names: list[str]) -> StepBatch:
        """The step batch of decode_chunks."""
        return plan_batch(self.decode_chunks(names), self.runner.block_size)[0]


def written_elsewhere(before: list[torch.Tensor], runner: ModelRunner, slots: list[int]) -> bool:
    """Whether any layer's K or V cache changed outside the given slots since the `before` snapshot."""
    caches = [t for layer in runner.attn_layers for t in (layer.k_cache, layer.v_cache)]
    for old, new in zip(before, caches, strict=True):
        keep = torch.ones(old.shape[0] * old.shape[1], dtype=torch.bool)
        keep[slots] = False
        if not torch.equal(old.flatten(0, 1)[keep.to(old.device)], new.flatten(0, 1)[keep.to(new.device)]):
            return True
    return False


def snapshot(runner: ModelRunner) -> list[torch.Tensor]:
    """Copies of every layer's K and V caches."""
    return [t.clone() for layer in runner.attn_layers for t in (layer.k_cache, layer.v_cache)]
