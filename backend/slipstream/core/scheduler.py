"""Iteration-level scheduler: one token budget per step, no separate prefill/decode phases.

Each step, running requests get their next tokens first (a decode is one token; a partly
prefilled prompt continues with its next chunk), then waiting requests are admitted with
prefill chunks that fill what is left of ``max_num_batched_tokens``. When KV blocks run
out, the request the policy ranks last is preempted (recompute or swap).
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from slipstream.core.block_manager import BlockManager
from slipstream.core.config import EngineConfig
from slipstream.core.policies import make_policy, pick_first, pick_victim
from slipstream.core.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # Draft tokens appended for this step (speculative decoding); they are the last
    # ``len(spec_token_ids)`` of the new tokens.
    spec_token_ids: list = field(default_factory=list)
    # The request's progress when it was scheduled (the step trace tells prefill from
    # decode with them; the engine has moved both on by the time the trace is taken).
    num_computed_before: int = field(init=False, default=0)
    num_tokens_before: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.num_computed_before = self.request.num_computed_tokens
        self.num_tokens_before = self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list = field(default_factory=list)  # ScheduledRequest, in batch order
    num_padding_seqs: int = 0  # static batching: dummy rows that cost real compute
    padded_prompt_len: int = 0  # static batching: prompts padded to this length
    preempted: list = field(default_factory=list)
    swapped_in: list = field(default_factory=list)
    swapped_out: list = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, swapper=None) -> None:
        self.config = config
        self.bm = block_manager
        self.key = make_policy(config.policy, config.aging_seconds)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapper = swapper  # optional CPU swap pool (preemption by swap)
        self.num_preemptions = 0
        # static/dynamic batching: the batch in flight and its original size
        self.batch: list[Request] = []

    # -- queue management ------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request (any state) and free its KV blocks at once."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.swapper is not None:
            self.swapper.discard(req)
        self.bm.free_request(req)

    # -- scheduling ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.config.batching != "continuous":
            return self._schedule_batch_mode()
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        now = time.monotonic()
        budget = self._schedule_running(out, budget, now)
        if not out.preempted:
            self._schedule_waiting(out, budget, now)
        return out

    def _tokens_wanted(self, req: Request) -> int:
        wanted = req.num_tokens + len(req.spec_token_ids) - req.num_computed_tokens
        return min(wanted, self.config.max_model_len - req.num_computed_tokens)

    def _schedule_running(self, out: SchedulerOutput, budget: int, now: float) -> int:
        # Serve running requests in policy order so the lowest-ranked ones are the
        # ones left without budget or preempted.
        for req in sorted(self.running, key=lambda r: self.key(r, now)):
            if budget <= 0 or req.status is not RequestStatus.RUNNING:
                continue
            num_new = min(self._tokens_wanted(req), budget)
            if num_new <= 0:
                continue
            spec = self._spec_slice(req, num_new)
            if not spec:  # no drafts (or none fit): only the request's real tokens
                num_new = min(num_new, req.num_tokens - req.num_computed_tokens)
            if not self._make_room(req, num_new, out, now):
                continue  # req itself was preempted
            self.bm.allocate(req, num_new)
            out.scheduled.append(ScheduledRequest(req, num_new, spec))
            budget -= num_new
        return budget

    def _spec_slice(self, req: Request, num_new: int) -> list:
        # Drafts are the last tokens of the step: keep those that fit after the request's
        # real tokens (budget or max_model_len may cut some), drop the rest.
        if not req.spec_token_ids:
            return []
        room = req.num_computed_tokens + num_new - req.num_tokens
        req.spec_token_ids = req.spec_token_ids[:max(room, 0)]
        return list(req.spec_token_ids)

    def _make_room(self, req: Request, num_new: int, out: SchedulerOutput, now: float) -> bool:
        while not self.bm.can_allocate(req, num_new):
            candidates = [r for r in self.running if r.status is RequestStatus.RUNNING
                          and not any(s.request is r for s in out.scheduled)]
            victim = pick_victim(candidates, self.key, now)
            if victim is None:
                victim = req
            self.preempt(victim, out)
            if victim is req:
                return False
        return True

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        while budget > 0 and self.waiting and len(self.running) < self.config.max_num_seqs:
            req = pick_first(self.waiting, self.key, now)
            if req in out.preempted:
                break  # preempted this very step: taking it back now would only thrash
            if req.status is RequestStatus.SWAPPED:
                if not self._swap_in(req, out):
                    break
                budget = self._schedule_resumed(req, out, budget)
                continue
            cached = self._lookup_prefix(req)
            num_cached_tokens = len(cached) * self.bm.block_size
            num_new = self._tokens_wanted_from(req, num_cached_tokens)
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            req.num_computed_tokens = num_cached_tokens
            if not self.bm.can_allocate(req, num_new, cached):
                if not self._preempt_for(req, num_new, cached, out, now):
                    req.num_computed_tokens = 0
                    break
            self._admit(req, num_new, cached, num_cached_tokens, out)
            # Recounted rather than decremented: an eviction above gives its tokens back.
            budget = self.config.max_num_batched_tokens - out.num_tokens

    def _tokens_wanted_from(self, req: Request, num_computed: int) -> int:
        wanted = req.num_tokens - num_computed
        return min(wanted, self.config.max_model_len - num_computed)

    def _lookup_prefix(self, req: Request) -> list:
        return self.bm.find_cached_prefix(req)

    def _admit(self, req: Request, num_new: int, cached: list, num_cached_tokens: int,
               out: SchedulerOutput) -> None:
        if req.num_preemptions == 0:
            self.bm.record_lookup(req.num_prompt_tokens, num_cached_tokens)
            req.num_cached_tokens = num_cached_tokens
        self.bm.allocate(req, num_new, cached)
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.scheduled.append(ScheduledRequest(req, num_new))

    def _preempt_for(self, req: Request, num_new: int, cached: list, out: SchedulerOutput,
                     now: float) -> bool:
        """Priority policies: a more urgent arrival may evict less urgent running requests,
        including ones already scheduled in this step (they are taken out of it)."""
        if self.config.policy == "fifo":
            return False
        candidates = self._less_urgent_running(req, now)
        held = Counter(b for r in candidates for b in r.block_table)
        freeable = sum(1 for b, n in held.items() if self.bm.blocks[b].ref_count == n)
        need = self.bm.blocks_needed(req.num_computed_tokens + num_new) - len(cached)
        if need > self.bm.num_free_blocks + freeable:
            return False  # evicting every candidate would not make room: evict none
        while True:
            candidates = self._less_urgent_running(req, now)
            victim = pick_victim(candidates, self.key, now)
            if victim is None:
                return False
            self.preempt(victim, out)
            if self.bm.can_allocate(req, num_new, cached):
                return True

    def _less_urgent_running(self, req: Request, now: float) -> list:
        return [r for r in self.running if self.key(r, now) > self.key(req, now)]

    def preempt(self, req: Request, out: Optional[SchedulerOutput] = None) -> None:
        """Take ``req`` off the GPU: swap its KV out, or drop it to recompute later."""
        self.running.remove(req)
        if out is not None:  # scheduled earlier in this step: it no longer runs in it
            out.scheduled[:] = [s for s in out.scheduled if s.request is not req]
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.spec_token_ids = []
        if self.swapper is not None and self.swapper.should_swap(req):
            self.swapper.swap_out(req)
            req.status = RequestStatus.SWAPPED
            if out is not None:
                out.swapped_out.append(req)
        else:
            self.bm.free_request(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
        self.waiting.append(req)
        if out is not None:
            out.preempted.append(req)

    def _swap_in(self, req: Request, out: SchedulerOutput) -> bool:
        if not self.swapper.can_swap_in(req):
            return False
        self.swapper.swap_in(req)
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.swapped_in.append(req)
        return True

    def _schedule_resumed(self, req: Request, out: SchedulerOutput, budget: int) -> int:
        """A request just swapped in continues in the same step (its next token was
        reserved by ``can_swap_in``) instead of idling until the next one."""
        num_new = min(self._tokens_wanted(req), budget)
        if num_new <= 0 or not self.bm.can_allocate(req, num_new):
            return budget
        self.bm.allocate(req, num_new)
        out.scheduled.append(ScheduledRequest(req, num_new))
        return budget - num_new

    # -- static / dynamic batching baselines ------------------------------------------
    def _schedule_batch_mode(self) -> SchedulerOutput:
        """Request-level batching: a batch is formed only when the previous one has fully
        drained, then runs in lockstep, prompts padded to the longest, finished rows kept
        as padding until its longest request ends."""
        out = SchedulerOutput()
        if all(r.is_finished for r in self.batch):
            self.batch = []
            if not self._form_batch():
                return out
        live = [r for r in self.batch if not r.is_finished]
        for req in live:
            num_new = self._tokens_wanted(req)
            if not self.bm.can_allocate(req, num_new):
                raise RuntimeError(
                    "KV cache too small for the static batch: lower max_batch_size or raise the KV budget")
            self.bm.allocate(req, num_new)
            out.scheduled.append(ScheduledRequest(req, num_new))
        out.num_padding_seqs = len(self.batch) - len(live)
        if self.config.batching == "static":
            out.num_padding_seqs += self.config.max_batch_size - len(self.batch)
        prefill = [s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1]
        out.padded_prompt_len = max(prefill, default=0)
        return out

    def _form_batch(self) -> bool:
        if not self.waiting:
            return False
        if self.config.batching == "dynamic":
            oldest = min(r.arrival_time for r in self.waiting)
            waited_ms = (time.monotonic() - oldest) * 1000
            if len(self.waiting) < self.config.max_batch_size and waited_ms < self.config.max_queue_delay_ms:
                return False
        now = time.monotonic()
        ordered = sorted(self.waiting, key=lambda r: self.key(r, now))
        for req in ordered[:self.config.max_batch_size]:
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self.batch.append(req)
        return True

    def batch_mode_waiting_deadline(self) -> Optional[float]:
        """Dynamic batching: when the pending batch will be released by its delay window."""
        if self.config.batching != "dynamic" or self.batch or not self.waiting:
            return None
        oldest = min(r.arrival_time for r in self.waiting)
        return oldest + self.config.max_queue_delay_ms / 1000
