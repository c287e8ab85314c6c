"""LLMEngine: add requests, step (schedule → execute → update), abort; the synchronous core of every API."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvfleet_agent.config import EngineConfig
from kvfleet_agent.core.kv_cache import KVCacheManager
from kvfleet_agent.core.request import Request, RequestStatus
from kvfleet_agent.core.scheduler import Scheduler
from kvfleet_agent.core.speculator import Speculator
from kvfleet_agent.engine.detokenizer import IncrementalDetokenizer
from kvfleet_agent.engine.spec_log import SpecLog
from kvfleet_agent.engine.stats import EngineCounters, EngineObserver, EngineStats, SpecSnapshot
from kvfleet_agent.models.config import ModelConfig
from kvfleet_agent.models.tokenizer import Tokenizer, _int_list, _read_json
from kvfleet_agent.outputs import CompletionOutput, Logprob, RequestOutput
from kvfleet_agent.sampling_params import SamplingParams
from kvfleet_agent.spec_config import SpeculativeConfig
from kvfleet_agent.worker.device import rank_device
from kvfleet_agent.worker.executor import Executor
from kvfleet_agent.worker.grammar_compiler import GrammarCompiler

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Tracked:
    """Engine-side state of a request beside the scheduler's: text and logprobs."""

    request: Request
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[Logprob] | None
    prompt_logprobs: list[Logprob | None] | None = None  # by prompt position; recomputation rewrites the same slots
    # Text safe to show so far: no partial character, no possible stop-string prefix. Every value
    # it takes is a prefix of the final text, so streams can send differences.
    text: str = ""


