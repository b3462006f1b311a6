"""Iteration-level scheduler: one token budget per step, no separate prefill/decode phases.

Each step, running requests get their next tokens first (a decode is one token; a partly
prefilled prompt continues with its next chunk), then waiting requests are admitted with
prefill chunks that fill what is left of ``max_num_batched_tokens``. With ``tpot_target_ms``
set, while requests decode the step's budget is what keeps its predicted time within that
target (``core/step_budget.py``, fed by ``observe_step``), never more than
``max_num_batched_tokens``. When KV blocks run out, the request the policy ranks last is
preempted (recompute or swap).

The scheduler owns request progress: ``schedule`` decides what each request computes and
``update_from_output`` applies what the worker sampled (progress, draft rollback, prefix-cache
registration, stop checks, finishing). Nothing else writes ``num_computed_tokens``.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import Counter
from typing import Callable, Optional

from slipstream.core.beam_search import BeamSearch
from slipstream.core.block_manager import BlockManager
from slipstream.core.config import EngineConfig
from slipstream.core.lora_limit import admissible
from slipstream.core.policies import make_policy, pick_first, pick_victim
from slipstream.core.request import FinishReason, Request, RequestStatus
from slipstream.core.scheduler_output import (
    ModelRunnerOutput,
    RequestUpdate,
    ScheduledRequest,
    SchedulerOutput,
)
from slipstream.core.sequence_group import SequenceGroup
from slipstream.core.step_budget import StepBudget
from slipstream.core.swap_space import SwapSpace

# Given a request whose tokens just grew, the stop string its text now contains, if any
# (the engine's detokenizer answers: text is not the scheduler's business).
StopStringCheck = Callable[[Request], Optional[str]]


class SchedulerBase(ABC):
    """Queues, finishing and ``update_from_output``, shared by the continuous scheduler and
    the request-level batching baselines. ``schedule`` is theirs."""

    def __init__(
        self, config: EngineConfig, block_manager: BlockManager, swap: Optional[SwapSpace] = None
    ) -> None:
        self.config = config
        self.bm = block_manager
        self.key = make_policy(config.policy, config.aging_seconds)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swap = swap  # CPU swap space (preemption by swap), or None
        self.num_preemptions = 0
        # A sequence longer than the whole KV cache could only preempt itself over and
        # over; like max_model_len, the cache's size ends it with finish reason "length".
        capacity = block_manager.num_usable_blocks * block_manager.block_size
        self.max_seq_len = min(capacity, self._max_model_len)
        self.max_loras = config.max_loras if config.enable_lora else None

    @property
    def _max_model_len(self) -> int:
        n = self.config.max_model_len
        assert n is not None, "the engine resolves max_model_len before it makes a scheduler"
        return n

    # -- queue management ------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def next_wakeup(self) -> Optional[float]:
        """When ``schedule`` may next return work although nothing new arrives
        (``time.monotonic()`` seconds), or None: it will not without an arrival."""
        return None

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request (any state) and free its KV blocks at once."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.swap is not None:
            self.swap.discard(req)
        self.bm.free_request(req)

    def fail(self, req: Request, message: Optional[str]) -> None:
        req.error = message
        self.finish(req, RequestStatus.FINISHED_ERROR)

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and token counts; allocate their KV blocks."""

    def observe_step(self, sched: SchedulerOutput, seconds: float) -> None:
        """A step's measured wall time (schedule to outputs), for schedulers that plan by it."""

    # -- applying a step's results -----------------------------------------------------
    def update_from_output(
        self, sched: SchedulerOutput, sampled: ModelRunnerOutput, stop_string: StopStringCheck
    ) -> list[RequestUpdate]:
        """Advance every scheduled request by what the step computed and sampled; finish
        those that stopped. Returns one update per request that sampled or ended. A
        request whose own rows failed, or whose stop check raises, ends alone with an error."""
        updates = []
        for item, tokens, logprobs in zip(sched.scheduled, sampled.token_ids, sampled.logprobs):
            req = item.request
            if req.is_finished:
                continue
            forks = item.forks
            if forks:  # before the parent advances: it may finish and free the shared blocks
                updates += self._fork(
                    sched, item, forks, tokens, logprobs, sampled.errors, stop_string
                )
                tokens, logprobs = tokens[:1], logprobs[:1]
            error = sampled.errors.get(req.request_id)
            if error is None:
                req.prompt_logprobs += sampled.prompt_logprobs.get(req.request_id, [])
                try:
                    update = self._advance(item, tokens, logprobs, stop_string)
                except Exception as exc:  # this request's tokens or text: it alone fails
                    error = f"internal error: {exc}"
            if error is not None:
                self.fail(req, error)
                update = RequestUpdate(req)
            if update is not None:
                updates.append(update)
        return updates + self._beam_rounds(sched)

    # -- beam search -------------------------------------------------------------------
    def _beam_rounds(self, sched: SchedulerOutput) -> list[RequestUpdate]:
        """Beam groups whose every slot has now offered its candidates take their next
        round: slots advance, die and re-seat (core/beam_search.py). A slot that has offered
        waits (it has no token to compute) until its group's round is made."""
        updates = []
        seen: set[int] = set()
        for item in sched.scheduled:
            group = item.request.group
            if group is None or group.beam is None or id(group) in seen:
                continue
            seen.add(id(group))
            if group.beam.ready and not any(s.is_finished for s in group.sequences):
                updates += self._beam_round(sched, group, group.beam)
        return updates

    def _beam_round(
        self, sched: SchedulerOutput, group: SequenceGroup, beam: BeamSearch
    ) -> list[RequestUpdate]:
        """``beam`` is ``group.beam``."""
        slots = group.sequences
        first = slots[0]
        limit = min(first.params.max_tokens, self.max_seq_len - first.num_prompt_tokens)
        moves = beam.step([s.output_token_ids for s in slots], limit)
        if beam.finished:
            best = beam.hypotheses[0].finish_reason if beam.hypotheses else None
            status = (
                RequestStatus.FINISHED_STOPPED
                if best is FinishReason.STOP
                else RequestStatus.FINISHED_LENGTH
            )
            for slot in slots:
                self.finish(slot, status)
            return [RequestUpdate(first)]
        for m in moves:  # re-seat first: a parent's beam is copied before it grows
            if m.slot != m.parent:
                self._reseat(sched, slots[m.slot], slots[m.parent])
        updates = []
        for m in moves:
            req = slots[m.slot]
            req.append_token(m.token_id)
            req.cumulative_logprob = beam.scores[m.slot]
            self.bm.register_full_blocks(req)
            updates.append(RequestUpdate(req, [m.token_id], [m.logprob]))
        return updates

    def _reseat(self, sched: SchedulerOutput, slot: Request, parent: Request) -> None:
        """``slot``'s beam died: it takes over a copy of ``parent``'s beam, sharing its KV
        (full blocks by reference, the partial block copied after this step), or recomputing
        it if the parent's KV is not on the device."""
        if slot.status is RequestStatus.SWAPPED and self.swap is not None:
            self.swap.discard(slot)
        self.bm.free_request(slot)
        for queue in (self.running, self.waiting):
            if slot in queue:
                queue.remove(slot)
        slot.all_token_ids = list(parent.all_token_ids)
        slot.spec_token_ids = []
        if parent.status is RequestStatus.RUNNING and parent.num_computed_tokens:
            copy = self.bm.fork(parent, slot, parent.num_computed_tokens)
            if copy is not None:
                sched.block_copies.append(copy)
            slot.status = RequestStatus.RUNNING
            self.running.append(slot)
        else:
            slot.num_computed_tokens = 0
            slot.status = RequestStatus.WAITING
            self.waiting.append(slot)

    def _advance(
        self,
        item: ScheduledRequest,
        tokens: list[int],
        logprobs: list[float],
        stop_string: StopStringCheck,
    ) -> Optional[RequestUpdate]:
        req = item.request
        req.num_computed_tokens += item.num_new_tokens
        if not tokens:  # a prefill chunk short of the prompt's end
            self.bm.register_full_blocks(req)
            return None
        update = RequestUpdate(req, num_drafted=len(item.spec_token_ids))
        accepted = self._accept_drafts(req, item.spec_token_ids, tokens)
        update.num_accepted = accepted - 1 if item.spec_token_ids else 0
        return self._append(update, tokens[:accepted], logprobs[:accepted], stop_string)

    def _append(
        self,
        update: RequestUpdate,
        tokens: list[int],
        logprobs: list[float],
        stop_string: StopStringCheck,
    ) -> RequestUpdate:
        """Append sampled tokens up to the first that stops the request; finish it then."""
        req = update.request
        status = None
        for token, lp in zip(tokens, logprobs or [0.0] * len(tokens)):
            req.append_token(token)
            req.cumulative_logprob += lp
            update.new_token_ids.append(token)
            update.new_logprobs.append(lp)
            status = self._token_stop(req, token)
            if status is None and req.params.stop:
                update.stop_string = stop_string(req)  # per token: drafts may overshoot it
                if update.stop_string is not None:
                    status = RequestStatus.FINISHED_STOPPED
            if status is not None:
                break
        self.bm.register_full_blocks(req)
        if status is not None:
            self.finish(req, status)
        return update

    def _fork(
        self,
        sched: SchedulerOutput,
        item: ScheduledRequest,
        children: list[Request],
        tokens: list[int],
        logprobs: list[float],
        errors: dict[str, str],
        stop_string: StopStringCheck,
    ) -> list[RequestUpdate]:
        """The parent's prompt is computed: each child takes its KV (full blocks shared, the
        partial block copied after this step), its own first token (row i of the step's rows
        for the parent) and runs from now on. A failed row fails the whole group: it is one
        client request."""
        parent = item.request
        group = parent.group
        assert group is not None, "only a sequence group's parent forks"
        group.forked = True
        failed = next(
            (errors[s.request_id] for s in group.sequences if s.request_id in errors), None
        )
        if failed is not None:
            errors.setdefault(parent.request_id, failed)
        num_prompt = item.num_computed_before + item.num_new_tokens
        updates = []
        for i, child in enumerate(children, start=1):
            if failed is not None:
                self.fail(child, failed)
                updates.append(RequestUpdate(child))
                continue
            copy = self.bm.fork(parent, child, num_prompt)
            if copy is not None:
                sched.block_copies.append(copy)
            child.status = RequestStatus.RUNNING
            child.first_scheduled_time = parent.first_scheduled_time
            self.running.append(child)
            try:
                updates.append(
                    self._append(
                        RequestUpdate(child), tokens[i : i + 1], logprobs[i : i + 1], stop_string
                    )
                )
            except Exception as exc:  # its stop check or text: this sequence alone fails
                self.fail(child, f"internal error: {exc}")
                updates.append(RequestUpdate(child))
        return updates

    def _accept_drafts(self, req: Request, drafts: list[int], tokens: list[int]) -> int:
        """How many sampled tokens to keep: the drafts the target agreed with, plus one.
        Rejected drafts' KV stays in the blocks and is overwritten by later steps."""
        req.spec_token_ids = []
        n = 0
        while n < len(drafts) and tokens[n] == drafts[n]:
            n += 1
        req.num_computed_tokens -= len(drafts) - n
        return n + 1

    def _token_stop(self, req: Request, token: int) -> Optional[RequestStatus]:
        p = req.params
        if req.num_output_tokens >= p.min_tokens:
            if token == req.eos_token_id and not p.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_seq_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _tokens_wanted(self, req: Request) -> int:
        wanted = req.num_tokens + len(req.spec_token_ids) - req.num_computed_tokens
        return min(wanted, self._max_model_len - req.num_computed_tokens)


