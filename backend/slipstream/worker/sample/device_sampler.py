"""Sampling on the logits' device (the GPU engine's sampler): everything the CPU ``Sampler``
does, as batched tensor operations, with one device-to-host copy per step.

A step's sampling in three parts:

1. **Host plan** (``_HostPlan``): from the requests alone -- never from device values -- the
   host works out what each row needs: its draw group and parameters, its uniform number
   (``uniform_streams``: a seeded request's own counter-based stream), the flat positions
   ``row * vocab + token`` that vocabulary constraints, ``min_tokens`` and penalties touch
   (with their values), the structured-output bitmask (llguidance runs on the host), the
   rows that asked for ranked logprobs. All of it goes to the device in ONE non-blocking
   copy (``transfer.HostToDevice``).
2. **Device work**: raw log-sum-exp, then on a copy of the logits (only when some row is
   constrained) allowed ids, bad words, logit bias, grammar masks, ``min_tokens`` blocking,
   repetition then frequency / presence penalties -- the CPU sampler's order -- then argmax
   for greedy rows and ``device_draw`` for sampled ones; the sampled tokens' raw logprobs,
   and ranks and top-N only for the rows that asked. Shapes depend on the host plan only.
3. **One copy back** (``transfer.DeviceToHost``, shared with the rest of the step): token
   ids, a status per row (NaN logits, NaN probabilities), the logprobs asked for. The host
   then builds the ``SampleResult``; a row that failed fails its request alone
   (``PerRequestError``), as on the CPU.

Logprobs are the raw model's (before temperature, constraints and penalties), as vLLM
reports them and as the CPU sampler does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from slipstream.core.request import TokenLogprob
from slipstream.worker.sample import device_draw
from slipstream.worker.sample.sampler import (
    PLACEHOLDER_TOKEN,
    PerRequestError,
    SampleResult,
    banned_next_tokens,
    vocabulary_constrained,
)
from slipstream.worker.sample.structured_output import grammar_masks
from slipstream.worker.sample.uniform_streams import Draws, UniformStreams
from slipstream.worker.transfer import DeviceToHost, HostToDevice, HostValue

_FINITE = torch.finfo(torch.float32).max
_OK, _NAN_LOGITS, _NAN_PROBS = 0, 1, 2
_MESSAGES = {
    _NAN_LOGITS: "sampling failed: the model produced NaN logits",
    _NAN_PROBS: "sampling failed: sampling produced NaN probabilities",
}


# the host plan's arrays that change logits (the device work then runs on a copy)
_CHANGES = (
    "allowed_rows",
    "banned",
    "bias_at",
    "grammar_rows",
    "blocked",
    "repeat_at",
    "counted_at",
)


def _flat(rows: list[int], token_lists: list, vocab: int) -> np.ndarray:
    """Positions ``row * vocab + token`` (ids the logits do not cover are left out)."""
    if not rows:
        return np.empty(0, dtype=np.int64)
    lengths = np.asarray([len(t) for t in token_lists], dtype=np.int64)
    tokens = np.fromiter((t for ts in token_lists for t in ts), dtype=np.int64)
    owners = np.repeat(np.asarray(rows, dtype=np.int64), lengths)
    inside = tokens < vocab
    return (owners * vocab + tokens)[inside]


@dataclass
class _HostPlan:
    """What the device work of one step needs, worked out on the host (see the module)."""

    num_rows: int
    vocab: int
    arrays: dict[str, np.ndarray] = field(default_factory=dict)  # uploaded in one copy
    failures: dict[int, str] = field(default_factory=dict)  # row -> why (host-side checks)
    greedy: list[int] = field(default_factory=list)
    groups: list[device_draw.GroupPlan] = field(default_factory=list)
    ranked: list[int] = field(default_factory=list)
    top_n: list[int] = field(default_factory=list)  # per ranked row
    draws: Optional[Draws] = None

    @property
    def changes_logits(self) -> bool:
        return any(name in self.arrays for name in _CHANGES)

    def add(self, name: str, values, dtype) -> None:
        self.arrays[name] = np.asarray(values, dtype=dtype)

    @classmethod
    def build(cls, reqs: list, vocab: int, streams: UniformStreams, ranked: bool) -> "_HostPlan":
        plan = cls(len(reqs), vocab)
        plan._constraints(reqs)
        plan._grammar(reqs)
        plan._penalties(reqs)
        plan._draws(reqs, streams)
        if ranked:
            plan.ranked = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
            plan.top_n = [min(reqs[i].params.logprobs, vocab) for i in plan.ranked]
            if plan.ranked:
                plan.add("ranked", plan.ranked, np.int64)
        return plan

    # -- vocabulary constraints (allowed ids, bad words, logit bias) ----------------------------
    def _constraints(self, reqs: list) -> None:
        allowed_rows: list[int] = []
        allowed: list[int] = []
        banned: list[int] = []
        bias_at: list[int] = []
        bias: list[float] = []
        v = self.vocab
        for i, req, generated in vocabulary_constrained(reqs):
            p = req.params
            if p.allowed_token_ids:
                allowed.extend(len(allowed_rows) * v + t for t in p.allowed_token_ids)
                allowed_rows.append(i)
            if p.bad_words_token_ids:
                banned.extend(
                    i * v + t for t in banned_next_tokens(p.bad_words_token_ids, generated())
                )
            if p.logit_bias:
                bias_at.extend(i * v + t for t in p.logit_bias)
                bias.extend(p.logit_bias.values())
        if allowed_rows:
            self.add("allowed_rows", allowed_rows, np.int64)
            self.add("allowed", allowed, np.int64)
        if banned:
            self.add("banned", banned, np.int64)
        if bias_at:
            self.add("bias_at", bias_at, np.int64)
            self.add("bias", bias, np.float32)

    def _grammar(self, reqs: list) -> None:
        masks = grammar_masks(reqs, self.vocab)
        if masks is None:
            return
        for row, message in masks.failures.items():
            self.failures[row] = f"sampling failed: {message}"
        if masks.rows:
            self.add("grammar_rows", masks.rows, np.int64)
            self.arrays["grammar_bits"] = masks.bitmask

    # -- min_tokens and penalties -----------------------------------------------------------------
    def _penalties(self, reqs: list) -> None:
        v = self.vocab
        blocked: list[int] = []
        for i, req in enumerate(reqs):
            p = req.params
            if req.num_output_tokens >= p.min_tokens:
                continue
            ids = [t for t in p.stop_token_ids if t < v]
            if req.eos_token_id is not None and not p.ignore_eos and req.eos_token_id < v:
                ids.append(req.eos_token_id)
            blocked.extend(i * v + t for t in ids)
        if blocked:
            self.add("blocked", blocked, np.int64)
        repeat = [i for i, r in enumerate(reqs) if r.params.repetition_penalty != 1.0]
        if repeat:
            at = np.unique(_flat(repeat, [reqs[i].all_token_ids for i in repeat], v))
            penalty = np.asarray([r.params.repetition_penalty for r in reqs], dtype=np.float32)
            self.add("repeat_at", at, np.int64)
            self.add("repeat_by", penalty[at // v], np.float32)
        counted = [
            i
            for i, r in enumerate(reqs)
            if (r.params.presence_penalty or r.params.frequency_penalty) and r.num_output_tokens
        ]
        if counted:
            flat = _flat(counted, [reqs[i].output_token_ids for i in counted], v)
            at, counts = np.unique(flat, return_counts=True)
            rows = at // v
            freq = np.asarray([r.params.frequency_penalty for r in reqs], dtype=np.float32)
            presence = np.asarray([r.params.presence_penalty for r in reqs], dtype=np.float32)
            # the CPU sampler's float32 arithmetic, subtracted as the addition of its negation
            delta = freq[rows] * counts.astype(np.float32) + presence[rows]
            self.add("counted_at", at, np.int64)
            self.add("counted_by", -delta, np.float32)

    # -- greedy and sampled rows ------------------------------------------------------------------
    def _draws(self, reqs: list, streams: UniformStreams) -> None:
        sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
        self.greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
        if self.greedy and sampled:
            self.add("greedy", self.greedy, np.int64)
        if not sampled:
            return
        self.draws = streams.draw([reqs[i] for i in sampled])
        params = [reqs[i].params for i in sampled]
        self.groups = device_draw.plan_groups(params, self.draws.values, self.vocab)
        for g in self.groups:  # group rows: positions among the sampled rows -> logits rows
            g.rows = np.asarray(sampled, dtype=np.int64)[g.rows]
        for n, g in enumerate(self.groups):
            for k, a in enumerate(g.arrays()):
                self.arrays[f"group{n}.{k}"] = a


@dataclass
class _Outputs:
    """What the device work leaves for the host (registered with the step's copy back)."""

    tokens: torch.Tensor  # [rows] int64
    status: torch.Tensor  # [rows] int8: _OK, _NAN_LOGITS or _NAN_PROBS
    logprobs: Optional[torch.Tensor] = None  # [rows] the sampled tokens' raw logprobs
    ranks: Optional[torch.Tensor] = None  # [ranked rows]
    ranked_logprobs: Optional[torch.Tensor] = None  # [ranked rows]
    top_values: Optional[torch.Tensor] = None  # [ranked rows, max top-N]
    top_ids: Optional[torch.Tensor] = None

    def register(self, fetch: DeviceToHost) -> dict[str, HostValue]:
        return {name: fetch.add(t) for name, t in vars(self).items() if t is not None}


class DevicePending:
    """A launched sampling step; ``result()`` once the step's ``DeviceToHost`` has fetched."""

    def __init__(
        self, plan: _HostPlan, out: dict[str, HostValue], reqs: list, streams: UniformStreams
    ) -> None:
        self.plan, self.out, self.reqs, self.streams = plan, out, reqs, streams

    def _list(self, name: str) -> list:
        return self.out[name].value.tolist()

    def result(self) -> SampleResult:
        plan, reqs = self.plan, self.reqs
        tokens, status = self._list("tokens"), self._list("status")
        if plan.draws is not None:
            self.streams.commit(plan.draws)
        failures: dict[str, str] = {}
        for i, code in enumerate(status):
            message = plan.failures.get(i) or _MESSAGES.get(code)
            if message is not None:
                failures.setdefault(reqs[i].request_id, message)
        values: list = []
        if "logprobs" in self.out:
            values = self._list("logprobs")
            self._ranked(values)
        if failures:
            for i, req in enumerate(reqs):
                if req.request_id in failures:
                    tokens[i] = PLACEHOLDER_TOKEN
                    if values:
                        values[i] = 0.0
            raise PerRequestError(failures, SampleResult(tokens, values))
        return SampleResult(tokens, values)

    def _ranked(self, values: list) -> None:
        plan = self.plan
        if not plan.ranked:
            return
        ranks, picked = self._list("ranks"), self._list("ranked_logprobs")
        has_top = "top_ids" in self.out
        top_ids = self._list("top_ids") if has_top else []
        top_values = self._list("top_values") if has_top else []
        for n, (i, top_n) in enumerate(zip(plan.ranked, plan.top_n)):
            top: tuple = ()
            if top_n > 0 and has_top:
                top = tuple(zip(top_ids[n][:top_n], top_values[n][:top_n]))
            values[i] = TokenLogprob(picked[n], ranks[n], top)


class DeviceSampler:
    """The sampler of an engine whose logits live on a GPU (see the module). ``staged``:
    run the device protocol on CPU tensors too (tests; default: only off the CPU)."""

    def __init__(self, seed: int = 0, staged: Optional[bool] = None) -> None:
        self.streams = UniformStreams(seed)
        self.staged = staged

    def forget(self, request_id: str) -> None:
        self.streams.forget(request_id)

    def beam_logprobs(self, logits: torch.Tensor, reqs: list) -> torch.Tensor:
        """``Sampler.beam_logprobs`` on the logits' device: constraints, ``min_tokens`` and
        penalties applied as for sampling, at each request's temperature (0: none)."""
        work = penalized_logits(logits, reqs, self.staged)
        temperatures = np.asarray([r.params.temperature or 1.0 for r in reqs], dtype=np.float32)
        (scale,) = HostToDevice(logits.device, self.staged).upload([temperatures])
        return torch.log_softmax(work / scale[:, None], dim=-1)

    def __call__(
        self, logits: torch.Tensor, reqs: list, want_logprobs: bool = True
    ) -> SampleResult:
        """Sample now (its own copy back); raises ``PerRequestError`` as ``Sampler`` does."""
        fetch = DeviceToHost(logits.device, self.staged)
        pending = self.launch(logits, reqs, fetch, want_logprobs)
        fetch.fetch()
        return pending.result()

    def launch(
        self, logits: torch.Tensor, reqs: list, fetch: DeviceToHost, want_logprobs: bool = True
    ) -> DevicePending:
        """Queue the step's sampling on the device and register what it brings back with
        ``fetch``; ``result()`` after ``fetch.fetch()``."""
        logits = logits.float()
        plan = _HostPlan.build(reqs, logits.shape[-1], self.streams, want_logprobs)
        names = list(plan.arrays)
        tensors = HostToDevice(logits.device, self.staged).upload([plan.arrays[n] for n in names])
        dev = dict(zip(names, tensors))
        out = _run(logits, plan, dev, want_logprobs)
        return DevicePending(plan, out.register(fetch), reqs, self.streams)


def _run(logits: torch.Tensor, plan: _HostPlan, dev: dict, want_logprobs: bool) -> _Outputs:
    """The device work (see the module); every tensor here stays on the logits' device."""
    lse = torch.logsumexp(logits, dim=-1)
    work = _constrained(logits, plan, dev) if plan.changes_logits else logits
    tokens, bad_draw = _tokens(work, plan, dev)
    status = torch.where(
        torch.isnan(lse),
        _NAN_LOGITS,
        torch.where(bad_draw, _NAN_PROBS, _OK) if bad_draw is not None else _OK,
    ).to(torch.int8)
    out = _Outputs(tokens, status)
    if want_logprobs:
        out.logprobs = logits.gather(1, tokens[:, None])[:, 0] - lse
        if plan.ranked:
            _rank(logits, tokens, plan, dev, out)
    return out


def _constrained(logits: torch.Tensor, plan: _HostPlan, dev: dict) -> torch.Tensor:
    """A copy with constraints, grammar masks, min_tokens and penalties, in the CPU order."""
    work = logits.clone()
    flat = work.view(-1)
    neg_inf = float("-inf")
    if "allowed_rows" in dev:
        rows = dev["allowed_rows"]
        sub = work.index_select(0, rows)
        keep = torch.zeros(sub.numel(), dtype=torch.bool, device=work.device)
        keep.index_fill_(0, dev["allowed"], True)
        work.index_copy_(0, rows, sub.masked_fill(~keep.view_as(sub), neg_inf))
    if "banned" in dev:
        flat.index_fill_(0, dev["banned"], neg_inf)
    if "bias_at" in dev:
        flat.index_add_(0, dev["bias_at"], dev["bias"])
    if "grammar_rows" in dev:
        rows = dev["grammar_rows"]
        shifts = torch.arange(32, dtype=torch.int32, device=work.device)
        bits = (dev["grammar_bits"][:, :, None] >> shifts) & 1
        blocked = bits.view(bits.shape[0], -1)[:, : plan.vocab] == 0
        work.index_copy_(0, rows, work.index_select(0, rows).masked_fill(blocked, neg_inf))
    if "blocked" in dev:
        flat.index_fill_(0, dev["blocked"], neg_inf)
    if "repeat_at" in dev:
        at, by = dev["repeat_at"], dev["repeat_by"]
        vals = flat.index_select(0, at)
        penalized = torch.where(vals > 0, vals / by, vals * by).clamp(-_FINITE, _FINITE)
        flat.index_copy_(0, at, penalized)
    if "counted_at" in dev:
        flat.index_add_(0, dev["counted_at"], dev["counted_by"])
    return work


def _tokens(
    work: torch.Tensor, plan: _HostPlan, dev: dict
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(token per row, rows whose draw failed or None): argmax for greedy rows, the batched
    draw for sampled ones."""
    if not plan.groups:
        return work.argmax(dim=-1), None
    tokens = torch.empty(plan.num_rows, dtype=torch.long, device=work.device)
    bad = torch.zeros(plan.num_rows, dtype=torch.bool, device=work.device)
    if plan.greedy:
        rows = dev["greedy"]
        tokens.index_copy_(0, rows, work.index_select(0, rows).argmax(dim=-1))
    for n, g in enumerate(plan.groups):
        group = device_draw.bind(g, [dev[f"group{n}.{k}"] for k in range(len(g.arrays()))])
        drawn, ok = device_draw.draw(work, group)
        tokens.index_copy_(0, group.rows, drawn)
        bad.index_copy_(0, group.rows, ~ok)
    return tokens, bad


def _rank(
    logits: torch.Tensor, tokens: torch.Tensor, plan: _HostPlan, dev: dict, out: _Outputs
) -> None:
    """Ranks and top-N of the rows that asked, from their raw log-softmax (as the CPU
    sampler ranks them: ties share the worse rank)."""
    rows = dev["ranked"]
    logprobs = torch.log_softmax(logits.index_select(0, rows), dim=-1)
    picked = logprobs.gather(1, tokens.index_select(0, rows)[:, None])
    out.ranks = (logprobs >= picked).sum(dim=-1)
    out.ranked_logprobs = picked[:, 0]
    top_n = max(plan.top_n)
    if top_n > 0:
        out.top_values, out.top_ids = logprobs.topk(top_n, dim=-1)


def penalized_logits(
    logits: torch.Tensor, reqs: list, staged: Optional[bool] = None
) -> torch.Tensor:
    """The logits as the device draw sees them: vocabulary constraints, grammar masks,
    ``min_tokens`` and penalties applied (on a copy), as the CPU sampler applies them."""
    plan = _HostPlan.build(reqs, logits.shape[-1], UniformStreams(), ranked=False)
    names = list(plan.arrays)
    tensors = HostToDevice(logits.device, staged).upload([plan.arrays[n] for n in names])
    return _constrained(logits.float(), plan, dict(zip(names, tensors)))


def sampler_for(device: torch.device, seed: int):
    """The engine's sampler for its device: the compiled CPU sampler on CPU, this one
    elsewhere."""
    from slipstream.worker.sample.sampler import Sampler

    return Sampler(seed) if device.type == "cpu" else DeviceSampler(seed)
