"""Speculative decoding: cheap draft tokens that the target model verifies in one step.

After a request samples a token, a proposer guesses the next ``k`` tokens. The next step
feeds the target the real last token plus the ``k`` drafts; the runner returns logits
for those ``1 + k`` rows and the sampler draws one target token per row. the scheduler
keeps draft ``i`` while it equals the target's token at row ``i``, then appends the first
disagreeing target token (or, when every draft survived, the bonus token of the last row).

Why this is exact: the proposers here are deterministic, i.e. the draft distribution
``q`` is one-hot on the proposed token ``d``. Standard speculative sampling (Leviathan et
al., Chen et al.) accepts ``d`` with probability ``min(1, p(d)/q(d)) = p(d)`` and on
rejection samples from ``norm(max(0, p - q))``, which is ``p`` conditioned on ``x != d``.
Sampling ``x ~ p`` and accepting iff ``x == d`` gives exactly that: ``P(accept) = p(d)``,
and a rejected ``x`` is distributed as ``p`` given ``x != d``. Each row's ``p`` is the
target's distribution given the prefix that was actually accepted (rows after the first
rejection are discarded), so every emitted token is distributed as in plain decoding; for
greedy requests this means the outputs are identical. A stochastic draft would need the
general ``p/q`` rule, which is why the draft model proposes greedily.

What the sampler cannot do per draft row: penalties (repetition/presence/frequency) and
``min_tokens`` are evaluated once per step from the tokens before it, so the engine does
not speculate for requests that use them (see ``speculates``).

Methods:

* ``ngram`` -- prompt lookup decoding: find the most recent earlier occurrence of the
  last ``n`` tokens (``n`` from ``ngram_prompt_lookup_max`` down to ``_min``) and propose
  what followed it. When the continuation runs into the end of the sequence it is extended
  periodically (the text is assumed to keep repeating), so a loop yields full drafts.
* ``draft`` -- a small model (``speculative_model``, a local HF directory sharing the
  target's tokenizer) decodes greedily on its own paged KV cache, batched: one ragged
  forward brings every request's draft cache up to date and produces its first draft,
  then one forward per further draft token for the whole batch. The drafts stay on the
  device between these forwards (each feeds the next as its input token) and come back in
  one copy when the proposal is done: on a GPU the forwards never wait for each other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from slipstream.core.block_manager import BlockManager
from slipstream.core.config import EngineConfig
from slipstream.core.request import Request, RequestStatus
from slipstream.core.scheduler_output import ScheduledRequest, SchedulerOutput
from slipstream.engine.factory import ModelStack, input_vocab_size, resolved_max_model_len
from slipstream.worker.model_runner import StepBatch
from slipstream.worker.transfer import DeviceToHost

log = logging.getLogger("slipstream")


def max_drafts(req: Request, config: EngineConfig, cap: Optional[int] = None) -> int:
    """How many drafts are worth proposing: a step appends at most ``drafts + 1`` tokens,
    which must fit both ``max_tokens`` and ``max_model_len``; at most ``cap`` (the step's
    share of the draft rows, ``draft_cap``)."""
    k = min(
        config.num_speculative_tokens,
        req.params.max_tokens - req.num_output_tokens - 1,
        resolved_max_model_len(config) - req.num_tokens - 1,
    )
    return max(k if cap is None else min(k, cap), 0)


def draft_cap(config: EngineConfig, running: int) -> Optional[int]:
    """Drafts each request may add to the next step (None: no cap): none past
    ``speculative_disable_by_batch_size`` requests, and within
    ``speculative_row_budget`` rows, one per request plus its drafts (a step of a few
    rows is bound by reading the weights, so its extra rows cost little)."""
    c = config
    if c.speculative_disable_by_batch_size and running > c.speculative_disable_by_batch_size:
        return 0
    if c.speculative_row_budget:
        return max(c.speculative_row_budget - running, 0) // max(running, 1)
    return None


def speculates(req: Request) -> bool:
    """Whether drafts for ``req`` would be verified exactly (see the module)."""
    # Penalties and min_tokens are applied once per step from the tokens before it,
    # not per draft row, so such requests would not match plain decoding; a grammar's
    # mask is computed for the next token only, so constrained requests never draft.
    # min_tokens blocks nothing when EOS is ignored and there are no stop tokens.
    p = req.params
    min_tokens_inert = p.ignore_eos and not p.stop_token_ids
    return (
        req.grammar is None
        and req.group is None
        and p.use_speculation
        and p.repetition_penalty == 1.0
        and not p.presence_penalty
        and not p.frequency_penalty
        and (req.num_output_tokens >= p.min_tokens or min_tokens_inert)
    )


class Proposer:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    def propose(self, req: Request, cap: Optional[int] = None) -> list[int]:
        return self.propose_batch([req], cap)[0]

    def propose_batch(self, reqs: list[Request], cap: Optional[int] = None) -> list[list[int]]:
        return [self.propose(r, cap) for r in reqs]

    def discard(self, request_id: str) -> None:
        """Forget per-request state (no-op for stateless proposers)."""

    def draft_for_step(self, reqs: list[Request], num_running: int) -> None:
        """Draft tokens for every request that just sampled and may speculate, in one
        batch; they go to each request's ``spec_token_ids``."""
        cap = draft_cap(self.config, num_running)
        if cap == 0:
            return
        eligible = [
            r
            for r in reqs
            if r.status is RequestStatus.RUNNING
            and speculates(r)
            and r.num_tokens - r.num_computed_tokens == 1
        ]
        if cap is not None:
            # A seeded sampled request draws one number per row, so its text would depend on
            # how many requests it shared steps with: it drafts only while that is fixed.
            eligible = [r for r in eligible if r.params.seed is None or r.params.greedy]
        if eligible:
            for req, drafts in zip(eligible, self.propose_batch(eligible, cap)):
                req.spec_token_ids = list(drafts)


