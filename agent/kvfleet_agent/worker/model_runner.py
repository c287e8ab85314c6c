"""Model runner: one rank's model and KV tensors; runs a step's batch, and on rank 0 samples its tokens (and runs the
draft model, with speculative decoding by one)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch

from kvfleet_agent.config import EngineConfig
from kvfleet_agent.core.scheduler_output import ScheduledChunk
from kvfleet_agent.layers.attention import PagedAttention
from kvfleet_agent.layers.linear import log_quantized, weight_bytes
from kvfleet_agent.layers.quant.spec import spec_from_config
from kvfleet_agent.layers.tp_group import TPGroup
from kvfleet_agent.models.config import ModelConfig
from kvfleet_agent.models.fused_decode import FusedDecode
from kvfleet_agent.models.llama import LlamaForCausalLM
from kvfleet_agent.models.loader import LoadReport, load_weights
from kvfleet_agent.outputs import Logprob
from kvfleet_agent.sampling_params import SamplingParams
from kvfleet_agent.spec_config import SpeculativeConfig
from kvfleet_agent.worker.cuda_graphs import DecodeGraphRunner
from kvfleet_agent.worker.device import rank_device, release_freed_memory, resolve_dtype, to_device
from kvfleet_agent.worker.draft_model import DraftModel
from kvfleet_agent.worker.kv_budget import cpu_kv_budget, kv_budget_from_profile
from kvfleet_agent.worker.sampler import PromptLogprobs, Sampler, StepResult, prompt_logprobs
from kvfleet_agent.worker.spec_sampling import verify_batch
from kvfleet_agent.worker.startup_phases import StartupPhases
from kvfleet_agent.worker.step_batch import (
    DECODE_GROUP,
    ONE_GROUP,
    PROMPT_ROWS,
    StepBatch,
    StepInputs,
    plan_batch,
    profile_batch,
    step_inputs,
    warmup_steps,
)
from kvfleet_kernels import cpu_attention, dispatch, kv_quant

log = logging.getLogger(__name__)


class ModelRunner:
    """One rank: loads its shard of the checkpoint, sizes and binds its KV pool, runs steps."""

    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, max_model_len: int,
                 tp: TPGroup | None = None) -> None:
        self.config = config
        self.model_cfg = model_cfg
        self.tp = tp or TPGroup()
        self.device = rank_device(config, self.tp.rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL and the default stream follow the current device
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.dtype = resolve_dtype(config, model_cfg, self.device)
        self.kv_dtype = kv_quant.CACHE_DTYPES.get(config.kv_cache_dtype, self.dtype)
        in_place = (self.device.type == "cpu" and self.kv_dtype in cpu_attention.CACHE_DTYPES
                    and self.dtype in cpu_attention.QUERY_DTYPES and cpu_attention.available())
        self.decode_group = ONE_GROUP if in_place else DECODE_GROUP  # decode rows per attention call
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.startup = StartupPhases(f"rank {self.tp.rank}" if self.tp.size > 1 else "")
        start, report = time.perf_counter(), LoadReport()
        self.quant = spec_from_config({"quantization_config": model_cfg.quantization_config}, config.quantization)
        with torch.device(self.device):
            layer_quant = None if self.quant is None else self.quant.method if self.quant.on_load else "checkpoint"
            self.model = LlamaForCausalLM(model_cfg, max_model_len, self.dtype, self.tp, layer_quant).to(self.dtype)
        self.loaded_bytes = load_weights(self.model, config.model, report, self.quant)
        self.model.eval()
        for module in self.model.modules():  # CPU: oneDNN-prepacked GEMM weights (a no-op elsewhere)
            pack_weights = getattr(module, "pack_weights", None)
            if callable(pack_weights):
                pack_weights()
        FusedDecode.attach(self.model)
        # A prompt's first PROMPT_ROWS tokens run as decode rows where the stack takes them (its KV cache in the
        # model's dtype); elsewhere decode rows would run a gathering attention per row, far slower than a prefill.
        self.rows_within = PROMPT_ROWS if self.model.fused_decode is not None and self.kv_dtype == self.dtype else 0
        if self.quant is not None:
            log_quantized(self.model, self.quant.method, self.tp.rank)
            if self.quant.activation_scheme == "static" or self.quant.kv_cache_scales:
                log.warning("this checkpoint's static activation and KV-cache scales are not used: activations stay "
                            "in %s (weights only are quantized here); the KV cache is %s (--kv-cache-dtype: int8 and "
                            "fp8 set their own scale per token and head as they write)", self.dtype, self.kv_dtype)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the last host-to-device copies may still be in flight
        release_freed_memory()
        # Reading and placing interleave tensor by tensor: the reads are timed one by one (CheckpointTensor), and
        # everything else (allocating the parameters, copying into them, prepacking) is placing them on the device.
        self.startup.record("weights_read", report.read_seconds)
        self.startup.record("weights_to_device", time.perf_counter() - start - report.read_seconds)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        self.sampler = Sampler(config.seed, self.device)
        self.num_blocks = 0
        self.decode_graphs = DecodeGraphRunner(self.model, model_cfg.hidden_size, self.dtype, self.device,
                                               config.max_num_seqs, max_model_len, self.block_size)
        spec, self.draft = config.speculative_config, None
        if isinstance(spec, SpeculativeConfig) and spec.method == "draft_model" and self.tp.rank == 0:
            # Rank 0 alone holds it, whole, beside its shard of the target: it proposes, the ranks verify together.
            self.draft = DraftModel(spec, model_cfg, config.model, max_model_len, self.block_size, self.device,
                                    self.dtype, self.step_inputs, config.max_num_batched_tokens or max_model_len)
        self.draft_s = 0.0  # the draft's part of the last step (its proposals serve the next one)
        self.draft_forwards = 0  # and the forwards it ran then
        self.draft_first_s = 0.0  # and its seconds until its first proposal

    def param_bytes(self) -> int:
        """Bytes of this rank's weights as held (quantized ones as packed; a tied embedding and LM head once)."""
        return weight_bytes(self.model)

    def kv_shapes(self) -> list[tuple[int, ...]]:
        """The shape of each layer's K (and V) tensor on this rank."""
        return [tuple(layer.k_cache.shape) for layer in self.attn_layers]

    def bytes_per_block(self) -> int:
        """KV bytes of one block across all layers (keys and values) for this rank's heads, and the draft's."""
        a = self.attn_layers[0]
        row = kv_quant.bytes_per_row(a.head_dim, self.kv_dtype)
        return 2 * len(self.attn_layers) * self.block_size * a.num_kv_heads * row + \
            (self.draft.bytes_per_block() if self.draft is not None else 0)

    def describe_kv(self) -> str:
        """The KV cache's element type, and for int8/fp8 what it buys: tokens per byte against the model's dtype."""
        if self.kv_dtype == self.dtype:
            return f"KV cache {self.dtype}"
        a = self.attn_layers[0]
        gain = kv_quant.bytes_per_row(a.head_dim, self.dtype) / kv_quant.bytes_per_row(a.head_dim, self.kv_dtype)
        return (f"KV cache {self.kv_dtype} with a float32 scale per token and head: {gain:.2f}x the tokens of "
                f"{self.dtype} in the same memory")

    def kv_budget_bytes(self) -> int:
        """Bytes for the KV pool: the configured budget; on GPU what a profiling pass leaves; a RAM share on CPU."""
        if self.config.kv_cache_memory_bytes is not None:
            return self.config.kv_cache_memory_bytes
        if self.device.type == "cuda":
            if self.tp.size == 1:
                return self._profiled_kv_budget()
            # The profiling pass runs collectives, but the executor asks rank 0 for its budget before it
            # asks the workers: they would never meet. Until it asks every rank at once, estimate a
            # full step's activations beside the weights already resident.
            free, total = torch.cuda.mem_get_info(self.device)
            activations = (self.config.max_num_batched_tokens or 8192) * self.model_cfg.intermediate_size * 4 * 8
            return max(0, int(free - total * (1 - self.config.gpu_memory_utilization)) - activations)
        usable_blocks = self.config.max_num_seqs * -(-self.max_model_len // self.block_size) + 1
        return cpu_kv_budget(self.tp.size, usable_blocks, self.bytes_per_block())

    def _profiled_kv_budget(self) -> int:
        """kv_budget_from_profile around profile_run; the weights are resident, the pool not yet allocated."""
        dev = self.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        tokens = self.profile_run()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        # Emptied, so that free memory counts the pass's cached blocks as free (the peak counts them).
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        allocated = torch.cuda.memory_allocated(dev)
        # Graphs are captured after the pool is allocated and keep their own memory pool: reserve the
        # largest one's activations, estimated as the profiled ones scaled to its batch size.
        reserve = (peak - before) * self.decode_graphs.max_batch // tokens if self.wants_graphs() else 0
        budget = kv_budget_from_profile(total, free, allocated, peak, self.config.gpu_memory_utilization, reserve)
        log.info("memory profile on %s: %.2f GiB total, %.2f GiB weights, %.2f GiB activation peak for %d tokens, "
                 "%.2f GiB outside torch, %.2f GiB kept for CUDA graphs; KV pool %.2f GiB", dev, total / 2**30,
                 allocated / 2**30, (peak - before) / 2**30, tokens, (total - free - allocated) / 2**30,
                 reserve / 2**30, budget / 2**30)
        return budget

    @torch.inference_mode()
    def profile_run(self) -> int:
        """Run the largest step the scheduler can send (profile_batch) and sample from it; returns its tokens.

        For the memory peak: its activations, logits and the sampler's temporaries (every row through
        top-k and top-p, the costliest path). It writes nothing into the pool, so it may run before one
        exists: one-block stand-ins then give the kernels a cache's shape.
        """
        if self.num_blocks == 0:
            for layer in self.attn_layers:
                layer.allocate(1, self.block_size, self.kv_dtype, self.device)
            if self.draft is not None:
                self.draft.allocate(1, stand_in=True)
        assert self.config.max_num_batched_tokens is not None  # set by EngineConfig.resolve
        batch = profile_batch(self.config.max_num_batched_tokens, self.config.max_num_seqs, self.max_model_len)
        hidden, rows = self._eager_hidden(batch)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        del hidden
        # Seeded per row: the engine's default generator must not advance (it would change unseeded outputs).
        ids = [f"profile-{i}" for i in range(len(batch.sample_rows))]
        params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=0, max_tokens=1)] * len(ids)
        self.sampler.sample(logits, ids, params)
        self.sampler.forget(ids)
        if self.draft is not None:  # it runs after the target in a step: the peak is the larger pass's
            del logits
            self.draft.profile(batch)
        return len(batch.input_ids)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Create each layer's [num_blocks, block_size, kv_heads, head_dim] K and V tensors and bind them."""
        self.decode_graphs.release()  # captured graphs would go on reading the old tensors
        self.num_blocks = num_blocks
        for layer in self.attn_layers:
            layer.allocate(num_blocks, self.block_size, self.kv_dtype, self.device)
        if self.draft is not None:
            self.draft.allocate(num_blocks)

    def warmup(self) -> None:
        """Run the warm-up steps on this rank alone (a group of one)."""
        for step in warmup_steps(self.block_size):
            batch, samplers = plan_batch(step.chunks, self.block_size, rows_within=self.rows_within)
            self.execute(batch, samplers)
            self.forget(step.finished)

    def wants_graphs(self) -> bool:
        """Whether decode steps should replay CUDA graphs: on a GPU, unless enforce_eager, with one rank.

        Tensor parallelism stays eager: a graph holding NCCL collectives must be captured and replayed
        in lockstep on every rank, which needs the workers to capture too (not wired up yet).
        """
        return self.device.type == "cuda" and not self.config.enforce_eager and self.tp.size == 1

    def _no_graphs_reason(self) -> str:
        """Why wants_graphs() is False, in words for the start-up log."""
        if self.device.type != "cuda":
            return f"decode runs eagerly on {self.device.type}: CUDA graphs need a GPU"
        if self.config.enforce_eager:
            return "--enforce-eager"
        return "tensor parallelism decodes eagerly"

    def capture_decode_graphs(self) -> None:
        """Capture the decode graphs, if wanted: after the pool is allocated (they read it) and warmed up."""
        if not self.wants_graphs():
            self.startup.skip("graph_capture", self._no_graphs_reason())
            return
        probe = torch.empty(0, dtype=self.dtype, device=self.device)  # the kernels follow the queries' dtype
        if dispatch.backend(probe) != "triton":  # the reference syncs the host in places: not capturable
            log.warning("CUDA graphs need the Triton kernels (%s=0 or dtype %s): decoding eagerly",
                        dispatch.FORCE_ENV, probe.dtype)
            self.startup.skip("graph_capture", f"no Triton kernels for dtype {probe.dtype}")
            return
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        with self.startup.phase("graph_capture"):
            self.decode_graphs.capture()
        log.info("captured CUDA graphs for decode batch sizes %s in %.1f s (%.0f MiB)", self.decode_graphs.sizes,
                 time.perf_counter() - start, (free_before - torch.cuda.mem_get_info(self.device)[0]) / 2**20)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop the sampling state (seeded generators, the draft's) of requests that finished."""
        ids = list(request_ids)
        self.sampler.forget(ids)
        if self.draft is not None:
            self.draft.forget(ids)

    @torch.inference_mode()
    def execute(self, batch: StepBatch, samplers: list[ScheduledChunk], draft_k: int = -1) -> StepResult:
        """Run a step's batch and sample it (rank 0): the next token (and logprobs if asked) of each sampling chunk,
        and with a draft model its proposals for the next step: draft_k per request (0: none, -1: its k).

        `samplers` are the chunks that sample, in the order of the batch's sample rows (plan_batch's second
        result). Other ranks run `forward` alone on the same batch; the collectives inside keep them in step.
        """
        tokens, logprobs, prompt = self._run(batch, samplers)
        proposals: dict[str, list[int]] = {}
        if self.draft is not None:
            started = time.perf_counter()
            proposals = self.draft.step(batch, samplers, tokens, self.sampler, draft_k)
            self.draft_s = time.perf_counter() - started
            self.draft_forwards = self.draft.forwards
            self.draft_first_s = self.draft.first_s
        return tokens, logprobs, prompt, proposals

    def _run(self, batch: StepBatch, samplers: list[ScheduledChunk]) -> tuple[dict[str, list[int]],
                                                                             dict[str, Logprob], PromptLogprobs]:
        logits = self.forward(batch)
        if logits is None:
            return {}, {}, {}
        prompt: PromptLogprobs = {}
        if len(batch.prompt_rows):
            s = len(batch.sample_rows)
            prompt = prompt_logprobs(logits[s:], batch.prompt_spans)
            logits = logits[:s]
        if not any(c.draft for c in samplers):  # the common step: one row, one token per request
            return (*self._sample(logits, samplers), prompt)
        plain: list[int] = []
        verified: list[int] = []
        row = 0
        for c in samplers:  # a verified chunk's rows: its last token's, then one per draft token
            (verified if c.draft else plain).extend(range(row, row + 1 + len(c.draft)))
            row += 1 + len(c.draft)
        spec = [c for c in samplers if c.draft]
        tokens, logprobs = self._sample(_rows(logits, plain), [c for c in samplers if not c.draft]) \
            if plain else ({}, {})
        emitted = verify_batch(_rows(logits, verified).float(), [c.draft for c in spec],
                               [c.sampling_params for c in spec],
                               [self.sampler.generator(c.request_id, c.sampling_params) for c in spec],
                               [self.draft.draft_probs(c) for c in spec] if self.draft is not None else None)
        tokens.update((c.request_id, out) for c, out in zip(spec, emitted, strict=True))
        return tokens, logprobs, prompt

    def _sample(self, logits: torch.Tensor, samplers: list[ScheduledChunk]) -> tuple[dict[str, list[int]],
                                                                                    dict[str, Logprob]]:
        ids = [c.request_id for c in samplers]
        tokens, logprobs = self.sampler.sample(logits, ids, [c.sampling_params for c in samplers],
                                               [c.history for c in samplers])
        return ({rid: [t] for rid, t in zip(ids, tokens, strict=True)},
                {rid: lp for rid, lp in zip(ids, logprobs, strict=True) if lp is not None})

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor | None:
        """The model over the batch; logits of the sample rows over the whole vocabulary (None if none),
        followed by those of the prompt-logprob rows when the batch has any."""
        graphs = self.decode_graphs
        size = graphs.accepts(batch) if graphs.active and not len(batch.prompt_rows) else None
        if size is not None:
            hidden = graphs.run(batch, size)
            # Usually every decode row samples, in order: then the hidden states need no gather.
            rows = None if len(batch.sample_rows) == len(batch.input_ids) else \
                to_device([batch.sample_rows], self.device)[0]
        else:
            hidden, rows = self._eager_hidden(batch)
        sample = self.model.compute_logits(hidden if rows is None else hidden.index_select(0, rows)) \
            if len(batch.sample_rows) else None
        if len(batch.prompt_rows):  # rare: a request asked for prompt logprobs
            # A call of the head of their own: a row's logits depend on how many rows share its call (see
            # ParallelLMHead), so the sample rows run as they would without prompt rows beside them (echo's completion
            # is a plain one's).
            prompt = self.model.compute_logits(hidden.index_select(0, to_device([batch.prompt_rows], self.device)[0]))
            return prompt if sample is None else torch.cat([sample, prompt])
        return sample

    def _eager_hidden(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The model run eagerly over any batch: (hidden states [T, hidden], the sample rows on the device)."""
        ids, positions, rows, meta = self.step_inputs(batch)
        return self.model(ids, positions, meta), rows

    def step_inputs(self, batch: StepBatch) -> StepInputs:
        """The batch's model inputs on this rank's device (any model's: the draft's pool has the same blocks)."""
        return step_inputs(batch, self.device, self.block_size, self.decode_group)


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows]: a view where the rows are consecutive (plan_batch puts the verifications after the plain decodes,
    so they usually are), else a gather (advanced indexing cost ~50 us a step here at 5 x 4,096)."""
    if rows[-1] - rows[0] + 1 == len(rows):
        return logits[rows[0]:rows[-1] + 1]
    return logits[torch.tensor(rows, device=logits.device)]
