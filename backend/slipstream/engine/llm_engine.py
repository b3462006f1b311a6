"""The synchronous engine: add requests, abort them, and advance everything one step at a time."""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
import time
import traceback
from typing import Callable, Optional, Union

import torch

from slipstream.core.batch_scheduler import BatchScheduler
from slipstream.core.block_hash import make_hasher
from slipstream.core.block_manager import BlockManager
from slipstream.core.config import EngineConfig
from slipstream.core.kv_cache_events import KVCacheEvent
from slipstream.core.lora_errors import lora_name_error
from slipstream.core.lora_limit import adapters_of
from slipstream.core.request import (BeamSnapshot, FinishReason, Request, RequestOutput,
                                     RequestStatus, TokenLogprob, merge_output)
from slipstream.core.sampling_params import SamplingParams
from slipstream.core.scheduler import Scheduler, SchedulerBase
from slipstream.core.scheduler_output import RequestUpdate, SampledTokens, SchedulerOutput
from slipstream.core.sequence_group import SequenceGroup
from slipstream.core.stats import EngineStats, StatsSnapshot
from slipstream.core.swap_space import SwapSpace
from slipstream.engine.detokenizer import IncrementalDetokenizer
from slipstream.worker import model_loader
from slipstream.worker.kv_cache import KVCache, KVGeometry, kv_budget_bytes, num_blocks_for_budget
from slipstream.worker.cpu_reduced_linear import prepare_cpu_model
from slipstream.worker.lora_layers import LoraLayers, load_lora_layers
from slipstream.worker.model_runner import ModelRunner
from slipstream.worker.sampler import (PerRequestError, Sampler, prepare as prepare_sampling,
                                       prompt_logprobs as score_prompt)
from slipstream.worker.structured_output import GrammarCompiler
from slipstream.worker.swap import SwapPool, num_cpu_blocks

log = logging.getLogger("slipstream")
Prompt = Union[str, list]


OVERLOADED = "server overloaded"  # every queue-full message starts so (frontends match it)
RETRY_AFTER_S = 1  # what a refused client is told to wait before it tries again


class OverloadedError(RuntimeError):
    """The waiting queue is full: the request is refused instead of queued."""

    @classmethod
    def queue_full(cls, limit: int) -> "OverloadedError":
        return cls(f"{OVERLOADED}: {limit} requests already waiting (max_queue_size); "
                   f"retry after {RETRY_AFTER_S} s")


