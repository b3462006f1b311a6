"""Turns what a step did to each request into the client's outputs: detokenizes (stop
strings included), collects the sequences of an n / best_of / beam request under its
``ParentRequest``, adds prompt logprobs to a request's first output, and retires finished
sequences. It also keeps the registry of the sequences the engine is serving."""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from slipstream.core.beam_search import Hypothesis
from slipstream.core.request import (
    BeamSnapshot,
    FinishReason,
    Request,
    RequestOutput,
    RequestStatus,
    TokenLogprob,
)
from slipstream.core.scheduler import SchedulerBase
from slipstream.core.scheduler_output import RequestUpdate
from slipstream.core.sequence_group import SequenceGroup
from slipstream.core.stats import EngineStats
from slipstream.engine.detokenizer import IncrementalDetokenizer
from slipstream.engine.parent_request import ParentRequest

# One prompt position's logprobs: token id -> its logprob (the prompt token first).
PromptPosition = Optional[dict[int, TokenLogprob]]


class OutputProcessor:
    def __init__(
        self,
        tokenizer,
        tokenizer_lock: threading.Lock,
        scheduler: SchedulerBase,
        stats: EngineStats,
        block_size: int,
        forget: Callable[[str], None],
    ) -> None:
        """``forget`` drops a finished sequence's state outside this room (sampler, drafts)."""
        self.tokenizer = tokenizer
        self._tokenizer_lock = tokenizer_lock
        self._scheduler = scheduler
        self._stats = stats
        self._block_size = block_size
        self._forget = forget
        self.requests: dict[str, Request] = {}  # every sequence being served, by its id
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.parents: dict[str, ParentRequest] = {}  # by client request id

    # -- requests in and out -------------------------------------------------------------
    def add(self, sequences: list[Request]) -> None:
        """Register a request's sequences (sequence 0 first; one for a plain request)."""
        for seq in sequences:
            self.requests[seq.request_id] = seq
            self.detokenizers[seq.request_id] = IncrementalDetokenizer.for_params(
                self.tokenizer, seq.prompt_token_ids, seq.params
            )
        group = sequences[0].group
        if group is not None:
            self.parents[group.request_id] = ParentRequest(group)

    def end(
        self, request_id: str, status: RequestStatus, error: Optional[str]
    ) -> Optional[RequestOutput]:
        """End a request now (abort, failure) and free its blocks; its final output, or
        None when it is not being served."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.group is not None:
            return self._end_group(req.group, status, error)
        if status is RequestStatus.FINISHED_ERROR:
            assert error is not None  # a failure always carries its message (LLMEngine.fail)
            self._scheduler.fail(req, error)
        else:
            self._scheduler.finish(req, status)
        return self.process(RequestUpdate(req))[0]

    def stop_string(self, req: Request) -> Optional[str]:
        """The stop string the request's text now holds, if any (the scheduler asks)."""
        detok = self.detokenizers[req.request_id]
        detok.update(req.all_token_ids)
        return detok.stopped_on

    # -- outputs -----------------------------------------------------------------------------
    def process(self, update: RequestUpdate) -> list[RequestOutput]:
        """The client's view of one update: its outputs (none while best_of holds them back)."""
        req = update.request
        if req.group is None:
            return [self._sequence_output(update)]
        group = req.group
        parent = self._parent(group)
        if parent is None or parent.closed:  # ended as a whole earlier in this step
            return []
        if group.beam is not None:
            return self._beam_report(update, parent)
        out = self._sequence_output(update)
        if out.finish_reason is FinishReason.ERROR:  # one sequence failed: the request fails
            final = self._end_group(group, RequestStatus.FINISHED_ERROR, out.error)
            return [final] if final is not None else []
        outputs = parent.collect(out)
        self._drop_if_closed(parent)
        return outputs

    def _drop_if_closed(self, parent: ParentRequest) -> None:
        # A closed request's later updates in the same step find no parent: they say nothing.
        if parent.closed:
            self.parents.pop(parent.request_id, None)

    def _parent(self, group: SequenceGroup) -> Optional[ParentRequest]:
        parent = self.parents.get(group.request_id)
        return parent if parent is not None and parent.group is group else None

    def _sequence_output(self, update: RequestUpdate) -> RequestOutput:
        """One sequence's text delta; the sequence is retired if it ended."""
        req = update.request
        self._count_tokens(update)
        if update.num_drafted:
            self._stats.record_speculation(update.num_drafted, update.num_accepted)
            req.num_draft_tokens += update.num_drafted
            req.num_accepted_draft_tokens += update.num_accepted
        detok = self.detokenizers[req.request_id]
        if not req.is_finished:
            detok.update(req.all_token_ids)
            if detok.error is None:
                return self._output(req, detok.take(final=False), update)
            self._scheduler.fail(req, detok.error)  # its text cannot be produced: it alone ends
        self._retire(req)
        aborted = req.status is RequestStatus.FINISHED_ABORTED
        if not aborted:
            # As in vLLM, the EOS / stop token's own text is not part of the output.
            stop_token = (
                req.status is RequestStatus.FINISHED_STOPPED
                and update.stop_string is None
                and not req.params.include_stop_str_in_output
            )
            detok.update(req.all_token_ids[:-1] if stop_token else req.all_token_ids)
        return self._output(req, "" if aborted else detok.take(final=True), update)

    def _count_tokens(self, update: RequestUpdate) -> None:
        req = update.request
        self._stats.generation_tokens_total += len(update.new_token_ids)
        if update.new_token_ids:
            req.last_token_time = time.monotonic()
            if req.first_token_time is None:
                req.first_token_time = req.last_token_time

    def _output(self, req: Request, text: str, update: RequestUpdate) -> RequestOutput:
        prompt_lps = None
        if (
            req.params.prompt_logprobs is not None
            and update.new_token_ids
            and req.num_output_tokens == len(update.new_token_ids)
        ):  # its first output
            prompt_lps = prompt_logprobs_output(req)
        return RequestOutput(
            request_id=req.request_id,
            text=text,
            token_ids=list(update.new_token_ids),
            logprobs=list(update.new_logprobs),
            finished=req.is_finished,
            finish_reason=req.status.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
            cumulative_logprob=req.cumulative_logprob,
            error=req.error,
            timing=req.timing() if req.is_finished else None,
            index=req.index,
            prompt_logprobs=prompt_lps,
            metrics=req.metrics(self._block_size) if req.is_finished else None,
        )

    # -- beam search ---------------------------------------------------------------------------
    def _beam_report(self, update: RequestUpdate, parent: ParentRequest) -> list[RequestOutput]:
        """Beam search answers once, when the search ends: the ``n`` best finished beams,
        best first (index = rank). Until then beams change their past, so nothing is final."""
        req, group = update.request, parent.group
        beam = group.beam
        assert beam is not None  # only beam-search groups report here
        if req.status is RequestStatus.FINISHED_ERROR:
            final = self._end_group(group, RequestStatus.FINISHED_ERROR, req.error)
            return [final] if final is not None else []
        self._count_tokens(update)
        if not beam.finished:
            # one snapshot per round: every slot moved in it, slot 0's update is one of them
            return [_beam_snapshot(group)] if req.index == 0 and update.new_token_ids else []
        first = group.parent
        for name in ("first_token_time", "last_token_time"):  # the request's, over its beams
            moments = [getattr(s, name) for s in group.sequences if getattr(s, name)]
            setattr(
                first,
                name,
                (min if name.startswith("first") else max)(moments) if moments else None,
            )
        for seq in group.sequences:
            if seq.request_id in self.requests:
                self._retire(seq)
        parent.closed = True
        self._drop_if_closed(parent)
        outputs = [
            self._hypothesis_output(group, rank, h)
            for rank, h in enumerate(beam.hypotheses[: group.n])
        ]
        if not outputs:  # no beam could finish (a vocabulary of stop tokens only)
            return [parent.close(FinishReason.LENGTH, None)]
        outputs[-1].finished = True
        return outputs

    def _hypothesis_output(self, group: SequenceGroup, rank: int, hyp: Hypothesis) -> RequestOutput:
        first, params = group.parent, group.parent.params
        shown = hyp.token_ids
        if hyp.finish_reason is FinishReason.STOP and not params.include_stop_str_in_output:
            shown = shown[:-1]  # as for any request, the stop token's text is not output
        text = ""
        if params.detokenize:
            with self._tokenizer_lock:
                text = self.tokenizer.decode(shown, skip_special_tokens=params.skip_special_tokens)
        return RequestOutput(
            request_id=group.request_id,
            text=text,
            token_ids=list(hyp.token_ids),
            logprobs=[TokenLogprob(x) for x in hyp.logprobs],
            finished=False,
            finish_reason=hyp.finish_reason,
            num_prompt_tokens=first.num_prompt_tokens,
            num_output_tokens=len(hyp.token_ids),
            num_cached_tokens=first.num_cached_tokens,
            cumulative_logprob=hyp.cumulative_logprob,
            timing=first.timing(),
            index=rank,
            metrics=first.metrics(self._block_size),
        )

    # -- ending --------------------------------------------------------------------------------
    def _retire(self, req: Request) -> None:
        """Forget a finished sequence everywhere outside the scheduler."""
        self._forget(req.request_id)
        self.requests.pop(req.request_id, None)
        self.detokenizers.pop(req.request_id, None)
        if req.index == 0:  # one client request, whatever its n
            self._stats.num_finished += 1

    def _end_group(
        self, group: SequenceGroup, status: RequestStatus, error: Optional[str]
    ) -> Optional[RequestOutput]:
        """End every sequence of a request at once (abort, or one sequence failed): one final
        output for the client. None if the request had already ended."""
        parent = self._parent(group)
        if parent is None or parent.closed:
            return None
        for seq in group.sequences:
            if not seq.is_finished:
                seq.error = error
                self._scheduler.finish(seq, status)
            if seq.request_id in self.requests:
                self._retire(seq)
        output = parent.close(status.finish_reason, error)
        self._drop_if_closed(parent)
        return output


def _beam_snapshot(group: SequenceGroup) -> RequestOutput:
    beam = group.beam
    assert beam is not None
    order = sorted(range(beam.width), key=lambda s: -beam.scores[s])
    return RequestOutput(
        request_id=group.request_id,
        num_prompt_tokens=group.parent.num_prompt_tokens,
        beams=[
            BeamSnapshot(
                group.sequences[s].output_token_ids, list(beam.logprobs[s]), beam.scores[s]
            )
            for s in order
        ],
    )


def prompt_logprobs_output(req: Request) -> list[PromptPosition]:
    """vLLM's shape: None for the first prompt token, then per token a dict token id ->
    TokenLogprob (with its rank), the prompt token first, then its top-N alternatives."""
    entries: list[PromptPosition] = [None]
    for token, lp in zip(req.prompt_token_ids[1:], req.prompt_logprobs):
        position = {token: lp}
        for rank, (alt, value) in enumerate(lp.top, start=1):
            position.setdefault(alt, TokenLogprob(value, rank))
        entries.append(position)
    return entries