class LLMEngine:
    """One model replica: its tokenizer, KV pool, scheduler and runner."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        self.tokenizer = Tokenizer.from_dir(config.tokenizer or config.model)
        if self.tokenizer is None and config.tokenizer is not None:
            raise ValueError(f"engine option tokenizer={config.tokenizer!r} is invalid: that directory has no "
                             "tokenizer.json; name one that has, or leave it unset (the model's)")
        if self.tokenizer is None:
            log.warning("%s has no tokenizer.json: prompts must be token ids and outputs carry no text",
                        config.model)
        self.max_model_len = self._max_model_len()
        # EOS from every source the checkpoint gives (config.json, generation_config.json, tokenizer_config.json);
        # with the tokenizer elsewhere, the model's generation_config.json still counts (vLLM stops there too).
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids) | frozenset(
            self.tokenizer.eos_token_ids if self.tokenizer else ()) | frozenset(
            _generation_eos(config.model) if config.tokenizer is not None else ())
        self.model_config.check_tensor_parallel(config.tensor_parallel_size, config.model)
        self.grammars = GrammarCompiler(self.tokenizer.backend.to_str(), self.model_config.vocab_size,
                                        sorted(self.eos_token_ids)) if self.tokenizer is not None else None
        config.resolve(rank_device(config, 0).type, self.max_model_len)
        self.executor = Executor(config, self.model_config, self.max_model_len)
        self.runner = self.executor.runner  # rank 0's
        try:
            num_blocks = self._size_kv_pool()
            self.executor.warmup()
            # After the pool exists (the graphs read it) and the warm-up compiled the kernels.
            self.runner.capture_decode_graphs()
        except BaseException:
            self.executor.shutdown()
            raise
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        assert config.max_num_batched_tokens is not None  # set by resolve()
        self.speculator = self._speculator()
        self.spec_log = SpecLog()
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill, self.speculator)
        self.counters = EngineCounters(last_step_time=time.time())
        self._tracked: dict[str, _Tracked] = {}
        self.observers: list[EngineObserver] = []
        log.info("kvfleet engine: %s (%s) on %s%s, %s; %s; KV pool %d blocks x %d tokens = %d tokens "
                 "(%.1f MiB a rank), max_model_len %d, max concurrent full-length sequences %.1f",
                 config.model, self.model_config.architecture, self.runner.device,
                 f" x {config.tensor_parallel_size} ranks" if config.tensor_parallel_size > 1 else "",
                 self.runner.dtype, self.runner.describe_kv(), num_blocks, config.block_size,
                 num_blocks * config.block_size,
                 num_blocks * self.runner.bytes_per_block() / 2**20, self.max_model_len,
                 num_blocks * config.block_size / self.max_model_len)

    def _speculator(self) -> Speculator | None:
        spec = self.config.speculative_config
        if spec is None:
            return None
        assert isinstance(spec, SpeculativeConfig)  # EngineConfig parsed it
        log.info("%s", spec.describe())
        return Speculator(spec)

    def _size_kv_pool(self) -> int:
        """Rank 0 decides the number of blocks from the smallest rank's budget; every rank allocates it."""
        budget = self.executor.kv_budget_bytes()
        num_blocks = budget // self.runner.bytes_per_block()
        if num_blocks * self.config.block_size < self.max_model_len:
            raise ValueError(
                f"the KV budget of {budget / 2**20:.0f} MiB holds {num_blocks * self.config.block_size} tokens, "
                f"fewer than max_model_len={self.max_model_len}: raise kv_cache_memory_bytes (or "
                "gpu_memory_utilization) or lower max_model_len")
        self.executor.allocate_kv_cache(num_blocks)
        return num_blocks

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (if any); the engine cannot run steps afterwards."""
        self.executor.shutdown()

    def check_health(self) -> None:
        """Raise if part of the engine (a tensor-parallel worker) has died."""
        self.executor.check()

    def _max_model_len(self) -> int:
        mc = self.model_config
        limit = mc.max_position_embeddings
        if mc.sliding_window and mc.sliding_window < limit:
            # Attention here is full, so stay inside the window where the two agree.
            log.warning("sliding_window=%d < max_position_embeddings=%d: capping max_model_len at the window",
                        mc.sliding_window, limit)
            limit = mc.sliding_window
        asked = self.config.max_model_len
        if asked is not None and asked > limit:
            raise ValueError(f"max_model_len={asked} exceeds what {self.config.model} supports ({limit}, from "
                             "config.json max_position_embeddings / sliding_window): lower it")
        return asked or limit

    # -- requests -------------------------------------------------------------------------------

    def tokenize(self, prompt: str) -> list[int]:
        """Token ids of a text prompt (needs tokenizer.json)."""
        if self.tokenizer is None:
            raise ValueError(f"prompt is text but {self.config.model} has no tokenizer.json: "
                             "pass {'prompt_token_ids': [...]} or add the tokenizer files")
        return self.tokenizer.encode(prompt)

    def make_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                     arrival_time: float | None = None) -> Request:
        """Validate and tokenize a request without touching engine state (safe from any thread)."""
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab}) (vocab_size of the model)")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}, which must "
                             "leave room for at least one generated token: shorten the prompt")
        spec = params.structured_outputs
        if spec is not None and spec.compiled is None:  # the offline path; the server compiles off its loop first
            if self.grammars is None:
                raise ValueError(f"structured outputs need the tokenizer, and {self.config.model} has no "
                                 "tokenizer.json")
            self.grammars.compile(spec)
        req = Request(request_id, ids, params, self.eos_token_ids, prompt=text, max_model_len=self.max_model_len)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        return req

    def add(self, req: Request) -> None:
        """Queue a request made by make_request."""
        if req.request_id in self._tracked:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        params = req.sampling_params
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params.stop,
                                           params.include_stop_str_in_output, params.skip_special_tokens)
        self._tracked[req.request_id] = _Tracked(
            req, detok, [] if params.logprobs is not None else None,
            [None] * req.num_prompt_tokens if params.prompt_logprobs is not None else None)
        self.scheduler.add(req)
        self.counters.prompt_tokens += req.num_prompt_tokens

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams) -> Request:
        """Validate, tokenize and queue a request."""
        req = self.make_request(request_id, prompt, params)
        self.add(req)
        return req

    def abort(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        """Stop requests now; their KV blocks return to the pool at once."""
        outs = []
        now = time.monotonic()
        for req in self.scheduler.abort(request_ids):
            self.counters.finished["abort"] += 1
            for obs in self.observers:
                obs.on_finish(req, now)
            outs.append(self._output(self._tracked.pop(req.request_id)))
        return outs

    def stats(self, queues: tuple[int, int] | None = None) -> EngineStats:
        """The gauges and counters now; queues: (waiting, running) as a caller on another thread knows them (the
        scheduler's own lengths otherwise)."""
        sched, kv, c = self.scheduler, self.kv, self.counters
        waiting, running = (len(sched.waiting), len(sched.running)) if queues is None else queues
        return EngineStats(waiting, running, sched.has_work(), kv.pool.usage(),
                           c.prompt_tokens, c.generation_tokens, dict(c.finished), sched.num_preemptions,
                           kv.prefix_queries, kv.prefix_hits, c.last_step_time, self._spec_snapshot())

    def _spec_snapshot(self) -> SpecSnapshot | None:
        if self.speculator is None:
            return None
        sc = self.speculator.counters
        return SpecSnapshot(self.speculator.config.method, sc.num_drafts, sc.num_draft_tokens, sc.num_accepted_tokens,
                            tuple(sc.accepted_per_position))

    def unfinished_ids(self) -> list[str]:
        """Ids of every request waiting or running."""
        return list(self.scheduler.requests)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return self.scheduler.has_work()

    # -- the loop -------------------------------------------------------------------------------

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Schedule, execute and update one step; returns the cumulative outputs of the requests that got a token
        (finished ones too), or with finished_only of the finished ones alone: a cumulative output copies every
        token so far, so building one per token for callers that only want the end costs O(length²)."""
        step_start = time.perf_counter()
        plan = self.scheduler.schedule()
        now = time.monotonic()
        for chunk in plan.chunks:
            req = self.scheduler.requests[chunk.request_id]
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        started = time.perf_counter()
        tokens, logprobs, prompt_logprobs, proposals = self.executor.execute(plan)
        execute_s = time.perf_counter() - started
        if self.speculator is not None:
            # A draft model's guesses for the next step; before update, whose retiring forgets finished requests'.
            self.speculator.set_proposals(proposals)
        for rid, (first, lps) in prompt_logprobs.items():
            slots = self._tracked[rid].prompt_logprobs
            assert slots is not None
            slots[first:first + len(lps)] = lps
        advanced = self.scheduler.update(plan, tokens)
        now = time.monotonic()
        if self.spec_log.due(now) and (snap := self._spec_snapshot()) is not None:
            self.spec_log.maybe_log(snap, now)
        self.counters.last_step_time = time.time()
        delivered = sum(r.num_new_tokens for r in advanced)
        self.counters.generation_tokens += delivered
        if self.speculator is not None:
            runner = self.executor.runner
            self.speculator.observe_step(plan, delivered, execute_s, time.perf_counter() - step_start, runner.draft_s,
                                         runner.draft_forwards, runner.draft_first_s)
        out = []
        for req in advanced:
            t = self._tracked[req.request_id]
            gap = None if req.last_token_time is None else now - req.last_token_time
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            for obs in self.observers:
                obs.on_token(req, now, gap)
            if t.logprobs is not None:
                t.logprobs.append(logprobs[req.request_id])
            if t.detokenizer is not None:
                self._detokenize(t)
            if req.is_finished:
                self.counters.finished[req.status.value] += 1
                for obs in self.observers:
                    obs.on_finish(req, now)
                del self._tracked[req.request_id]
            if req.is_finished or not finished_only:
                out.append(self._output(t))
        return out

    def _detokenize(self, t: _Tracked) -> None:
        """The step's new tokens, one at a time (a verified speculation brings several): a stop string in one of
        them ends the request there, and the tokens after it are dropped, as if they had never been generated."""
        req, detok = t.request, t.detokenizer
        assert detok is not None
        new = req.token_ids[req.num_tokens - req.num_new_tokens:]
        for i, token in enumerate(new):
            if req.sampling_params.min_tokens:
                detok.stops_active = req.num_output_tokens - (len(new) - 1 - i) >= req.sampling_params.min_tokens
            t.text += detok.add_tokens([token])
            if detok.stopped is not None:  # a stop string wins, even in the step that hit max_tokens
                if (after := len(new) - 1 - i) > 0:
                    del req.token_ids[-after:]
                    req.num_new_tokens -= after
                req.stop_reason = detok.stopped
                if req.is_finished:
                    req.status = RequestStatus.FINISHED_STOPPED
                else:
                    self.scheduler.stop(req)
                return
        if req.is_finished:
            t.text += detok.flush()  # release text held back as a possible stop-string prefix

    @staticmethod
    def _output(t: _Tracked) -> RequestOutput:
        """The public view of a request's state."""
        req = t.request
        text = t.text
        finish = req.status.value if req.is_finished else None
        completion = CompletionOutput(0, text, req.output_token_ids, finish, req.stop_reason,
                                      list(t.logprobs) if t.logprobs is not None else None)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion], req.is_finished,
                             req.num_cached_tokens, t.prompt_logprobs)


def _generation_eos(model_dir: str) -> list[int]:
    """The EOS ids of the model directory's generation_config.json (the tokenizer reads its own directory's)."""
    path = os.path.join(model_dir, "generation_config.json")
    gen = _read_json(path)
    return _int_list(gen.get("eos_token_id"), path, "eos_token_id") if gen else []
