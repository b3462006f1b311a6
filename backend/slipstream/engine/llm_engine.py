"""The synchronous engine: add requests, abort them, and advance everything one step at a time.

The engine composes its rooms and runs the step; the work is theirs:

* ``InputProcessor`` -- a client's prompt and parameters become a checked ``Request``;
* the scheduler (core) -- which requests run this step, and what their sampled tokens mean;
* ``ModelExecutor`` -- runs the batch through the model and samples it, in one call;
* ``OutputProcessor`` -- detokenizes and turns each request's update into client outputs.

A step: schedule -> execute + sample -> update -> outputs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Union

import torch

from slipstream.core.batch_scheduler import BatchScheduler
from slipstream.core.block_hash import make_hasher
from slipstream.core.block_manager import BlockManager
from slipstream.core.config import EngineConfig
from slipstream.core.kv_cache_events import KVCacheEvent
from slipstream.core.lora_limit import adapters_of
from slipstream.core.pooling_params import PoolingParams
from slipstream.core.request import Request, RequestOutput, RequestStatus, merge_output
from slipstream.core.sampling_params import SamplingParams
from slipstream.core.scheduler import Scheduler, SchedulerBase
from slipstream.core.sequence_group import SequenceGroup
from slipstream.core.stats import EngineStats, StatsSnapshot
from slipstream.core.swap_space import SwapSpace
from slipstream.engine.admission import OVERLOADED, RETRY_AFTER_S, OverloadedError, QueueLimit
from slipstream.engine.executor.leader import TensorParallelLeader
from slipstream.engine.factory import (
    DeviceSettings,
    ModelFactory,
    input_vocab_size,
    resolved_max_model_len,
)
from slipstream.engine.input_processor import (
    ClientRequest,
    InputLimits,
    InputProcessor,
    Prompt,
    PromptOptions,
    RequestSettings,
)
from slipstream.engine.model_executor import ModelExecutor
from slipstream.engine.output_processor import OutputProcessor
from slipstream.engine.spec_decode import Proposer, make_proposer
from slipstream.trace import StepTracer
from slipstream.worker.distributed.sharding import shard_of
from slipstream.worker.layers.memory import release_freed_memory
from slipstream.worker.pooling import PromptPooler
from slipstream.worker.sample.device_sampler import sampler_for
from slipstream.worker.sample.sampler import TokenSampler
from slipstream.worker.sample.structured_output import GrammarCompiler
from slipstream.worker.swap import SwapPool, num_cpu_blocks

if TYPE_CHECKING:
    from typing_extensions import Unpack

log = logging.getLogger("slipstream")

__all__ = ["LLMEngine", "OVERLOADED", "OverloadedError", "Prompt", "RETRY_AFTER_S", "StepResult"]

KVEventSink = Callable[[list[KVCacheEvent]], None]


@dataclass(frozen=True)
class StepResult:
    """What one step did: the outputs it made, and whether a batch ran (False: nothing was
    scheduled, e.g. dynamic batching holding requests). Iterates over its outputs."""

    outputs: list[RequestOutput]
    ran: bool

    def __iter__(self) -> Iterator[RequestOutput]:
        return iter(self.outputs)

    def __len__(self) -> int:
        return len(self.outputs)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model: Optional[torch.nn.Module] = None,
        tokenizer: object = None,
        kv_event_sink: Optional[KVEventSink] = None,
    ) -> None:
        """``kv_event_sink`` receives the prefix cache's events after each step that made
        any, on the engine thread: it must return at once (a queue, not I/O).

        With ``tensor_parallel_size`` > 1 this is rank 0 of a group of processes
        (``engine/executor``): ``close()`` ends them."""
        settings = DeviceSettings.resolve(config)
        self.parallel: Optional[TensorParallelLeader] = None
        if config.tensor_parallel_size > 1:
            self.parallel = TensorParallelLeader.start(config, settings)
        try:
            self._build(config, settings, model, tokenizer, kv_event_sink)
        except BaseException as exc:
            parallel = self.parallel
            cause = parallel.load_failure() if parallel and isinstance(exc, Exception) else None
            self.close()
            if cause is not None:  # another rank's failure: name it
                raise RuntimeError(
                    f"tensor_parallel_size={config.tensor_parallel_size}: {cause}"
                ) from exc
            raise

    def _build(
        self,
        config: EngineConfig,
        settings: DeviceSettings,
        model: Optional[torch.nn.Module],
        tokenizer: object,
        kv_event_sink: Optional[KVEventSink],
    ) -> None:
        self.device, self.dtype = settings.device, settings.dtype
        self._select_device()
        self.weight_format, self.kv_dtype = settings.weight_format, settings.kv_dtype
        factory = ModelFactory(config, settings, self.parallel.member if self.parallel else None)
        target = factory.load_target(model, tokenizer)
        self.config = config = target.config
        self.model, self.tokenizer, self.lora = target.model, target.tokenizer, target.lora
        self.eos_token_id = self._eos_token_id()
        draft = factory.load_draft(self.model)  # before the cache is sized: its memory counts
        self.kv_cache = factory.allocate_kv_cache(self.model, self.lora, draft)
        self.memory_plan = factory.memory_plan  # how GPU memory was shared out (None on CPU)
        self.block_manager = BlockManager(
            self.kv_cache.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            hasher=make_hasher(config.prefix_caching_hash_algo),
            lora_paths=config.lora_modules if config.enable_lora else None,
            emit_events=kv_event_sink is not None,
        )
        self.kv_event_sink = kv_event_sink
        self._flush_kv_events()  # a fresh cache: AllBlocksCleared
        self.swap_pool: Optional[SwapPool] = None
        self.scheduler = self._make_scheduler()
        self._warn_short_capacity()
        self.runner = factory.build_runner(
            self.model, self.kv_cache, resolved_max_model_len(config), self.lora
        )
        if self.parallel is not None:
            self.parallel.wait_until_ready()
        self.executor = ModelExecutor(self.runner, sampler_for(self.device, config.seed))
        self._pooler: Optional[PromptPooler] = None  # made by the first pooling request
        self.proposer: Optional[Proposer] = make_proposer(
            config,
            lambda: factory.draft_stack(self.model, draft, self.block_manager.num_blocks),
            input_vocab_size(self.model),
            len(self.tokenizer),
        )
        self.stats = EngineStats()
        self.queue_limit = QueueLimit(config.max_queue_size)
        self.input_processor = InputProcessor(
            self.tokenizer,
            self._input_limits(),
            self.eos_token_id,
            GrammarCompiler(self.tokenizer, self.logits_vocab_size, self.eos_token_id),
        )
        self.output_processor = OutputProcessor(
            self.tokenizer,
            self.input_processor.tokenizer_lock,
            self.scheduler,
            self.stats,
            config.block_size,
            self._forget,
        )
        self.tracer: Optional[StepTracer] = (
            StepTracer() if config.trace_steps or config.trace_file else None
        )

    # -- construction helpers ------------------------------------------------------------
    def _select_device(self) -> None:
        """Make the engine's GPU the calling thread's current CUDA device: OpenAI Triton
        launches on the current device, and an instance on ``cuda:1`` must not launch on 0."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def _eos_token_id(self) -> Optional[int]:
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return eos[0] if isinstance(eos, (list, tuple)) else eos

    def _warn_short_capacity(self) -> None:
        max_model_len = resolved_max_model_len(self.config)
        if self.scheduler.max_seq_len < max_model_len:
            log.warning(
                "the KV cache holds %d tokens, less than max_model_len %d: sequences "
                "end at %d tokens",
                self.scheduler.max_seq_len,
                max_model_len,
                self.scheduler.max_seq_len,
            )

    def _make_scheduler(self) -> SchedulerBase:
        """Chosen once: the continuous scheduler, or a request-level batching baseline
        (which never preempts, so it has no swap space)."""
        if self.config.batching != "continuous":
            return BatchScheduler(self.config, self.block_manager)
        swap = None
        if self.config.preemption_mode != "recompute":
            blocks = num_cpu_blocks(self.kv_cache, self.config.swap_space_bytes)
            swap = SwapSpace(self.config, self.block_manager, blocks)
            self.swap_pool = SwapPool(self.kv_cache, blocks)
        return Scheduler(self.config, self.block_manager, swap)

    def _input_limits(self) -> InputLimits:
        c = self.config
        return InputLimits(
            max_model_len=resolved_max_model_len(c),
            block_size=c.block_size,
            num_usable_blocks=self.block_manager.num_usable_blocks,
            logits_vocab_size=self.logits_vocab_size,
            input_vocab_size=input_vocab_size(self.model),
            max_num_seqs=c.max_num_seqs,
            continuous_batching=c.batching == "continuous",
            lora_names=None if self.lora is None else tuple(self.lora.names),
        )

    @functools.cached_property
    def logits_vocab_size(self) -> int:
        """How many token ids the model scores (what stop and blocked ids index)."""
        shard = shard_of(self.model)
        if shard is not None:  # the logits gathered from every rank's share
            return shard.vocab_size
        hf: Any = self.model  # a transformers model: torch types its methods as Tensor | Module
        head = hf.get_output_embeddings()
        size = getattr(head, "out_features", None) or getattr(head, "num_embeddings", None)
        return int(size or hf.config.get_text_config().vocab_size)

    @property
    def sampler(self) -> TokenSampler:
        return self.executor.sampler

    @sampler.setter
    def sampler(self, sampler: TokenSampler) -> None:  # benchmarks compare samplers in place
        self.executor.sampler = sampler

    @property
    def requests(self) -> dict[str, Request]:
        """Every sequence being served, by its id."""
        return self.output_processor.requests

    # -- requests ----------------------------------------------------------------------------
    def make_request(
        self,
        prompt: Prompt,
        params: Optional[SamplingParams] = None,
        **settings: Unpack[RequestSettings],
    ) -> Request:
        """Tokenize and validate (``InputProcessor.process``); raises ``ValueError`` with a
        message fit for the client."""
        return self.input_processor.process(ClientRequest.of(prompt, params, **settings))

    def tokenize(
        self, prompt: Prompt, apply_chat_template: bool = False, add_special_tokens: bool = True
    ) -> list[int]:
        return self.input_processor.tokenize(
            prompt, PromptOptions(apply_chat_template, add_special_tokens)
        )

    def add(self, req: Request, check_queue: bool = True) -> None:
        """``check_queue=False``: the caller has already admitted the request against
        ``max_queue_size`` (EngineLoop does so at submit time)."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if check_queue:
            self.check_queue_room(self.num_waiting())
        group = SequenceGroup.create(req)
        sequences = group.sequences if group is not None else [req]
        taken = [s.request_id for s in sequences if s.request_id in self.requests]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use")
        for seq in sequences[1:]:
            if req.grammar is not None:  # each sequence is constrained on its own
                seq.grammar = req.grammar.copy()
        self.output_processor.add(sequences)
        self.scheduler.add(req)  # only the parent is queued: the children fork from it

    def add_request(
        self,
        prompt: Prompt,
        params: Optional[SamplingParams] = None,
        **settings: Unpack[RequestSettings],
    ) -> Request:
        """``make_request``, then ``add``."""
        req = self.make_request(prompt, params, **settings)
        self.add(req)
        return req

    def embed(self, token_ids: list[int], params: PoolingParams) -> list[float]:
        """A pooling request's vector, computed now on a KV cache of its own
        (``worker/pooling``): it takes no block, slot or step from generation."""
        if self._pooler is None:
            self._pooler = PromptPooler(self.runner.forward, self.kv_cache.geometry, self.device)
        return self._pooler.embed(token_ids, params)

    def abort(self, request_id: str) -> Optional[RequestOutput]:
        """Stop a request now and free its KV blocks; returns its final output."""
        return self.output_processor.end(request_id, RequestStatus.FINISHED_ABORTED, None)

    def fail(self, request_id: str, message: str) -> Optional[RequestOutput]:
        return self.output_processor.end(request_id, RequestStatus.FINISHED_ERROR, message)

    def _forget(self, request_id: str) -> None:
        """A finished sequence's state outside the output processor and the scheduler."""
        self.sampler.forget(request_id)
        if self.proposer is not None:
            self.proposer.discard(request_id)

    # -- what the engine loop uses -------------------------------------------------------------
    def fatal_error(self) -> Optional[str]:
        """Why the engine can serve nothing more until it is built again (its
        tensor-parallel group broke), or None."""
        return self.parallel.fatal_error() if self.parallel is not None else None

    def close(self) -> None:
        """End what the engine started outside this process's memory: a tensor-parallel
        group's other ranks, its sockets and ports (idempotent; any thread)."""
        parallel, self.parallel = self.parallel, None
        if parallel is not None:
            parallel.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def next_wakeup(self) -> Optional[float]:
        """When a held-back batch may form (monotonic seconds), or None."""
        return self.scheduler.next_wakeup()

    def check_queue_room(self, num_queued: int) -> None:
        """The one admission rule: ``OverloadedError`` when ``max_queue_size`` requests are
        already queued (safe on any thread: it reads only the config)."""
        self.queue_limit.check(num_queued)

    def fail_running(self, message: str) -> list[RequestOutput]:
        """End every running request with ``message`` (a step raised under them)."""
        victims = [r.request_id for r in self.scheduler.running]
        return [o for o in (self.fail(rid, message) for rid in victims) if o is not None]

    def abort_all(self) -> list[RequestOutput]:
        """Abort every request being served; their final outputs."""
        return [o for o in (self.abort(rid) for rid in list(self.requests)) if o is not None]

    def save_trace(self) -> Optional[str]:
        """Write the step trace to ``trace_file``; the path, or None when there is none to
        write. Raises ``OSError`` when it cannot be written."""
        path = self.config.trace_file
        if not path or self.tracer is None:
            return None
        self.tracer.save(path)
        return path

    # -- the step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> StepResult:
        """Schedule -> execute + sample -> update -> outputs, for every request that moved."""
        step_start = time.perf_counter()
        self._select_device()
        sched = self.scheduler.schedule()
        if self.swap_pool is not None:
            self.swap_pool.apply(sched)
        if sched.is_empty:
            if self.tracer is not None and sched.preempted:  # a step that only preempted
                now = time.perf_counter()
                self.tracer.record(sched, now, now, self)
            self._flush_kv_events()
            return StepResult([], ran=False)
        started = time.perf_counter()
        sampled = self.executor.execute_model(sched)
        updates = self.scheduler.update_from_output(
            sched, sampled, self.output_processor.stop_string
        )
        self.kv_cache.copy_blocks(sched.block_copies)  # before any later step reuses a block
        self.stats.record_step(sched, time.perf_counter() - started)
        if self.proposer is not None:
            self._propose([item.request for item in sched.scheduled])
        outputs = [out for u in updates for out in self.output_processor.process(u)]
        self.scheduler.observe_step(sched, time.perf_counter() - step_start)
        self._flush_kv_events()
        if self.tracer is not None:
            self.tracer.record(sched, started, time.perf_counter(), self)
        if self.device.type == "cpu" and not self.has_unfinished():
            # Idle: the steps' freed activations go back to the OS (~1.6 ms; glibc keeps
            # them otherwise, ~8 MB after a wave on SmolLM2)
            release_freed_memory()
        return StepResult(outputs, ran=True)

    def _propose(self, reqs: list[Request]) -> None:
        assert self.proposer is not None  # step() proposes only with a proposer
        self.proposer.draft_for_step(reqs, len(self.scheduler.running))

    def _flush_kv_events(self) -> None:
        if self.kv_event_sink is not None:
            events = self.block_manager.take_events()
            if events:
                self.kv_event_sink(events)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (KV events: ``AllBlocksCleared``); False while any
        request holds blocks (nothing is then changed), as vLLM's reset."""
        done = self.block_manager.reset_prefix_cache()
        self._flush_kv_events()
        return done

    # -- offline use --------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[Prompt],
        params: Union[None, SamplingParams, list[SamplingParams]] = None,
        apply_chat_template: bool = False,
    ) -> list[RequestOutput]:
        """Run prompts to completion; one aggregated ``RequestOutput`` per prompt, in order
        (``generate_sequences`` returns all ``n`` of each)."""
        results = self.generate_sequences(prompts, params, apply_chat_template)
        if any(len(seqs) > 1 for seqs in results):
            raise ValueError("a request asks for n > 1 sequences: use generate_sequences")
        return [seqs[0] for seqs in results]

    def generate_sequences(
        self,
        prompts: list[Prompt],
        params: Union[None, SamplingParams, list[SamplingParams]] = None,
        apply_chat_template: bool = False,
    ) -> list[list[RequestOutput]]:
        """Run prompts to completion; per prompt, its ``n`` aggregated outputs by index."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [
            self.add_request(p, sp, apply_chat_template=apply_chat_template)
            for p, sp in zip(prompts, params_list)
        ]
        merged: dict[str, dict[int, RequestOutput]] = {r.request_id: {} for r in reqs}
        while self.has_unfinished():
            for out in self.step():
                total = merged[out.request_id].setdefault(out.index, RequestOutput(out.request_id))
                merge_output(total, out)
        return [
            [seqs[i] for i in sorted(seqs)] or [RequestOutput(r.request_id)]
            for r, seqs in ((r, merged[r.request_id]) for r in reqs)
        ]

    def get_stats(self) -> StatsSnapshot:
        s = self.scheduler
        snapshot = dataclasses.replace(
            self.stats.snapshot(self.block_manager),
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            preemptions_total=s.num_preemptions,
        )
        if self.lora is None:
            return snapshot
        return dataclasses.replace(
            snapshot,
            max_loras=self.config.max_loras,
            running_lora_adapters=tuple(sorted(adapters_of(s.running))),
            waiting_lora_adapters=tuple(sorted(adapters_of(s.waiting))),
        )