class LLMEngine:
    def __init__(self, config: EngineConfig, model=None, tokenizer=None,
                 kv_event_sink: Optional[Callable[[list[KVCacheEvent]], None]] = None) -> None:
        """``kv_event_sink`` receives the prefix cache's events after each step that made
        any, on the engine thread: it must return at once (a queue, not I/O)."""
        self.config = config
        self.device = model_loader.resolve_device(config.device)
        self.dtype = model_loader.resolve_compute_dtype(config, self.device)
        self.weight_format = model_loader.resolve_weight_format(config, self.device)
        self.kv_dtype = model_loader.resolve_kv_cache_dtype(config, self.dtype)
        path = None if model is not None else model_loader.resolve_model_path(config.model)
        self.model = model if model is not None else model_loader.load_model(path, self.dtype, self.device)
        self.tokenizer = tokenizer if tokenizer is not None else model_loader.load_tokenizer(path, config.tokenizer)
        self.config = config = model_loader.fit_max_model_len(config, self.model.config)
        if self.device.type == "cpu":
            self._prepare_cpu_layers()
        self.lora: Optional[LoraLayers] = None
        if config.enable_lora:  # after packing: adapters wrap the packed linears
            self.lora = load_lora_layers(config.lora_modules, self.model, config.max_lora_rank,
                                         self.dtype, self.device)
        self.eos_token_id = self._eos_token_id()
        self.grammars = GrammarCompiler(self.tokenizer, self.logits_vocab_size, self.eos_token_id)
        self.kv_cache = self._allocate_kv_cache()
        self.block_manager = BlockManager(
            self.kv_cache.num_blocks, config.block_size, config.enable_prefix_caching,
            hasher=make_hasher(config.prefix_caching_hash_algo),
            lora_paths=config.lora_modules if config.enable_lora else None,
            emit_events=kv_event_sink is not None)
        self.kv_event_sink = kv_event_sink
        self._flush_kv_events()  # a fresh cache: AllBlocksCleared
        self.swap_pool: Optional[SwapPool] = None
        self.scheduler = self._make_scheduler()
        self._warn_short_capacity()
        self.runner = ModelRunner(
            self.model, self.kv_cache, self.device, config.max_model_len, config.max_num_seqs,
            config.cuda_graph_batch_sizes if config.enable_cuda_graphs else None,
            config.attention_ops, config.fast_forward, self.lora)
        self.sampler = Sampler(config.seed)
        self.proposer = self._make_proposer()
        self.requests: dict[str, Request] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.stats = EngineStats()
        self.tracer = self._make_tracer()
        self._ids = itertools.count()
        self._tokenizer_lock = threading.Lock()  # requests are tokenized on client threads

    # -- construction helpers ------------------------------------------------------------
    def _eos_token_id(self) -> Optional[int]:
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return eos[0] if isinstance(eos, (list, tuple)) else eos

    def _prepare_cpu_layers(self) -> None:
        prepare_cpu_model(self.model, self.weight_format, self.config.cpu_linear)

    def _allocate_kv_cache(self) -> KVCache:
        geometry = KVGeometry.from_model_config(self.model.config, self.config.block_size,
                                                self.kv_dtype)
        if self.config.num_gpu_blocks_override is not None:
            num_blocks = self.config.num_gpu_blocks_override + 1  # + the scratch block
        else:
            budget = kv_budget_bytes(self.config.kv_cache_memory_bytes,
                                     self.config.gpu_memory_utilization, self.device)
            num_blocks = num_blocks_for_budget(geometry, budget)
        if num_blocks < 2:
            raise ValueError(
                f"KV budget holds {num_blocks} blocks of {geometry.bytes_per_block} bytes; raise "
                "kv_cache_memory_bytes")
        log.info("KV cache: %d blocks x %d tokens, %.1f MiB (%d bytes/token)", num_blocks,
                 geometry.block_size, num_blocks * geometry.bytes_per_block / 2**20,
                 geometry.bytes_per_token)
        return KVCache(geometry, num_blocks, self.device)

    def _warn_short_capacity(self) -> None:
        if self.scheduler.max_seq_len < self.config.max_model_len:
            log.warning("the KV cache holds %d tokens, less than max_model_len %d: sequences "
                        "end at %d tokens", self.scheduler.max_seq_len, self.config.max_model_len,
                        self.scheduler.max_seq_len)

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

    def _make_tracer(self):
        if not (self.config.trace_steps or self.config.trace_file):
            return None
        from slipstream.trace import StepTracer
        return StepTracer()

    def _make_proposer(self):
        if self.config.speculative_method is None:
            return None
        from slipstream.engine.spec_decode import make_proposer
        return make_proposer(self.config, self)

    # -- requests ----------------------------------------------------------------------------
    def make_request(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                     request_id: Optional[str] = None, priority: int = 0,
                     apply_chat_template: bool = False,
                     add_special_tokens: bool = True) -> Request:
        """Tokenize and validate; raises ``ValueError`` with a message fit for the client.
        ``add_special_tokens=False``: a text prompt is tokenized without the tokenizer's BOS
        and the like (a chat template rendered by the caller already holds them)."""
        params = params or SamplingParams()
        params.check_vocab(self.logits_vocab_size)
        self.check_lora(params.lora_name)
        self.check_prompt_size(prompt)
        ids = self.tokenize(prompt, apply_chat_template, add_special_tokens)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model.get_input_embeddings().num_embeddings
        ids = truncate_prompt(ids, params.truncate_prompt_tokens, self.config.max_model_len)
        with self._tokenizer_lock:
            prepare_sampling(params, self.tokenizer, vocab)
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"the prompt has {len(ids)} tokens, but max_model_len is {limit} "
                             "(prompt plus at least one generated token must fit)")
        if self.block_manager.blocks_needed(len(ids) + 1) > self.block_manager.num_usable_blocks:
            raise ValueError(f"the prompt has {len(ids)} tokens and can never fit in the KV cache "
                             f"({self.block_manager.num_usable_blocks} blocks of {self.config.block_size})")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        self._check_parallel_sampling(params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = Request(rid, ids, params, self.eos_token_id, priority)
        if params.structured_outputs is not None:  # compiled here, off the step path
            req.grammar = self.grammars.state_for(params.structured_outputs)
        return req

    def check_lora(self, name: Optional[str]) -> None:
        """vLLM's (vllm_backend's) refusals of an adapter this engine does not serve."""
        error = lora_name_error(name, None if self.lora is None else self.lora.names)
        if error is not None:
            raise ValueError(error)

    def _check_parallel_sampling(self, params: SamplingParams) -> None:
        k = params.num_sequences
        if k == 1:
            return
        if self.config.batching != "continuous":
            raise ValueError("n > 1 and best_of > 1 need batching=continuous")
        if k > self.config.max_num_seqs:
            raise ValueError(f"the request asks for {k} sequences (n / best_of), but at most "
                             f"max_num_seqs={self.config.max_num_seqs} run at once")

    @functools.cached_property
    def logits_vocab_size(self) -> int:
        """How many token ids the model scores (what stop and blocked ids index)."""
        head = self.model.get_output_embeddings()
        size = getattr(head, "out_features", None) or getattr(head, "num_embeddings", None)
        return int(size or self.model.config.get_text_config().vocab_size)

    @functools.cached_property
    def max_prompt_bytes(self) -> int:
        """Prompts longer than this many UTF-8 bytes cannot fit in ``max_model_len`` tokens:
        no token covers more bytes than the longest in the vocabulary (measured on its
        stored form, which is never shorter than the text it stands for)."""
        longest = max((len(t.encode("utf-8", "replace")) for t in self.tokenizer.get_vocab()),
                      default=1)
        return self.config.max_model_len * max(longest, 1)

    def check_prompt_size(self, prompt: Prompt) -> None:
        """Refuse a text prompt too large to fit before spending time tokenizing it."""
        if isinstance(prompt, str) and len(prompt) > self.max_prompt_bytes // 4:
            size = len(prompt.encode("utf-8", "surrogatepass"))
            if size > self.max_prompt_bytes:
                raise ValueError(
                    f"the prompt is {size} bytes, more than max_model_len "
                    f"{self.config.max_model_len} tokens can hold (at most {self.max_prompt_bytes} "
                    "bytes for this tokenizer)")

    def tokenize(self, prompt: Prompt, apply_chat_template: bool = False,
                 add_special_tokens: bool = True) -> list[int]:
        """A string (optionally wrapped in the chat template as one user turn), a list of
        chat messages (``{"role", "content"}`` dicts, always templated), or token ids."""
        if isinstance(prompt, (list, tuple)) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)  # token ids: no need to wait while the tokenizer is busy
        with self._tokenizer_lock:
            return self._tokenize(prompt, apply_chat_template, add_special_tokens)

    def _tokenize(self, prompt: Prompt, apply_chat_template: bool,
                  add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            return self._apply_chat_template(list(prompt))
        if isinstance(prompt, str):
            if apply_chat_template:
                return self._apply_chat_template([{"role": "user", "content": prompt}])
            return self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                     for t in prompt):
            return list(prompt)
        raise ValueError("prompt must be a string, a list of chat messages or a list of token ids")

    def _apply_chat_template(self, messages: list) -> list:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; send a plain text prompt")
        for m in messages:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError("chat messages need string 'role' and 'content' fields")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def add(self, req: Request, check_queue: bool = True) -> None:
        """``check_queue=False``: the caller has already admitted the request against
        ``max_queue_size`` (EngineLoop does so at submit time)."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        limit = self.config.max_queue_size
        if check_queue and limit and len(self.scheduler.waiting) >= limit:
            raise OverloadedError.queue_full(limit)
        group = SequenceGroup.create(req)
        sequences = group.sequences if group is not None else [req]
        taken = [s.request_id for s in sequences if s.request_id in self.requests]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use")
        for seq in sequences[1:]:
            if req.grammar is not None:  # each sequence is constrained on its own
                seq.grammar = req.grammar.copy()
        for seq in sequences:  # only the parent is queued: the children fork from it
            self.requests[seq.request_id] = seq
            self.detokenizers[seq.request_id] = IncrementalDetokenizer.for_params(
                self.tokenizer, seq.prompt_token_ids, seq.params)
        self.scheduler.add(req)

    def add_request(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None, priority: int = 0,
                    apply_chat_template: bool = False) -> Request:
        req = self.make_request(prompt, params, request_id, priority, apply_chat_template)
        self.add(req)
        return req

    def abort(self, request_id: str) -> Optional[RequestOutput]:
        """Stop a request now and free its KV blocks; returns its final output."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.group is not None:
            return self._end_group(req.group, RequestStatus.FINISHED_ABORTED, None)
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        return self._report(RequestUpdate(req))[0]

    def fail(self, request_id: str, message: str) -> Optional[RequestOutput]:
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.group is not None:
            return self._end_group(req.group, RequestStatus.FINISHED_ERROR, message)
        self.scheduler.fail(req, message)
        return self._report(RequestUpdate(req))[0]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- the step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule -> execute -> sample -> update -> outputs, for every request that moved."""
        step_start = time.perf_counter()
        sched = self.scheduler.schedule()
        if self.swap_pool is not None:
            self.swap_pool.apply(sched)
        if sched.is_empty:
            if self.tracer is not None and sched.preempted:  # a step that only preempted
                now = time.perf_counter()
                self.tracer.record(sched, now, now, self)
            self._flush_kv_events()
            return []
        started = time.perf_counter()
        sampled = self._execute(sched)
        updates = self.scheduler.update_from_output(sched, sampled, self._stop_string)
        self.kv_cache.copy_blocks(sched.block_copies)  # before any later step reuses a block
        self.stats.record_step(sched, time.perf_counter() - started)
        if self.proposer is not None:
            self._propose([item.request for item in sched.scheduled])
        outputs = [out for u in updates for out in self._report(u)]
        self.scheduler.observe_step(sched, time.perf_counter() - step_start)
        self._flush_kv_events()
        if self.tracer is not None:
            self.tracer.record(sched, started, time.perf_counter(), self)
        return outputs

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

    def _execute(self, sched: SchedulerOutput) -> SampledTokens:
        """Run and sample the step. Fail-soft: if the batch raises, each request is run
        alone (its KV writes are idempotent), so only the requests that fail by themselves
        end with an error."""
        try:
            return self._execute_batch(sched)
        except Exception as exc:
            if len(sched.scheduled) == 1:
                return self._failed_alone(sched, exc)
            log.warning("engine step failed (%s); retrying its %d requests one by one",
                        exc, len(sched.scheduled))
        merged = SampledTokens.empty(0)
        for item in sched.scheduled:
            alone = SchedulerOutput(scheduled=[item])
            try:
                part = self._execute_batch(alone)
            except Exception as exc:
                part = self._failed_alone(alone, exc)
            merged.token_ids += part.token_ids
            merged.logprobs += part.logprobs
            merged.errors.update(part.errors)
            merged.prompt_logprobs.update(part.prompt_logprobs)
        return merged

    def _execute_batch(self, sched: SchedulerOutput) -> SampledTokens:
        if any(item.request.params.prompt_logprobs is not None for item in sched.scheduled):
            logits, sample_rows, prompt_logits = self.runner.execute_with_prompt_logits(sched)
        else:
            logits, sample_rows = self.runner.execute(sched)
            prompt_logits = []
        logits, sample_rows, row_reqs = _fan_out(sched, logits, sample_rows)
        beams = [_in_beam_search(item.request) for item in sched.scheduled]
        if any(beams):  # beam slots are ranked by their group, not sampled
            logits, row_reqs = self._offer_beams(logits, row_reqs)
            sample_rows = [[] if beam else rows for rows, beam in zip(sample_rows, beams)]
        failed: dict[str, str] = {}
        try:
            result = self.sampler(logits, row_reqs) if row_reqs else None
        except PerRequestError as err:  # only these requests' own rows failed: keep the rest
            result, failed = err.result, err.failures
        sampled = SampledTokens.empty(0)
        sampled.errors.update(failed)
        cursor = 0
        for rows in sample_rows:
            sampled.token_ids.append(result.token_ids[cursor:cursor + len(rows)] if rows else [])
            sampled.logprobs.append(result.logprobs[cursor:cursor + len(rows)] if rows else [])
            cursor += len(rows)
        for item, rows in zip(sched.scheduled, prompt_logits):
            if rows is not None:
                req = item.request
                sampled.prompt_logprobs[req.request_id] = score_prompt(
                    rows, req.prompt_token_ids, len(req.prompt_logprobs) + 1,
                    req.params.prompt_logprobs)
        return sampled

    @staticmethod
    def _offer_beams(logits: torch.Tensor, row_reqs: list[Request]) -> tuple:
        """Each beam slot's row offers its group the best continuations (log-probabilities
        of the raw distribution; stop tokens masked before ``min_tokens``), all beam rows of
        the step in one log-softmax and top-k. Returns the other rows, to be sampled."""
        picks = [i for i, r in enumerate(row_reqs) if _in_beam_search(r)]
        rest = [i for i, r in enumerate(row_reqs) if not _in_beam_search(r)]
        if not picks:  # the beam slots of this step are prefill chunks short of their end
            return logits, row_reqs
        index = torch.tensor(picks, dtype=torch.long, device=logits.device)
        logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
        for row, i in enumerate(picks):
            req = row_reqs[i]
            if req.num_output_tokens < req.params.min_tokens and req.group.beam.stop_ids:
                logprobs[row, sorted(req.group.beam.stop_ids)] = float("-inf")
        width = max(row_reqs[i].group.beam.num_candidates for i in picks)
        values, ids = logprobs.topk(min(width, logprobs.shape[-1]), dim=-1)
        values, ids = values.tolist(), ids.tolist()
        for row, i in enumerate(picks):
            req = row_reqs[i]
            k = req.group.beam.num_candidates
            req.group.beam.offer(req.index, values[row][:k], ids[row][:k])
        if not rest:
            return logits[:0], []
        keep = torch.tensor(rest, dtype=torch.long, device=logits.device)
        return logits.index_select(0, keep), [row_reqs[i] for i in rest]

    @staticmethod
    def _failed_alone(sched: SchedulerOutput, exc: Exception) -> SampledTokens:
        log.error("request %s failed in the engine step:\n%s", sched.scheduled[0].request.request_id,
                  traceback.format_exc())
        failed = SampledTokens.empty(1)
        failed.errors[sched.scheduled[0].request.request_id] = f"internal error: {exc}"
        return failed

    def _stop_string(self, req: Request) -> Optional[str]:
        detok = self.detokenizers[req.request_id]
        detok.update(req.all_token_ids)
        return detok.stopped_on

    def _propose(self, reqs: list[Request]) -> None:
        """Draft tokens for every request that just sampled and may speculate, in one batch."""
        cap = self._draft_cap(len(self.scheduler.running))
        if cap == 0:
            return
        eligible = [r for r in reqs if r.status is RequestStatus.RUNNING and self._speculates(r)
                    and r.num_tokens - r.num_computed_tokens == 1]
        if cap is not None:
            # A seeded sampled request draws one number per row, so its text would depend on
            # how many requests it shared steps with: it drafts only while that is fixed.
            eligible = [r for r in eligible if r.params.seed is None or r.params.greedy]
        if eligible:
            for req, drafts in zip(eligible, self.proposer.propose_batch(eligible, cap)):
                req.spec_token_ids = list(drafts)

    def _draft_cap(self, running: int) -> Optional[int]:
        """Drafts each request may add to the next step (None: no cap): none past
        ``speculative_disable_by_batch_size`` requests, and within
        ``speculative_row_budget`` rows, one per request plus its drafts (a step of a few
        rows is bound by reading the weights, so its extra rows cost little)."""
        c = self.config
        if c.speculative_disable_by_batch_size and running > c.speculative_disable_by_batch_size:
            return 0
        if c.speculative_row_budget:
            return max(c.speculative_row_budget - running, 0) // max(running, 1)
        return None

    @staticmethod
    def _speculates(req: Request) -> bool:
        # Penalties and min_tokens are applied once per step from the tokens before it,
        # not per draft row, so such requests would not match plain decoding; a grammar's
        # mask is computed for the next token only, so constrained requests never draft.
        # min_tokens blocks nothing when EOS is ignored and there are no stop tokens.
        p = req.params
        min_tokens_inert = p.ignore_eos and not p.stop_token_ids
        return (req.grammar is None and req.group is None and p.use_speculation
                and p.repetition_penalty == 1.0 and not p.presence_penalty
                and not p.frequency_penalty
                and (req.num_output_tokens >= p.min_tokens or min_tokens_inert))

    def _report(self, update: RequestUpdate) -> list[RequestOutput]:
        """The client's view of one update: its outputs (none while best_of holds them back)."""
        req = update.request
        if req.group is None:
            return [self._sequence_output(update)]
        group = req.group
        if group.closed:  # ended as a whole earlier in this step (abort, failure)
            return []
        if group.beam is not None:
            return self._beam_report(update)
        out = self._sequence_output(update)
        if out.finish_reason is FinishReason.ERROR:  # one sequence failed: the request fails
            final = self._end_group(group, RequestStatus.FINISHED_ERROR, out.error)
            return [final] if final is not None else []
        return group.collect(out)

    def _sequence_output(self, update: RequestUpdate) -> RequestOutput:
        """One sequence's text delta; the sequence is retired if it ended."""
        req = update.request
        self.stats.generation_tokens += len(update.new_token_ids)
        if update.num_drafted:
            self.stats.record_speculation(update.num_drafted, update.num_accepted)
            req.num_draft_tokens += update.num_drafted
            req.num_accepted_draft_tokens += update.num_accepted
        detok = self.detokenizers[req.request_id]
        if update.new_token_ids:
            req.last_token_time = time.monotonic()
            if req.first_token_time is None:
                req.first_token_time = req.last_token_time
        if not req.is_finished:
            detok.update(req.all_token_ids)
            if detok.error is None:
                return self._output(req, detok.take(final=False), update)
            self.scheduler.fail(req, detok.error)  # its text cannot be produced: it alone ends
        self._retire(req)
        aborted = req.status is RequestStatus.FINISHED_ABORTED
        if not aborted:
            # As in vLLM, the EOS / stop token's own text is not part of the output.
            stop_token = (req.status is RequestStatus.FINISHED_STOPPED and update.stop_string is None
                          and not req.params.include_stop_str_in_output)
            detok.update(req.all_token_ids[:-1] if stop_token else req.all_token_ids)
        return self._output(req, "" if aborted else detok.take(final=True), update)

    def _beam_report(self, update: RequestUpdate) -> list[RequestOutput]:
        """Beam search answers once, when the search ends: the ``n`` best finished beams,
        best first (index = rank). Until then beams change their past, so nothing is final."""
        req, group = update.request, update.request.group
        if req.status is RequestStatus.FINISHED_ERROR:
            final = self._end_group(group, RequestStatus.FINISHED_ERROR, req.error)
            return [final] if final is not None else []
        self.stats.generation_tokens += len(update.new_token_ids)
        if update.new_token_ids:
            req.last_token_time = time.monotonic()
            if req.first_token_time is None:
                req.first_token_time = req.last_token_time
        if not group.beam.finished:
            # one snapshot per round: every slot moved in it, slot 0's update is one of them
            return [self._beam_snapshot(group)] if req.index == 0 and update.new_token_ids \
                else []
        parent = group.parent
        for name in ("first_token_time", "last_token_time"):  # the request's, over its beams
            moments = [getattr(s, name) for s in group.sequences if getattr(s, name)]
            setattr(parent, name, (min if name.startswith("first") else max)(moments)
                    if moments else None)
        for seq in group.sequences:
            if seq.request_id in self.requests:
                self._retire(seq)
        group.closed = True
        outputs = [self._hypothesis_output(group, rank, h)
                   for rank, h in enumerate(group.beam.hypotheses[:group.n])]
        if not outputs:  # no beam could finish (a vocabulary of stop tokens only)
            return [group.close(FinishReason.LENGTH, None)]
        outputs[-1].finished = True
        return outputs

    @staticmethod
    def _beam_snapshot(group: SequenceGroup) -> RequestOutput:
        beam = group.beam
        order = sorted(range(beam.width), key=lambda s: -beam.scores[s])
        return RequestOutput(
            request_id=group.request_id, num_prompt_tokens=group.parent.num_prompt_tokens,
            beams=[BeamSnapshot(group.sequences[s].output_token_ids, list(beam.logprobs[s]),
                                beam.scores[s]) for s in order])

    def _hypothesis_output(self, group: SequenceGroup, rank: int, hyp) -> RequestOutput:
        parent, params = group.parent, group.parent.params
        shown = hyp.token_ids
        if hyp.finish_reason is FinishReason.STOP and not params.include_stop_str_in_output:
            shown = shown[:-1]  # as for any request, the stop token's text is not output
        text = ""
        if params.detokenize:
            with self._tokenizer_lock:
                text = self.tokenizer.decode(shown, skip_special_tokens=params.skip_special_tokens)
        return RequestOutput(
            request_id=group.request_id, text=text, token_ids=list(hyp.token_ids),
            logprobs=[TokenLogprob(x) for x in hyp.logprobs], finished=False,
            finish_reason=hyp.finish_reason, num_prompt_tokens=parent.num_prompt_tokens,
            num_output_tokens=len(hyp.token_ids), num_cached_tokens=parent.num_cached_tokens,
            cumulative_logprob=hyp.cumulative_logprob, timing=parent.timing(), index=rank,
            metrics=parent.metrics(self.config.block_size))

    def _retire(self, req: Request) -> None:
        """Forget a finished request everywhere outside the scheduler."""
        self.sampler.forget(req.request_id)
        if self.proposer is not None:
            self.proposer.discard(req.request_id)
        self.requests.pop(req.request_id, None)
        self.detokenizers.pop(req.request_id, None)
        if req.index == 0:  # one client request, whatever its n
            self.stats.num_finished += 1

    def _end_group(self, group: SequenceGroup, status: RequestStatus,
                   error: Optional[str]) -> Optional[RequestOutput]:
        """End every sequence of a request at once (abort, or one sequence failed): one final
        output for the client. None if the request had already ended."""
        if group.closed:
            return None
        for seq in group.sequences:
            if not seq.is_finished:
                seq.error = error
                self.scheduler.finish(seq, status)
            if seq.request_id in self.requests:
                self._retire(seq)
        return group.close(status.finish_reason, error)

    def _output(self, req: Request, text: str, update: RequestUpdate) -> RequestOutput:
        prompt_lps = None
        if req.params.prompt_logprobs is not None and update.new_token_ids \
                and req.num_output_tokens == len(update.new_token_ids):  # its first output
            prompt_lps = prompt_logprobs_output(req)
        return RequestOutput(
            request_id=req.request_id, text=text, token_ids=list(update.new_token_ids),
            logprobs=list(update.new_logprobs), finished=req.is_finished,
            finish_reason=req.status.finish_reason, num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens, num_cached_tokens=req.num_cached_tokens,
            cumulative_logprob=req.cumulative_logprob, error=req.error,
            timing=req.timing() if req.is_finished else None, index=req.index,
            prompt_logprobs=prompt_lps,
            metrics=req.metrics(self.config.block_size) if req.is_finished else None)

    # -- offline use --------------------------------------------------------------------------
    def generate(self, prompts: list[Prompt],
                 params: Union[None, SamplingParams, list[SamplingParams]] = None,
                 apply_chat_template: bool = False) -> list[RequestOutput]:
        """Run prompts to completion; one aggregated ``RequestOutput`` per prompt, in order
        (``generate_sequences`` returns all ``n`` of each)."""
        results = self.generate_sequences(prompts, params, apply_chat_template)
        if any(len(seqs) > 1 for seqs in results):
            raise ValueError("a request asks for n > 1 sequences: use generate_sequences")
        return [seqs[0] for seqs in results]

    def generate_sequences(self, prompts: list[Prompt],
                           params: Union[None, SamplingParams, list[SamplingParams]] = None,
                           apply_chat_template: bool = False) -> list[list[RequestOutput]]:
        """Run prompts to completion; per prompt, its ``n`` aggregated outputs by index."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add_request(p, sp, apply_chat_template=apply_chat_template)
                for p, sp in zip(prompts, params_list)]
        merged: dict[str, dict[int, RequestOutput]] = {r.request_id: {} for r in reqs}
        while self.has_unfinished():
            for out in self.step():
                total = merged[out.request_id].setdefault(out.index, RequestOutput(out.request_id))
                merge_output(total, out)
        return [[seqs[i] for i in sorted(seqs)] or [RequestOutput(r.request_id)]
                for r, seqs in ((r, merged[r.request_id]) for r in reqs)]

    def get_stats(self) -> StatsSnapshot:
        s = self.scheduler
        snapshot = self.stats.snapshot(len(s.running), len(s.waiting), s.num_preemptions,
                                       self.block_manager)
        if self.lora is None:
            return snapshot
        return dataclasses.replace(
            snapshot, max_loras=self.config.max_loras,
            running_lora_adapters=tuple(sorted(adapters_of(s.running))),
            waiting_lora_adapters=tuple(sorted(adapters_of(s.waiting))))


def prompt_logprobs_output(req: Request) -> list:
    """vLLM's shape: None for the first prompt token, then per token a dict token id ->
    TokenLogprob (with its rank), the prompt token first, then its top-N alternatives."""
    entries: list = [None]
    for token, lp in zip(req.prompt_token_ids[1:], req.prompt_logprobs):
        position = {token: lp}
        for rank, (alt, value) in enumerate(lp.top, start=1):
            position.setdefault(alt, TokenLogprob(value, rank))
        entries.append(position)
    return entries


def _fan_out(sched: SchedulerOutput, logits: torch.Tensor, sample_rows: list[list[int]]) -> tuple:
    """Parallel sampling: the step that completes a group's prompt samples the prompt's last
    row once per sequence (the parent's row first, then its children's). Returns the logits
    to sample, the rows per scheduled request and the request owning each row."""
    forking = [item.forks if rows else [] for item, rows in zip(sched.scheduled, sample_rows)]
    if not any(forking):  # every step but a fork: no copy of the logits
        return logits, sample_rows, [item.request for item, rows in zip(sched.scheduled, sample_rows)
                                     for _ in rows]
    picks: list[int] = []
    rows_out: list[list[int]] = []
    row_reqs: list[Request] = []
    cursor = 0  # the first logits row of this request
    for item, rows, forks in zip(sched.scheduled, sample_rows, forking):
        picks += list(range(cursor, cursor + len(rows))) + [cursor + len(rows) - 1] * len(forks)
        row_reqs += [item.request] * len(rows) + forks
        rows_out.append(list(rows) + [rows[-1]] * len(forks) if rows else [])
        cursor += len(rows)
    return logits[torch.tensor(picks, dtype=torch.long, device=logits.device)], rows_out, row_reqs


def _in_beam_search(req: Request) -> bool:
    return req.group is not None and req.group.beam is not None


def truncate_prompt(ids: list, keep: Optional[int], max_model_len: int) -> list:
    """vLLM's ``truncate_prompt_tokens``: keep the last ``keep`` tokens (-1: max_model_len)."""
    if keep is None:
        return ids
    keep = max_model_len if keep == -1 else keep
    return ids[-keep:]