class NgramProposer(Proposer):
    """Prompt lookup decoding; no model, no state."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.n_max = config.ngram_prompt_lookup_max
        self.n_min = max(config.ngram_prompt_lookup_min, 1)
        if self.n_max < self.n_min:
            raise ValueError("ngram_prompt_lookup_max must be >= ngram_prompt_lookup_min")

    def propose(self, req: Request, cap: Optional[int] = None) -> list[int]:
        k = max_drafts(req, self.config, cap)
        if k <= 0:
            return []
        return ngram_lookup(req.all_token_ids, k, self.n_min, self.n_max)


def ngram_lookup(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Drafts from the most recent earlier occurrence of the longest matching suffix."""
    length = len(tokens)
    if length < n_min + 1 or k <= 0:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = arr[length - n :]
        # windows start at 0 .. length-n-1: every occurrence before the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size == 0:
            continue
        start = int(hits[-1]) + n  # the first token that followed the occurrence
        drafts: list = []
        for j in range(k):
            src = start + j
            drafts.append(tokens[src] if src < length else drafts[src - length])
        return drafts
    return []


@dataclass
class _Shadow:
    """A request's state in the draft model's cache. ``seq.all_token_ids[:synced]`` equals
    the request's tokens as of the last proposal; after it come that proposal's drafts."""

    source: Request  # the request being drafted for
    seq: Request
    synced: int
    k: int = 0
    drafts: list[int] = field(default_factory=list)


