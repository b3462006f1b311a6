"""The client's view of a request that runs as several sequences (n, best_of, beam search):
what vLLM calls a parent request. The sequences themselves are scheduled through their
``SequenceGroup`` (core); this collects their outputs into the client's stream."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from slipstream.core.request import FinishReason, RequestOutput, merge_output
from slipstream.core.sequence_group import SequenceGroup


@dataclass
class ParentRequest:
    group: SequenceGroup
    closed: bool = False  # its last output (finished=True) has been made
    ended: set[int] = field(default_factory=set)  # indices of the sequences that have ended
    # best_of > n: each sequence's whole output, kept until the group is ranked at the end.
    held: dict[int, RequestOutput] = field(default_factory=dict)

    @property
    def request_id(self) -> str:
        return self.group.request_id

    def collect(self, out: RequestOutput) -> list[RequestOutput]:
        """The client's outputs for one sequence's output: passed on (n sequences), or held
        until every sequence has ended and then the best n, re-indexed by rank (best_of)."""
        group = self.group
        out.request_id = group.request_id
        if out.finish_reason is not None:
            self.ended.add(out.index)
        done = len(self.ended) == len(group.sequences)
        self.closed = done
        if not group.selects_best:
            out.finished = done  # only the request's very last output ends its stream
            return [out]
        total = self.held.setdefault(out.index, RequestOutput(group.request_id, index=out.index))
        merge_output(total, out)
        return self._ranked() if done else []

    def _ranked(self) -> list[RequestOutput]:
        prompt_logprobs = self.held[0].prompt_logprobs
        outputs = []
        for rank, seq in enumerate(self.group.best()):
            out = self.held[seq.index]
            out.index, out.finished, out.prompt_logprobs = rank, False, None
            outputs.append(out)
        outputs[0].prompt_logprobs = prompt_logprobs
        outputs[-1].finished = True
        return outputs

    def close(self, reason: Optional[FinishReason], error: Optional[str]) -> RequestOutput:
        """The one final output of a request ended as a whole (abort, a failed sequence)."""
        self.closed = True
        parent = self.group.parent
        return RequestOutput(
            self.request_id,
            finished=True,
            finish_reason=reason,
            error=error,
            num_prompt_tokens=parent.num_prompt_tokens,
            num_output_tokens=parent.num_output_tokens,
            num_cached_tokens=parent.num_cached_tokens,
            cumulative_logprob=parent.cumulative_logprob,
            timing=parent.timing(),
        )
