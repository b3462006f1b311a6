"""A request's state inside the engine, and what the engine reports back for it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from time import time as wall_clock  # its own name: tests fake the module's monotonic()
from typing import TYPE_CHECKING, Iterable, Optional, Protocol

from slipstream.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from slipstream.core.sequence_group import SequenceGroup


class FinishReason(str, enum.Enum):
    """Why a request ended. A ``str`` enum: equal to its wire name ("stop", ...)."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens, max_model_len or the KV cache's capacity
    ABORT = "abort"  # cancelled by the client or by shutdown
    ERROR = "error"  # this request failed; ``RequestOutput.error`` says why

    def __str__(self) -> str:
        return self.value


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV copied to the CPU swap pool
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def finish_reason(self) -> Optional[FinishReason]:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class TokenLogprob(float):
    """A sampled token's log-probability (under the raw model distribution) that also carries,
    when the request asked for logprobs, its 1-based rank in the vocabulary and the top-N
    ``(token id, logprob)`` alternatives. A float, so the engine sums and stores it unchanged."""

    rank: Optional[int]
    top: tuple[tuple[int, float], ...]

    def __new__(
        cls, value: float, rank: Optional[int] = None, top: Iterable[tuple[int, float]] = ()
    ) -> "TokenLogprob":
        obj = super().__new__(cls, value)
        obj.rank, obj.top = rank, tuple(top)
        return obj


# One prompt position of vLLM's prompt_logprobs: token id -> TokenLogprob (the prompt token,
# then its top-N alternatives); None for the first prompt token, which has no logprob.
PromptPosition = Optional[dict[int, TokenLogprob]]


class GrammarMatcher(Protocol):
    """A structured-output request's grammar state (worker.structured_output.GrammarState)."""

    def copy(self) -> GrammarMatcher:
        """An independent state at the same point (for a forked sequence)."""
        ...

    def sync(self, req: Request) -> None:
        """Accept the request's output tokens the state has not seen yet."""
        ...


@dataclass
class RequestTiming:
    """When a finished request arrived, was first scheduled, produced its first token and
    finished (``time.monotonic()``); the queue / prefill / decode histograms read these."""

    arrival: float
    first_scheduled: Optional[float]
    first_token: Optional[float]
    finished: float


@dataclass
class RequestMetrics:
    """A finished request's own facts (TensorRT-LLM's per-request perf metrics). Times are
    wall-clock seconds since the epoch (``time.time()``)."""

    arrival_time: float
    first_scheduled_time: Optional[float]
    first_token_time: Optional[float]
    last_token_time: Optional[float]
    kv_total_blocks: int  # KV blocks its sequence held at its end
    kv_reused_blocks: int  # of those, prompt blocks found in the prefix cache
    draft_tokens: int  # speculative decoding: draft tokens proposed for it
    accepted_draft_tokens: int  # and accepted by the target model

    @property
    def kv_new_blocks(self) -> int:
        return self.kv_total_blocks - self.kv_reused_blocks

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0


def _wall(moment: Optional[float], now_monotonic: float, now_wall: float) -> Optional[float]:
    """A ``time.monotonic()`` moment as wall-clock time."""
    return None if moment is None else now_wall - (now_monotonic - moment)


class Request:
    """One sequence. Progress is a single counter, ``num_computed_tokens``: prefill and
    decode are the same thing (compute the tokens the KV cache does not hold yet)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_id: Optional[int] = None,
        priority: int = 0,
        arrival_time: Optional[float] = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_id = eos_token_id
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.block_table: list[int] = []
        self.num_preemptions = 0
        self.cumulative_logprob = 0.0
        self.first_token_time: Optional[float] = None
        self.first_scheduled_time: Optional[float] = None  # set by EngineStats.record_step
        self.last_token_time: Optional[float] = None
        self.num_draft_tokens = 0  # speculative decoding, over the request's life
        self.num_accepted_draft_tokens = 0
        self.spec_token_ids: list[int] = []  # draft tokens proposed for the next step
        self.error: Optional[str] = None
        # Structured outputs: the grammar matcher (worker.structured_output.GrammarState),
        # set by the engine when the request asks for one; None = free generation.
        self.grammar: Optional[GrammarMatcher] = None
        # Parallel sampling (n / best_of): which sequence of its group this is (0 = the one that
        # prefills the prompt) and the group, None for a plain request.
        self.index = 0
        self.group: Optional["SequenceGroup"] = None
        # prompt_logprobs: entry i is prompt token i + 1's TokenLogprob (token 0 has none).
        self.prompt_logprobs: list[TokenLogprob] = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def timing(self) -> RequestTiming:
        return RequestTiming(
            self.arrival_time, self.first_scheduled_time, self.first_token_time, time.monotonic()
        )

    def metrics(self, block_size: int) -> RequestMetrics:
        mono, wall = time.monotonic(), wall_clock()
        return RequestMetrics(
            arrival_time=wall - (mono - self.arrival_time),
            first_scheduled_time=_wall(self.first_scheduled_time, mono, wall),
            first_token_time=_wall(self.first_token_time, mono, wall),
            last_token_time=_wall(self.last_token_time, mono, wall),
            kv_total_blocks=-(-self.num_computed_tokens // block_size),
            kv_reused_blocks=self.num_cached_tokens // block_size,
            draft_tokens=self.num_draft_tokens,
            accepted_draft_tokens=self.num_accepted_draft_tokens,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, computed="
            f"{self.num_computed_tokens}/{self.num_tokens}, blocks={len(self.block_table)})"
        )


@dataclass
class BeamSnapshot:
    """One live beam while a beam search runs: its tokens so far (beams change their past, so
    these are whole, not deltas)."""

    token_ids: list[int]
    logprobs: list[float]
    cumulative_logprob: float


@dataclass
class RequestOutput:
    """Incremental output of one request: deltas since the previous output.

    With ``n`` > 1 each output is one sequence's (``index``); ``finish_reason`` says that
    sequence ended, ``finished`` that the whole request did (its last output)."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # logprob of each token in token_ids
    finished: bool = False
    finish_reason: Optional[FinishReason] = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    cumulative_logprob: float = 0.0
    error: Optional[str] = None
    timing: Optional[RequestTiming] = None  # on the finished output only
    index: int = 0  # which of the request's n sequences
    # prompt_logprobs as vLLM returns them: None for the first prompt token, then per token a
    # dict token id -> TokenLogprob (with its rank); on the request's first output only.
    prompt_logprobs: Optional[list[PromptPosition]] = None
    metrics: Optional[RequestMetrics] = None  # on the request's finished output only
    # Beam search, after each round but the last: every live beam, best first (no text; the
    # finished beams come as ordinary outputs, one per returned beam, at the end).
    beams: Optional[list[BeamSnapshot]] = None
    # A pooling (embedding) request's vector, on its one (finished) output.
    embedding: Optional[list[float]] = None


def merge_output(total: RequestOutput, delta: RequestOutput) -> None:
    """Fold an incremental output into a running total."""
    total.text += delta.text
    total.token_ids.extend(delta.token_ids)
    total.logprobs.extend(delta.logprobs)
    for name in (
        "finished",
        "finish_reason",
        "num_prompt_tokens",
        "num_output_tokens",
        "num_cached_tokens",
        "cumulative_logprob",
        "error",
        "timing",
        "index",
        "metrics",
    ):
        setattr(total, name, getattr(delta, name))
    if delta.prompt_logprobs is not None:
        total.prompt_logprobs = delta.prompt_logprobs