class DraftModelProposer(Proposer):
    """Greedy proposals from a small model running on its own paged KV cache (built by the
    engine's ``ModelFactory``, like the target's)."""

    def __init__(
        self, config: EngineConfig, stack: ModelStack, target_vocab: int, tokenizer_size: int
    ) -> None:
        super().__init__(config)
        self.model = stack.model
        self.draft_vocab = input_vocab_size(self.model)
        if self.draft_vocab < tokenizer_size:
            raise ValueError(
                f"the draft model's vocabulary ({self.draft_vocab}) is smaller than the target "
                f"tokenizer's ({tokenizer_size}): they must share a tokenizer"
            )
        self.vocab = min(self.draft_vocab, target_vocab)
        self.kv = stack.kv_cache
        self.bm = BlockManager(self.kv.num_blocks, config.block_size, enable_prefix_caching=False)
        self.runner = stack.runner
        self.shadows: dict[str, _Shadow] = {}
        self.num_forwards = 0

    # -- per-request state ---------------------------------------------------------------
    def discard(self, request_id: str) -> None:
        shadow = self.shadows.pop(request_id, None)
        if shadow is not None:
            self.bm.free_request(shadow.seq)

    def _collect_garbage(self) -> None:
        """Free the draft cache of requests that finished or left the GPU (preempted)."""
        for rid, shadow in list(self.shadows.items()):
            if shadow.source.status is not RequestStatus.RUNNING:
                self.discard(rid)

    def _map(self, tokens: list[int]) -> list[int]:
        # Target ids the draft embedding table lacks (vocab padding) are never sampled in
        # practice; feed 0 so the draft stays usable. Only draft quality could suffer.
        dv = self.draft_vocab
        return [t if t < dv else 0 for t in tokens]

    def _sync(self, req: Request) -> _Shadow:
        tokens = req.all_token_ids
        shadow = self.shadows.get(req.request_id)
        if shadow is None:
            seq = Request(req.request_id, self._map(tokens), req.params)
            shadow = self.shadows[req.request_id] = _Shadow(req, seq, len(tokens))
            return shadow
        seq, base = shadow.seq, shadow.synced
        new = self._map(tokens[base:])
        old = seq.all_token_ids[base:]  # last proposal's drafts
        same = 0
        while same < min(len(old), len(new)) and old[same] == new[same]:
            same += 1
        valid = base + same  # leading tokens whose draft KV is still right
        del seq.all_token_ids[valid:]
        seq.all_token_ids.extend(new[same:])
        seq.num_computed_tokens = min(seq.num_computed_tokens, valid, len(tokens) - 1)
        shadow.synced = len(tokens)
        return shadow

    # -- proposing ------------------------------------------------------------------------
    def propose_batch(self, reqs: list[Request], cap: Optional[int] = None) -> list[list[int]]:
        self._collect_garbage()
        out: list[list[int]] = [[] for _ in reqs]
        active: list = []
        drafted = _Drafted()
        for i, req in enumerate(reqs):
            k = max_drafts(req, self.config, cap)
            if k <= 0:
                continue
            shadow = self._sync(req)
            shadow.k, shadow.drafts = k, out[i]
            active.append(shadow)
        while True:
            work = [s for s in active if len(s.drafts) < s.k and s.seq.request_id in self.shadows]
            if not work:
                break
            # Decodes first, then catch-up prefills in chunks of the step budget.
            work.sort(key=lambda s: s.seq.num_tokens - s.seq.num_computed_tokens)
            budget = max(self.config.max_num_batched_tokens, len(work))
            sched = SchedulerOutput()
            for s in work:
                if budget <= 0:
                    break
                n = min(s.seq.num_tokens - s.seq.num_computed_tokens, budget)
                if not self.bm.can_allocate(s.seq, n):
                    self.discard(s.seq.request_id)  # keep what it has drafted so far
                    continue
                self.bm.allocate(s.seq, n)
                sched.scheduled.append(ScheduledRequest(s.seq, n))
                budget -= n
            if not sched.scheduled:
                break
            self._forward(sched, work, drafted)
        self._resolve(drafted)
        return out

    def _forward(self, sched: SchedulerOutput, work: list, drafted: "_Drafted") -> None:
        """One draft forward; each row it samples appends a placeholder for its token (the
        argmax, left on the device), which a later forward reads as its input."""
        batch = self.runner.prepare(sched)
        drafted.patch(batch, sched, self.runner.upload)
        logits = self.runner.run(batch)
        self.num_forwards += 1
        num_rows = sum(len(rows) for rows in batch.sample_rows)
        first = drafted.add(logits[:num_rows, : self.vocab].argmax(dim=-1))
        by_id = {id(s.seq): s for s in work}
        for item, rows in zip(sched.scheduled, batch.sample_rows):
            s = by_id[id(item.request)]
            s.seq.num_computed_tokens += item.num_new_tokens
            if rows:
                placeholder = _placeholder(first)
                first += 1
                drafted.pending += [(s.seq.all_token_ids, len(s.seq.all_token_ids))]
                drafted.pending += [(s.drafts, len(s.drafts))]
                s.seq.all_token_ids.append(placeholder)
                s.drafts.append(placeholder)

    def _resolve(self, drafted: "_Drafted") -> None:
        """The proposal's drafts back from the device in one copy, into every list that holds
        their placeholders."""
        if not drafted.tokens:
            return
        fetch = DeviceToHost(drafted.tokens[0].device, self.runner.upload.staged)
        values = fetch.add(torch.cat(drafted.tokens))
        fetch.fetch()
        tokens = values.value.tolist()
        for holder, index in drafted.pending:
            holder[index] = tokens[-1 - holder[index]]


def _placeholder(index: int) -> int:
    """A draft token still on the device (``index`` in the proposal's drafts): negative."""
    return -1 - index


@dataclass
class _Drafted:
    """A proposal's draft tokens on the device, and the host lists awaiting their values."""

    tokens: list[torch.Tensor] = field(default_factory=list)  # per forward
    pending: list[tuple[list[int], int]] = field(default_factory=list)  # (list, index)
    count: int = 0

    def add(self, tokens: torch.Tensor) -> int:
        """Register a forward's tokens; the proposal-wide index of the first."""
        first = self.count
        self.tokens.append(tokens)
        self.count += tokens.shape[0]
        return first

    def patch(self, batch: StepBatch, sched: SchedulerOutput, upload) -> None:
        """Put the draft tokens the batch's input holds as placeholders into its input ids."""
        rows, sources, row0 = [], [], 0
        for item in sched.scheduled:
            start = item.request.num_computed_tokens
            new = item.request.all_token_ids[start : start + item.num_new_tokens]
            for j, token in enumerate(new):
                if token < 0:
                    rows.append(row0 + j)
                    sources.append(-1 - token)
            row0 += item.num_new_tokens
        if not rows:
            return
        at, source = upload.upload([np.asarray(rows, np.int64), np.asarray(sources, np.int64)])
        drafted = torch.cat(self.tokens) if len(self.tokens) > 1 else self.tokens[0]
        batch.input_ids.index_copy_(0, at, drafted.index_select(0, source).to(torch.long))


def make_proposer(
    config: EngineConfig,
    draft_stack: Callable[[], ModelStack],
    target_vocab: int,
    tokenizer_size: int,
) -> Optional[Proposer]:
    """``draft_stack`` builds the draft model's stack, only when the method needs one."""
    if config.speculative_method is None:
        return None
    if config.speculative_method == "ngram":
        return NgramProposer(config)
    if config.speculative_method == "draft":
        return DraftModelProposer(config, draft_stack(), target_vocab, tokenizer_size)
    raise ValueError(f"unknown speculative_method {config.speculative_method!r}")
