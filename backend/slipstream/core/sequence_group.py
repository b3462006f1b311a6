"""Parallel sampling (vLLM's ``n`` and ``best_of``): one request, several sequences.

The request's own ``Request`` is sequence 0, the parent: it alone is queued and prefills the
prompt. The step that completes the prompt samples one first token per sequence from the
prompt's last logits row; the scheduler then forks the children (sequences 1..k-1) from the
parent, sharing its KV blocks through the block manager's reference counts (full prompt blocks
are shared, the partly filled last block is copied: each sequence writes its own tokens
there). From then on every sequence is an ordinary running request.

Seeds: child ``i`` samples with ``seed + i`` (vLLM's rule), so a seeded request gives the same
``n`` sequences whatever else shares the batch. ``best_of`` > ``n``: all ``best_of`` run and
the ``n`` with the highest cumulative logprob are returned when the last one finishes
(the engine's ``ParentRequest`` collects the outputs).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

from slipstream.core.beam_search import BeamSearch
from slipstream.core.request import Request
from slipstream.core.sampling_params import SEED_RANGE, SamplingParams


def child_request_id(request_id: str, index: int) -> str:
    """The engine-internal id of sequence ``index`` (vLLM v1 names children the same way)."""
    return request_id if index == 0 else f"{index}_{request_id}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sequence ``index``'s parameters: its own seed; prompt logprobs only on sequence 0."""
    child = copy.copy(params)  # not replace(): that would re-run __post_init__ (bad_words ids)
    if params.seed is not None and index:
        seed = params.seed + index
        child.seed = seed if seed <= SEED_RANGE[1] else seed - 2**64
    if index:
        child.prompt_logprobs = None
    return child


@dataclass
class SequenceGroup:
    request_id: str  # the client's id, also sequence 0's
    n: int  # sequences returned
    sequences: list[Request]  # in index order; [0] is the parent
    forked: bool = False
    # Beam search (beam_width > 1): the sequences are its beam slots (core/beam_search.py).
    beam: Optional[BeamSearch] = None

    @classmethod
    def create(cls, parent: Request) -> Optional["SequenceGroup"]:
        """The group for a request that asks for more than one sequence, else None."""
        params = parent.params
        k = params.num_sequences
        if k == 1:
            return None
        parent.params = child_params(params, 0)
        seqs = [parent] + [
            Request(
                child_request_id(parent.request_id, i),
                parent.prompt_token_ids,
                child_params(params, i),
                parent.eos_token_id,
                parent.priority,
                parent.arrival_time,
            )
            for i in range(1, k)
        ]
        group = cls(parent.request_id, params.n, seqs)
        if params.beam_search:
            stops = set(params.stop_token_ids)
            if parent.eos_token_id is not None and not params.ignore_eos:
                stops.add(parent.eos_token_id)
            group.beam = BeamSearch(
                k, frozenset(stops), params.length_penalty, params.early_stopping
            )
        for i, seq in enumerate(seqs):
            seq.index, seq.group = i, group
        return group

    @property
    def parent(self) -> Request:
        return self.sequences[0]

    @property
    def children(self) -> list[Request]:
        return self.sequences[1:]

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.sequences)

    @property
    def selects_best(self) -> bool:
        """best_of > n: outputs are held back and ranked when every sequence has ended."""
        return len(self.sequences) > self.n

    def seats(self, req: Request) -> int:
        """Running slots ``req`` takes when admitted: the parent brings its unforked children."""
        return len(self.sequences) if req is self.parent and not self.forked else 1

    def forks_at(
        self, req: Request, computed_before: int, num_new: int, tokens_before: int
    ) -> bool:
        """Whether this step of ``req`` completes the prompt and so forks the children."""
        return (
            req is self.parent
            and not self.forked
            and computed_before + num_new == tokens_before == req.num_prompt_tokens
        )

    def best(self) -> list[Request]:
        """The ``n`` sequences to return, most likely first (cumulative logprob)."""
        ranked = sorted(self.sequences, key=lambda s: s.cumulative_logprob, reverse=True)
        return ranked[: self.n]
