"""What crosses the seams of one engine step.

scheduler --SchedulerOutput--> model executor (runs the forward, samples)
--ModelRunnerOutput--> scheduler.update_from_output --RequestUpdate--> output processor
(detokenizes, reports outputs).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

from slipstream.core.request import Request, TokenLogprob


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # Draft tokens appended for this step (speculative decoding); they are the last
    # ``len(spec_token_ids)`` of the new tokens.
    spec_token_ids: list[int] = field(default_factory=list)
    # The request's progress when it was scheduled (the step trace tells prefill from
    # decode with them; update_from_output has moved both on by the time the trace is taken).
    num_computed_before: int = field(init=False, default=0)
    num_tokens_before: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.num_computed_before = self.request.num_computed_tokens
        self.num_tokens_before = self.request.num_tokens

    @property
    def forks(self) -> list[Request]:
        """Parallel sampling: the children whose first tokens this step samples from the
        prompt's last row (one row per sequence, the parent's first), else empty."""
        group = self.request.group
        if group is None or not group.forks_at(
            self.request, self.num_computed_before, self.num_new_tokens, self.num_tokens_before
        ):
            return []
        return group.children


@dataclass
class BatchPadding:
    """Request-level batching's wasted work (static/dynamic baselines): every prefill row
    is padded to the batch's longest prompt, and each empty or finished slot of the batch
    still runs as a row of ``padded_prompt_len`` tokens (one token in decode steps).

    The one statement of the padding rule: the runner computes these rows for real and the
    trace counts them."""

    padded_prompt_len: int = 0
    num_padding_seqs: int = 0

    def row_lengths(self, scheduled: list[ScheduledRequest]) -> list[int]:
        """Lengths of the extra rows a step computes: the padded prompt tokens of the real
        prefill rows (packed into one row), then one row per padding sequence."""
        rows = []
        pad_tokens = sum(
            self.padded_prompt_len - s.num_new_tokens for s in scheduled if s.num_new_tokens > 1
        )
        if pad_tokens > 0:
            rows.append(pad_tokens)
        rows.extend([max(self.padded_prompt_len, 1)] * self.num_padding_seqs)
        return rows

    def num_tokens(self, scheduled: list[ScheduledRequest]) -> int:
        return sum(self.row_lengths(scheduled))


class SwapDirection(enum.Enum):
    OUT = "out"  # device -> CPU pool (preemption)
    IN = "in"  # CPU pool -> device (resumption)


@dataclass
class SwapTransfer:
    """One request's KV blocks copied between the device cache and the CPU swap pool.
    Device blocks are listed in the request's block order, paired with its CPU blocks."""

    request: Request
    direction: SwapDirection
    device_blocks: list[int]
    cpu_blocks: list[int]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # in batch order
    padding: BatchPadding = field(default_factory=BatchPadding)
    preempted: list[Request] = field(default_factory=list)
    # Copies the worker makes before the forward, in this order: the order the scheduler
    # decided them in, since a later one may reuse blocks an earlier one released.
    swaps: list[SwapTransfer] = field(default_factory=list)
    # (source, destination) KV blocks to copy after the step: the partly filled prompt block
    # of each sequence forked in it (update_from_output records them).
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def swapped_out(self) -> list[Request]:
        return [t.request for t in self.swaps if t.direction is SwapDirection.OUT]

    @property
    def swapped_in(self) -> list[Request]:
        return [t.request for t in self.swaps if t.direction is SwapDirection.IN]


@dataclass
class ModelRunnerOutput:
    """The model executor's answer for one step: per scheduled request, in batch order, the tokens
    it sampled (none for a prefill chunk that does not reach the prompt's end; one per
    verified draft plus one otherwise) and their logprobs. ``errors`` names the requests
    whose own rows failed (the step is fail-soft: the others' tokens are still good)."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    errors: dict[str, str] = field(default_factory=dict)  # request id -> message
    # request id -> TokenLogprobs of the prompt tokens this step scored (prompt_logprobs)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)

    @classmethod
    def empty(cls, n: int) -> "ModelRunnerOutput":
        return cls([[] for _ in range(n)], [[] for _ in range(n)])

    def extend(self, other: "ModelRunnerOutput") -> None:
        """Append another batch's answer (the fail-soft retry runs requests one by one)."""
        self.token_ids += other.token_ids
        self.logprobs += other.logprobs
        self.errors.update(other.errors)
        self.prompt_logprobs.update(other.prompt_logprobs)


@dataclass
class RequestUpdate:
    """What one step did to one request, for the engine to report."""

    request: Request
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[float] = field(default_factory=list)
    num_drafted: int = 0
    num_accepted: int = 0
    # The stop string that ended the request, if one did (its text is cut before it).
    stop_string: Optional[str] = None

    @property
    def finished(self) -> bool:
        return self.request.is_finished
