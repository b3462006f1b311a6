"""Speculative decoding: cheap draft tokens that the target model verifies in one step.

After a request samples a token, a proposer guesses the next ``k`` tokens. The next step
feeds the target the real last token plus the ``k`` drafts; the runner returns logits
for those ``1 + k`` rows and the sampler draws one target token per row. ``LLMEngine._accept``
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
not speculate for requests that use them (see ``LLMEngine._speculates``).

Methods:

* ``ngram`` -- prompt lookup decoding: find the most recent earlier occurrence of the
  last ``n`` tokens (``n`` from ``ngram_prompt_lookup_max`` down to ``_min``) and propose
  what followed it. When the continuation runs into the end of the sequence it is extended
  periodically (the text is assumed to keep repeating), so a loop yields full drafts.
* ``draft`` -- a small model (``speculative_model``, a local HF directory sharing the
  target's tokenizer) decodes greedily on its own paged KV cache, batched: one ragged
  forward brings every request's draft cache up to date and produces its first draft,
  then one forward per further draft token for the whole batch.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from slipstream.core.block_manager import BlockManager
from slipstream.core.config import EngineConfig
from slipstream.core.request import Request, RequestStatus

log = logging.getLogger("slipstream")


def max_drafts(req: Request, config: EngineConfig, cap: Optional[int] = None) -> int:
    """How many drafts are worth proposing: a step appends at most ``drafts + 1`` tokens,
    which must fit both ``max_tokens`` and ``max_model_len``; at most ``cap`` (the step's
    share of the draft rows, ``LLMEngine._draft_cap``)."""
    k = min(config.num_speculative_tokens, req.params.max_tokens - req.num_output_tokens - 1,
            config.max_model_len - req.num_tokens - 1)
    return max(k if cap is None else min(k, cap), 0)


class Proposer:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    def propose(self, req: Request, cap: Optional[int] = None) -> list[int]:
        return self.propose_batch([req], cap)[0]

    def propose_batch(self, reqs: list[Request], cap: Optional[int] = None) -> list[list[int]]:
        return [self.propose(r, cap) for r in reqs]

    def discard(self, request_id: str) -> None:
        """Forget per-request state (no-op for stateless proposers)."""


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
        suffix = arr[length - n:]
        # windows start at 0 .. length-n-1: every occurrence before the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(arr[:length - 1], n)
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

    seq: Request
    synced: int
    k: int = 0
    drafts: list[int] = field(default_factory=list)


class DraftModelProposer(Proposer):
    """Greedy proposals from a small model running on its own paged KV cache."""

    def __init__(self, config: EngineConfig, engine) -> None:
        super().__init__(config)
        from slipstream.worker import model_loader
        from slipstream.worker.kv_cache import KVCache, KVGeometry
        from slipstream.worker.cpu_linear import prepare_linears
        from slipstream.worker.cpu_norm import prepare_norms
        from slipstream.worker.model_runner import ModelRunner

        self.engine = engine
        if config.speculative_model == config.model and engine.model is not None:
            self.model = engine.model  # draft == target: share the weights
        else:
            path = model_loader.resolve_model_path(config.speculative_model)
            self.model = model_loader.load_model(path, engine.dtype, engine.device)
            if engine.device.type == "cpu":
                prepare_linears(self.model, config.cpu_linear)
                prepare_norms(self.model)
        self.draft_vocab = self.model.get_input_embeddings().num_embeddings
        target_vocab = engine.model.get_input_embeddings().num_embeddings
        if self.draft_vocab < len(engine.tokenizer):
            raise ValueError(
                f"the draft model's vocabulary ({self.draft_vocab}) is smaller than the target "
                f"tokenizer's ({len(engine.tokenizer)}): they must share a tokenizer")
        self.vocab = min(self.draft_vocab, target_vocab)
        bs = config.block_size
        geometry = KVGeometry.from_model_config(self.model.config, bs, engine.dtype)
        # Room for everything the target cache can hold plus each sequence's drafts.
        per_seq = -(-(config.num_speculative_tokens + 1) // bs) + 1
        num_blocks = engine.block_manager.num_blocks + config.max_num_seqs * per_seq
        self.kv = KVCache(geometry, num_blocks, engine.device)
        self.bm = BlockManager(num_blocks, bs, enable_prefix_caching=False)
        self.runner = ModelRunner(
            self.model, self.kv, engine.device, config.max_model_len + config.num_speculative_tokens,
            config.max_num_seqs, config.cuda_graph_batch_sizes if config.enable_cuda_graphs else None,
            config.attention_ops, config.fast_forward)
        self.shadows: dict[str, _Shadow] = {}
        self.num_forwards = 0
        log.info("draft model: %d KV blocks, %.1f MiB", num_blocks, self.kv.nbytes / 2**20)

    # -- per-request state ---------------------------------------------------------------
    def discard(self, request_id: str) -> None:
        shadow = self.shadows.pop(request_id, None)
        if shadow is not None:
            self.bm.free_request(shadow.seq)

    def _collect_garbage(self) -> None:
        """Free the draft cache of requests that finished or left the GPU (preempted)."""
        requests = self.engine.requests
        for rid in list(self.shadows):
            req = requests.get(rid)
            if req is None or req.status is not RequestStatus.RUNNING:
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
            shadow = self.shadows[req.request_id] = _Shadow(seq, len(tokens))
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
        from slipstream.core.scheduler_output import ScheduledRequest, SchedulerOutput

        self._collect_garbage()
        out = [[] for _ in reqs]
        active: list = []
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
            logits, sample_rows = self.runner.execute(sched)
            self.num_forwards += 1
            tokens = logits[:, :self.vocab].argmax(dim=-1).tolist() if len(logits) else []
            cursor = 0
            by_id = {id(s.seq): s for s in work}
            for item, rows in zip(sched.scheduled, sample_rows):
                s = by_id[id(item.request)]
                s.seq.num_computed_tokens += item.num_new_tokens
                if rows:
                    token = tokens[cursor]
                    cursor += 1
                    s.seq.all_token_ids.append(token)
                    s.drafts.append(token)
        return out


def make_proposer(config: EngineConfig, engine) -> Optional[Proposer]:
    if config.speculative_method is None:
        return None
    if config.speculative_method == "ngram":
        return NgramProposer(config)
    if config.speculative_method == "draft":
        return DraftModelProposer(config, engine)
    raise ValueError(f"unknown speculative_method {config.speculative_method!r}")
