"""Pure-decode steps at fixed, padded batch sizes: CUDA graph replay on a GPU, the same forward eagerly elsewhere."""

from __future__ import annotations

import bisect

import torch
from torch import nn

from kvfleet_agent.layers.attention import AttentionMetadata
from kvfleet_agent.worker.device import host_buffer
from kvfleet_agent.worker.step_batch import StepBatch

MAX_CAPTURE_SIZE = 256  # as vLLM: larger decode batches are compute-bound, launch overhead no longer matters
WARMUP_RUNS = 2  # eager runs per size before its capture: Triton compiles and loads its kernels then, not inside


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes to capture, ascending: 1, 2, 4, 8, then every 8, up to the first covering
    min(max_num_seqs, 256) (so any decode batch the scheduler can form up to that bound has a size)."""
    limit = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = []
    for size in [1, 2, 4, *range(8, MAX_CAPTURE_SIZE + 1, 8)]:
        sizes.append(size)
        if size >= limit:
            break
    return sizes


class DecodeGraphRunner:
    """Runs pure-decode steps padded to a fixed batch size, over static device buffers.

    A CUDA graph replays the kernels it captured on the memory it captured: every input lives in a
    static buffer that each step overwrites in place, the block tables are [size, W] with W fixed by
    max_model_len, and the output lands in a static hidden-state buffer. Padding rows (the batch
    rounded up to the next captured size) take token 0 at position 0, slot -1 (their K/V is never
    written) and a context of one token in block 0: finite, since the pool is zero-filled and only
    real K/V is ever written to it, and thrown away. Without captured graphs `run` executes the
    identical forward eagerly: the padding logic is the same everywhere, and testable without a GPU.
    Only `capture` activates the runner in an engine: on CPU (and with enforce_eager) steps keep the
    normal forward, whose length-grouped decode attention is the faster one there.

    The graphs read the KV tensors that were bound when they were captured: `release` them if the
    pool is reallocated. Every tensor-parallel rank must make the same choice per step (their
    collectives pair up): the runner keeps this inactive with more than one rank.
    """

    def __init__(self, model: nn.Module, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 max_num_seqs: int, max_model_len: int, block_size: int) -> None:
        self.model = model
        self.device = device
        self.sizes = capture_sizes(max_num_seqs)
        self.max_batch = self.sizes[-1]
        self.width = -(-max_model_len // block_size)  # block table columns: any sequence's whole table
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((n, self.width), dtype=torch.int64, device=device)
        self.hidden = torch.zeros((n, hidden_size), dtype=dtype, device=device)
        # One metadata object per size, views of the static buffers: built once, so the captured
        # forward and every replay see the very same tensors.
        self.metas = {s: AttentionMetadata(self.slot_mapping[:s], [], [], self.block_tables[:s], self.seq_lens[:s])
                      for s in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.active = False  # whether ModelRunner.forward routes pure-decode steps here
        self.runs = 0  # steps run here (captured or eager)

    def size_for(self, num_rows: int) -> int | None:
        """The smallest size holding num_rows rows; None above the largest (those run the normal way)."""
        i = bisect.bisect_left(self.sizes, num_rows)
        return self.sizes[i] if i < len(self.sizes) else None

    def accepts(self, batch: StepBatch) -> int | None:
        """The padded size to run a batch at, or None unless it is a pure decode batch that fits."""
        n = len(batch.input_ids)
        if batch.prefills or batch.decode_tables.shape[0] != n or batch.decode_tables.shape[1] > self.width:
            return None
        return self.size_for(n)

    @property
    def captured(self) -> bool:
        """Whether replays run captured CUDA graphs."""
        return bool(self.graphs)

    def activate(self) -> None:
        """Route pure-decode steps through `run` from now on (eagerly where nothing is captured)."""
        self.active = True

    def release(self) -> None:
        """Drop the graphs and stop routing steps here (the KV tensors they read are being replaced)."""
        self.graphs.clear()
        self.active = False

    def _forward(self, size: int) -> None:
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.metas[size])
        self.hidden[:size].copy_(hidden)

    def _reset_inputs(self) -> None:
        """Every row padding: a run then writes no K/V (what capture's warm-up runs need)."""
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        self.block_tables.zero_()

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture one graph per size, largest first, all in one memory pool.

        Largest first: a smaller graph's temporaries then fit in memory the larger one already took
        from the shared pool. Only one graph replays at a time, so sharing the pool is safe.
        """
        if self.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device, not {self.device}")
        self.graphs.clear()
        self._reset_inputs()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            for _ in range(WARMUP_RUNS):
                self._forward(size)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.active = True

    def _fill(self, batch: StepBatch, size: int) -> None:
        """Copy the batch into the static buffers' first `size` rows, padding rows after the real ones."""
        n, width = len(batch.input_ids), batch.decode_tables.shape[1]
        host = host_buffer(4 * size + size * width, self.device)
        ids, pos, slots, lens = host.numpy()[:4 * size].reshape(4, size)
        tables = host.numpy()[4 * size:].reshape(size, width)
        ids[:n], ids[n:] = batch.input_ids, 0
        pos[:n], pos[n:] = batch.positions, 0
        slots[:n], slots[n:] = batch.slot_mapping, -1
        lens[:n], lens[n:] = batch.positions + 1, 1  # a decode's context includes its own token
        tables[:n], tables[n:] = batch.decode_tables, 0
        # Columns past `width` keep an earlier step's entries: never read, as they lie past every
        # row's length (the kernels load table entries only below it).
        nb = self.device.type == "cuda"
        for static, i in ((self.input_ids, 0), (self.positions, 1), (self.slot_mapping, 2), (self.seq_lens, 3)):
            static[:size].copy_(host[i * size:(i + 1) * size], non_blocking=nb)
        self.block_tables[:size, :width].copy_(host[4 * size:].view(size, width), non_blocking=nb)

    @torch.inference_mode()
    def run(self, batch: StepBatch, size: int) -> torch.Tensor:
        """Hidden states [rows, hidden] of a pure decode batch (`accepts` gave `size`).

        A view of the static output buffer: valid until the next run.
        """
        self._fill(batch, size)
        graph = self.graphs.get(size)
        if graph is not None:
            graph.replay()
        else:
            self._forward(size)
        self.runs += 1
        return self.hidden[:len(batch.input_ids)]