class Scheduler(SchedulerBase):
    """The continuous (in-flight) scheduler."""

    def __init__(
        self, config: EngineConfig, block_manager: BlockManager, swap: Optional[SwapSpace] = None
    ) -> None:
        super().__init__(config, block_manager, swap)
        self.step_budget = (
            StepBudget(config.tpot_target_ms / 1e3, config.max_num_batched_tokens)
            if config.tpot_target_ms > 0
            else None
        )
        self.last_budget = config.max_num_batched_tokens  # the token budget of the last step

    def observe_step(self, sched: SchedulerOutput, seconds: float) -> None:
        if self.step_budget is not None and sched.scheduled:
            self.step_budget.observe(sched.num_tokens, len(sched.scheduled), seconds)

    def _token_budget(self) -> int:
        """max_num_batched_tokens, or less while requests decode (stall-free batching)."""
        if self.step_budget is None:
            return self.config.max_num_batched_tokens
        decoding = [
            r
            for r in self.running
            if r.status is RequestStatus.RUNNING and r.num_computed_tokens >= r.num_prompt_tokens
        ]
        return self.step_budget.tokens(sum(self._tokens_wanted(r) for r in decoding), len(decoding))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.last_budget = self._token_budget()
        now = time.monotonic()
        budget = self._schedule_running(out, budget, now)
        if not out.preempted:
            self._schedule_waiting(out, budget, now)
        return out

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

    def _spec_slice(self, req: Request, num_new: int) -> list[int]:
        # Drafts are the last tokens of the step: keep those that fit after the request's
        # real tokens (budget or max_model_len may cut some), drop the rest.
        if not req.spec_token_ids:
            return []
        room = req.num_computed_tokens + num_new - req.num_tokens
        req.spec_token_ids = req.spec_token_ids[: max(room, 0)]
        return list(req.spec_token_ids)

    def _make_room(self, req: Request, num_new: int, out: SchedulerOutput, now: float) -> bool:
        while not self.bm.can_allocate(req, num_new):
            candidates = [
                r
                for r in self.running
                if r.status is RequestStatus.RUNNING
                and not any(s.request is r for s in out.scheduled)
            ]
            victim = pick_victim(candidates, self.key, now)
            if victim is None:
                victim = req
            self.preempt(victim, out)
            if victim is req:
                return False
        return True

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        deferred: set[str] = set()  # waiting this step for a prefix another request computes
        while budget > 0 and self.waiting and len(self.running) < self.config.max_num_seqs:
            # A beam slot that has offered its candidates waits for its group's round: it
            # has nothing to compute until then (its offer outlives its KV).
            ready = [
                r
                for r in admissible(self.waiting, self.running, self.max_loras)
                if not _offered(r) and r.request_id not in deferred
            ]
            req = pick_first(ready, self.key, now)
            if req is None:
                break  # every waiting request's adapter would exceed max_loras
            if req in out.preempted:
                break  # preempted this very step: taking it back now would only thrash
            if (
                req.group is not None
                and len(self.running) + req.group.seats(req) > self.config.max_num_seqs
            ):
                break  # its children will fork into running slots of their own
            if req.status is RequestStatus.SWAPPED:
                if not self._swap_in(req, out):
                    break
                budget = self._schedule_resumed(req, out, budget)
                continue
            cached = self.bm.find_cached_prefix(req)
            if self._prefix_in_flight(req, len(cached)):
                deferred.add(req.request_id)
                continue
            num_cached_tokens = len(cached) * self.bm.block_size
            num_new = self._tokens_wanted_from(req, num_cached_tokens)
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if not self.bm.can_allocate(req, num_new, cached, start=num_cached_tokens):
                self._release_offered_siblings(req, out)
            if not self.bm.can_allocate(req, num_new, cached, start=num_cached_tokens):
                if not self._preempt_for(req, num_new, cached, num_cached_tokens, out, now):
                    break
            self._admit(req, num_new, cached, num_cached_tokens, out)
            # Recounted rather than decremented: an eviction above gives its tokens back.
            budget = self.last_budget - out.num_tokens

    def _prefix_in_flight(self, req: Request, num_cached_blocks: int) -> bool:
        """Whether the prompt block ``req`` would compute first is one a running request is
        computing now. It then waits (a step, or until that prefill is done) and takes the
        block from the cache instead of computing the shared prefix a second time. vLLM
        gets the same reuse by caching a block when it schedules it."""
        prefilling = [
            r
            for r in self.running
            if r.status is RequestStatus.RUNNING and r.num_computed_tokens < r.num_prompt_tokens
        ]
        if not prefilling:
            return False
        block = self.bm.next_prefix_block(req, num_cached_blocks)
        return block is not None and block in self.bm.prompt_blocks_in_flight(prefilling)

    def _release_offered_siblings(self, req: Request, out: SchedulerOutput) -> None:
        """A beam slot that needs blocks to catch up may take them from its siblings that
        have offered and wait for it: they hold KV they do not need before the round (which
        recomputes what it keeps). Without this, a slot preempted while its siblings wait
        could never come back when only they hold the cache."""
        group = req.group
        if group is None or group.beam is None:
            return
        scheduled = {id(s.request) for s in out.scheduled}
        for sibling in group.sequences:
            if (
                sibling is not req
                and _offered(sibling)
                and id(sibling) not in scheduled
                and sibling.status is RequestStatus.RUNNING
            ):
                self.preempt(sibling, out)

    def _tokens_wanted_from(self, req: Request, num_computed: int) -> int:
        wanted = req.num_tokens - num_computed
        return min(wanted, self._max_model_len - num_computed)

    def _admit(
        self,
        req: Request,
        num_new: int,
        cached: list[int],
        num_cached_tokens: int,
        out: SchedulerOutput,
    ) -> None:
        if req.num_preemptions == 0:
            self.bm.record_lookup(req.num_prompt_tokens, num_cached_tokens)
            req.num_cached_tokens = num_cached_tokens
        req.num_computed_tokens = num_cached_tokens
        self.bm.allocate(req, num_new, cached)
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.scheduled.append(ScheduledRequest(req, num_new))

    def _preempt_for(
        self,
        req: Request,
        num_new: int,
        cached: list[int],
        start: int,
        out: SchedulerOutput,
        now: float,
    ) -> bool:
        """Priority policies: a more urgent arrival may evict less urgent running requests,
        including ones already scheduled in this step (they are taken out of it)."""
        if self.config.policy == "fifo":
            return False
        candidates = self._less_urgent_running(req, now)
        held = Counter(b for r in candidates for b in r.block_table)
        freeable = sum(1 for b, n in held.items() if self.bm.blocks[b].ref_count == n)
        need = self.bm.blocks_needed(start + num_new) - len(cached)
        if need > self.bm.num_free_blocks + freeable:
            return False  # evicting every candidate would not make room: evict none
        while True:
            candidates = self._less_urgent_running(req, now)
            victim = pick_victim(candidates, self.key, now)
            if victim is None:
                return False
            self.preempt(victim, out)
            if self.bm.can_allocate(req, num_new, cached, start=start):
                return True

    def _less_urgent_running(self, req: Request, now: float) -> list[Request]:
        return [r for r in self.running if self.key(r, now) > self.key(req, now)]

    def preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Take ``req`` off the device: swap its KV out, or drop it to recompute later."""
        self.running.remove(req)
        # Scheduled earlier in this step: it no longer runs in it.
        out.scheduled[:] = [s for s in out.scheduled if s.request is not req]
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.spec_token_ids = []
        if self.swap is not None and self.swap.should_swap(req):
            transfer = self.swap.swap_out(req)
            req.status = RequestStatus.SWAPPED
            out.swaps.append(transfer)
        else:
            self.bm.free_request(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
        self.waiting.append(req)
        out.preempted.append(req)

    def _swap_in(self, req: Request, out: SchedulerOutput) -> bool:
        assert self.swap is not None, "only a scheduler with a swap space swaps requests out"
        if not self.swap.can_swap_in(req):
            return False
        out.swaps.append(self.swap.swap_in(req))
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
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


def _offered(req: Request) -> bool:
    """A beam slot whose candidates for its group's current round are in."""
    group = req.group
    return group is not None and group.beam is not None and req.index in group.beam.candidates
