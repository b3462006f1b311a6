"""Beam search over the sequences of a ``SequenceGroup`` (its beam slots). Pure Python.

A request of ``beam_width`` k is a group of k sequences, forked from the prompt like ``n``
sequences (full KV blocks shared). Each round every live slot offers the top candidates of
its next-token log-probabilities (``offer``: the engine computes them in the step's batched
forward); once all k have, ``step`` ranks the k x candidates by cumulative log-probability,
as Hugging Face's ``generate(num_beams=k, do_sample=False)`` does:

* the best ``2k`` continuations (more with several stop tokens) are looked at, in order;
* a continuation ending in a stop token (EOS, ``stop_token_ids``), or reaching the length
  limit, is a finished hypothesis if it ranks among the first k: scored
  ``cumulative_logprob / generated_length ** length_penalty``, the k best kept;
* the k best other continuations are the next round's beams. A slot whose beam was kept by
  no continuation dies; it is re-seated on a surviving beam (``Move.parent``), whose KV it
  then shares copy-on-write (the scheduler does that);
* the search ends at the length limit, when ``early_stopping`` is true and k hypotheses have
  finished, or when no running beam can beat the worst finished one any more (the heuristic
  ``early_stopping=False`` uses; ``"never"`` measures it at the longest possible length).

Before the first round every slot holds the prompt: slots 1..k-1 start at -1e9 so that the
first choice is made from one copy of the prompt's distribution only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from slipstream.core.request import FinishReason

# a continuation: (total log-probability, parent slot, token, its log-probability)
Candidate = tuple[float, int, int, float]

UNREACHABLE = -1.0e9  # a score that no real continuation can have (Hugging Face's value)
EarlyStopping = Union[bool, str]


@dataclass
class Hypothesis:
    """A finished beam."""

    token_ids: list[int]  # the generated tokens, the stop token included
    logprobs: list[float]  # each token's log-probability
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    finish_reason: FinishReason


@dataclass
class Move:
    """One beam of the next round: slot ``slot`` continues ``parent``'s beam with ``token_id``
    (``slot != parent``: the slot's own beam died and it takes over a copy of the parent's)."""

    slot: int
    parent: int
    token_id: int
    logprob: float


@dataclass
class BeamSearch:
    width: int
    stop_ids: frozenset[int]
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False
    # Each slot's running score (the cumulative log-probability of its beam).
    scores: list[float] = field(default_factory=list)
    # Each slot's tokens' log-probabilities (the beam's; a re-seated slot takes its parent's).
    logprobs: list[list[float]] = field(default_factory=list)
    # This round's offers: slot -> (log-probabilities, token ids), best first.
    candidates: dict[int, tuple[list[float], list[int]]] = field(default_factory=dict)
    hypotheses: list[Hypothesis] = field(default_factory=list)  # best first, at most width
    improvable: bool = True  # whether a running beam may still beat the finished ones
    finished: bool = False

    def __post_init__(self) -> None:
        self.scores = [0.0] + [UNREACHABLE] * (self.width - 1)
        self.logprobs = [[] for _ in range(self.width)]

    @property
    def num_candidates(self) -> int:
        """Continuations looked at per round (per slot offered): enough that k survive even
        if every stop token ranks among them (Hugging Face's ``beams_to_keep``)."""
        return max(2, 1 + len(self.stop_ids)) * self.width

    def offer(self, slot: int, logprobs: list[float], token_ids: list[int]) -> None:
        self.candidates[slot] = (logprobs, token_ids)

    @property
    def ready(self) -> bool:
        return not self.finished and len(self.candidates) == self.width

    def step(self, outputs: list[list[int]], limit: int) -> list[Move]:
        """One round, given each slot's generated tokens so far (all of one length) and the
        most tokens a beam may have. Returns the next round's beams (none once finished)."""
        length = len(outputs[0]) + 1  # each continuation's generated length
        last = length >= limit
        ranked = sorted(
            (
                (self.scores[s] + lp, s, tok, lp)
                for s, (lps, toks) in self.candidates.items()
                for lp, tok in zip(lps, toks)
            ),
            key=lambda c: -c[0],
        )[: self.num_candidates]
        self.candidates = {}
        running: list[Candidate] = []
        finished = []
        for rank, (total, slot, tok, lp) in enumerate(ranked):
            stops = tok in self.stop_ids
            if stops or last:
                if rank < self.width:
                    reason = FinishReason.STOP if stops else FinishReason.LENGTH
                    finished.append(
                        Hypothesis(
                            outputs[slot] + [tok],
                            self.logprobs[slot] + [lp],
                            total,
                            total / length**self.length_penalty,
                            reason,
                        )
                    )
            elif len(running) < self.width:
                running.append((total, slot, tok, lp))
        self._keep(finished)
        moves = self._seat(running)
        self._check_done(running, length, limit, last)
        return [] if self.finished else moves

    def _keep(self, finished: list[Hypothesis]) -> None:
        full = len(self.hypotheses) >= self.width
        if not self.improvable or (full and self.early_stopping is True):
            return
        merged = self.hypotheses + finished
        merged.sort(key=lambda h: -h.score)  # stable: earlier hypotheses win ties
        self.hypotheses = merged[: self.width]

    def _seat(self, running: list[Candidate]) -> list[Move]:
        """Slots for the next beams: a beam's first continuation stays in its slot, others
        take the slots of beams no continuation kept."""
        parents = {slot for _, slot, _, _ in running}
        free = [s for s in range(self.width) if s not in parents]
        claimed: set[int] = set()
        moves = []
        for _, parent, tok, lp in running:
            slot = parent if parent not in claimed else free.pop(0)
            claimed.add(parent)
            moves.append(Move(slot, parent, tok, lp))
        old_scores, old_logprobs = list(self.scores), [list(x) for x in self.logprobs]
        for m in moves:
            self.scores[m.slot] = old_scores[m.parent] + m.logprob
            self.logprobs[m.slot] = old_logprobs[m.parent] + [m.logprob]
        return moves

    def _check_done(self, running: list[Candidate], length: int, limit: int, last: bool) -> None:
        if len(self.hypotheses) >= self.width and running:
            best_length = length
            if self.early_stopping == "never" and self.length_penalty > 0:
                best_length = limit
            best = running[0][0] / best_length**self.length_penalty
            self.improvable = self.improvable and best > min(h.score for h in self.hypotheses)
        full = len(self.hypotheses) >= self.width
        self.finished = (
            last or not running or not self.improvable or (full and self.early_stopping is True)
        )
