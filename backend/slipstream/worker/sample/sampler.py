"""Batched sampling with per-request parameters.

Seeded requests draw from their own ``torch.Generator``, so the same seed gives the same
tokens whatever else shares the batch. Logprobs are the model's (before temperature and
penalties), as vLLM reports them; a request that asked for ``logprobs=N`` also gets each
sampled token's rank and the top-N alternatives (``TokenLogprob``).

Order per row, as vLLM applies them: vocabulary constraints (``allowed_token_ids``,
``bad_words``, ``logit_bias``), the structured-output grammar mask, ``min_tokens``, penalties,
then temperature, top-k, top-p and
``min_p`` for sampled requests.

Fail-soft: when the batched sample raises, the rows are sampled again one by one (with the
random generators rewound) and only the requests whose own rows fail are reported, in a
``PerRequestError`` that still carries the tokens of every other row.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Protocol

import numpy as np
import torch

from slipstream.core.request import Request, TokenLogprob
from slipstream.core.sampling_params import SamplingParams
from slipstream.worker.sample.structured_output import apply_grammar_masks
from slipstream.worker.sample.token_draw import compiled, sample_rows
from slipstream.worker.transfer import DeviceToHost, HostToDevice

_FINITE = torch.finfo(torch.float32).max
PLACEHOLDER_TOKEN = 0  # the token a failed row holds; it must never be appended


@dataclass
class SampleResult:
    token_ids: list  # one per logits row
    logprobs: list  # logprob of each sampled token under the raw model distribution


@dataclass
class _RawLogprobs:
    """What the sampled tokens' logprobs under the raw model distribution need, taken before
    the constraints change rows in place: each row's log-sum-exp (a sampled token's logprob is
    its raw logit less that), copies of the rows constraints or a grammar will change, and the
    full log-softmax only of the rows whose requests asked for ranks and alternatives."""

    logits: torch.Tensor  # [R, V]; rows not in ``changed`` stay raw
    lse: torch.Tensor  # [R]
    changed: list[int]
    changed_rows: Optional[torch.Tensor]  # raw copies of those rows
    ranked: list[int]  # rows with params.logprobs set
    ranked_rows: Optional[torch.Tensor]  # their log-softmax

    @classmethod
    def capture(
        cls, logits: torch.Tensor, reqs: list, lse: Optional[torch.Tensor] = None
    ) -> "_RawLogprobs":
        changed = [
            i
            for i, r in enumerate(reqs)
            if r.params.uses_vocabulary_constraints or getattr(r, "grammar", None) is not None
        ]
        ranked = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        return cls(
            logits,
            torch.logsumexp(logits, dim=-1) if lse is None else lse,
            changed,
            logits[changed].clone() if changed else None,
            ranked,
            torch.log_softmax(logits[ranked], dim=-1) if ranked else None,
        )

    def of(self, tokens: torch.Tensor, reqs: list) -> list:
        picked = self.logits.gather(1, tokens[:, None])[:, 0]
        if self.changed:
            assert self.changed_rows is not None  # captured with ``changed``
            picked[self.changed] = self.changed_rows.gather(1, tokens[self.changed][:, None])[:, 0]
        values = (picked - self.lse).tolist()
        if self.ranked:
            ranked_rows = self.ranked_rows
            assert ranked_rows is not None  # captured with ``ranked``
            for n, i in enumerate(self.ranked):
                row = ranked_rows[n]
                values[i] = _ranked(row, float(row[tokens[i]]), reqs[i].params.logprobs)
        return values


@dataclass
class PerRequestError(RuntimeError):
    """Sampling failed for some requests only.

    ``failures`` maps request id -> message for the client; ``result`` holds every row,
    the failed requests' rows set to ``PLACEHOLDER_TOKEN``. The step fails those requests
    and carries on with the other rows."""

    failures: dict = field(default_factory=dict)  # request id -> error message
    result: Optional[SampleResult] = None

    def __post_init__(self) -> None:
        super().__init__("; ".join(f"{rid}: {msg}" for rid, msg in self.failures.items()))


class PendingSample(Protocol):
    def result(self) -> SampleResult:
        """The step's tokens once its ``DeviceToHost`` has fetched; raises
        ``PerRequestError`` when some requests' rows could not be sampled."""


class TokenSampler(Protocol):
    """What the model executor samples with: ``Sampler`` (CPU) or ``DeviceSampler``."""

    def launch(
        self, logits: torch.Tensor, reqs: list, fetch: DeviceToHost, want_logprobs: bool = True
    ) -> PendingSample:
        """Queue the step's sampling; what it reads back goes through ``fetch``."""

    def forget(self, request_id: str) -> None:
        """Drop a finished request's random stream."""

    def beam_logprobs(self, logits: torch.Tensor, reqs: list) -> torch.Tensor:
        """The log-probabilities beam search ranks the rows' continuations on, on the
        logits' device (see ``Sampler.beam_logprobs``)."""


@dataclass
class _Sampled:
    """A sampling already done (the CPU sampler samples where the logits are)."""

    done: Optional[SampleResult] = None
    error: Optional[PerRequestError] = None

    def result(self) -> SampleResult:
        if self.error is not None:
            raise self.error
        assert self.done is not None  # one of the two is set
        return self.done


def _logit_stats(logits: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(each row's argmax, its log-sum-exp) in one compiled pass over the rows, or
    (None, None) where the compiled kernels do not take these logits (torch's operators then)."""
    if not compiled(logits):
        return None, None
    top, lse = torch.ops.slipstream_cpu.logit_stats(logits)
    return top, lse


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)

    def _generator(self, req: Request) -> torch.Generator:
        if req.params.seed is None:
            return self.generator
        gen = self._request_generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator().manual_seed(req.params.seed)
            self._request_generators[req.request_id] = gen
        return gen

    def __call__(
        self, logits: torch.Tensor, reqs: list, want_logprobs: bool = True
    ) -> SampleResult:
        """``logits [R, V]`` with ``reqs[i]`` owning row i (a request may own several rows
        when drafts are verified; penalties then use its tokens so far).

        Raises ``PerRequestError`` when some requests' rows cannot be sampled."""
        logits = logits.float().cpu()
        saved = self._generator_states(reqs)
        try:
            return self._sample(logits, reqs, want_logprobs)
        except Exception:  # noqa: BLE001 - which rows are to blame is found below
            self._restore(saved)
            return self._sample_rows_apart(logits, reqs, want_logprobs)

    def launch(
        self, logits: torch.Tensor, reqs: list, fetch: DeviceToHost, want_logprobs: bool = True
    ) -> _Sampled:
        """``TokenSampler.launch``: samples at once (nothing to bring back on CPU)."""
        try:
            return _Sampled(self(logits, reqs, want_logprobs))
        except PerRequestError as err:
            return _Sampled(error=err)

    def _generator_states(self, reqs: list) -> list:
        gens = {id(g): g for g in (self._generator(r) for r in reqs if not r.params.greedy)}
        return [(g, g.get_state()) for g in gens.values()]

    @staticmethod
    def _restore(saved: list) -> None:
        for gen, state in saved:
            gen.set_state(state)

    def _sample_rows_apart(
        self, logits: torch.Tensor, reqs: list, want_logprobs: bool
    ) -> SampleResult:
        """Each request's rows alone, in order (so seeded generators advance as in a batch)."""
        tokens, logprobs, failures = [], [], {}
        for i, req in enumerate(reqs):
            if req.request_id in failures:
                row = None
            else:
                try:
                    row = self._sample(logits[i : i + 1].clone(), [req], want_logprobs)
                except Exception as exc:  # noqa: BLE001 - reported to that request only
                    failures[req.request_id] = f"sampling failed: {exc}"
                    row = None
            tokens.append(PLACEHOLDER_TOKEN if row is None else row.token_ids[0])
            if want_logprobs:
                logprobs.append(0.0 if row is None else row.logprobs[0])
        result = SampleResult(tokens, logprobs)
        if failures:
            raise PerRequestError(failures, result)
        return result  # the batch failed but no row alone does: it was not one request's fault

    def _sample(self, logits: torch.Tensor, reqs: list, want_logprobs: bool) -> SampleResult:
        top, lse = _logit_stats(logits)
        raw = _RawLogprobs.capture(logits, reqs, lse)
        if torch.isnan(raw.lse).any():  # argmax would pick the NaN: a token of nothing
            raise FloatingPointError("the model produced NaN logits")
        self._apply_constraints(logits, reqs)
        apply_grammar_masks(logits, reqs)  # structured outputs: their rows only
        penalized = self._apply_penalties(logits, reqs)
        # the raw rows' argmax holds while nothing changed them
        unchanged = not raw.changed and penalized is logits
        tokens = self._draw(penalized, reqs, top if unchanged else None)
        return SampleResult(tokens.tolist(), raw.of(tokens, reqs) if want_logprobs else [])

    def _draw(
        self, logits: torch.Tensor, reqs: list, top: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """One token per row: argmax for greedy rows (``top``: the rows' argmax, known
        already); one batched pass for sampled rows."""
        sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if not sampled:
            return logits.argmax(dim=-1) if top is None else top
        tokens = torch.empty(len(reqs), dtype=torch.long)
        greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
        if greedy:
            tokens[greedy] = (logits[greedy].argmax(dim=-1)) if top is None else top[greedy]
        rows = logits if len(sampled) == len(reqs) else logits[sampled]
        params = [reqs[i].params for i in sampled]
        drawn = sample_rows(rows, params, self._uniforms([reqs[i] for i in sampled]))
        if (drawn < 0).any():  # the kernel found a NaN that the penalties made
            raise FloatingPointError("sampling produced NaN probabilities")
        tokens[sampled] = drawn
        return tokens

    def _uniforms(self, reqs: list) -> torch.Tensor:
        """One uniform in [0, 1) per sampled row, float64: a seeded request's from its own
        generator (in row order, so a request verifying drafts draws once per row), the others'
        in one draw from the engine's generator (torch.rand of n equals n draws of one)."""
        u = torch.empty(len(reqs), dtype=torch.float64)
        shared = [i for i, r in enumerate(reqs) if r.params.seed is None]
        if shared:
            u[shared] = torch.rand(len(shared), generator=self.generator, dtype=torch.float64)
        for i, req in enumerate(reqs):
            if req.params.seed is not None:
                u[i] = torch.rand(1, generator=self._generator(req), dtype=torch.float64)[0]
        return u

    def beam_logprobs(self, logits: torch.Tensor, reqs: list) -> torch.Tensor:
        """The log-probabilities beam search ranks each slot's continuations on: the model's
        distribution after what TensorRT-LLM applies to beams too (allowed ids, bad words,
        logit bias, the repetition / presence / frequency penalties on the slot's own tokens,
        EOS and stop tokens blocked before ``min_tokens``), at the request's temperature
        (0: none). ``SamplingParams`` refuses the truncations it does not apply (top-k, top-p,
        min-p)."""
        logits = logits.float().cpu().clone()
        self._apply_constraints(logits, reqs)
        logits = self._apply_penalties(logits, reqs)
        temperatures = torch.tensor([r.params.temperature or 1.0 for r in reqs])
        return torch.log_softmax(logits / temperatures.unsqueeze(1), dim=-1)

    @staticmethod
    def probabilities(logits: torch.Tensor, req: Request) -> torch.Tensor:
        """The distribution a non-greedy request samples from (temperature, top-k, min-p,
        top-p) over the whole vocabulary: the reference the batched ``sample_rows`` draws from
        (it never builds this)."""
        p = req.params
        scaled = (logits / p.temperature).clamp(max=_FINITE)  # -inf (blocked) stays
        if p.top_k > 0 and p.top_k < scaled.numel():
            kth = torch.topk(scaled, p.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
            probs /= probs.sum()
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            cumulative = sorted_probs.cumsum(0)
            drop = cumulative - sorted_probs > p.top_p  # keep the smallest set reaching top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
            probs /= probs.sum()
        return probs

    @staticmethod
    def _apply_constraints(logits: torch.Tensor, reqs: list) -> None:
        """allowed_token_ids, bad_words and logit_bias, in place (rows of one request that
        verify draft tokens each see the drafts before them as generated)."""
        for i, req, generated in vocabulary_constrained(reqs):
            p = req.params
            if p.allowed_token_ids:
                keep = torch.tensor(p.allowed_token_ids, dtype=torch.long)
                masked = torch.full_like(logits[i], float("-inf"))
                masked[keep] = logits[i, keep]
                logits[i] = masked
            if p.bad_words_token_ids:
                banned = banned_next_tokens(p.bad_words_token_ids, generated())
                if banned:
                    logits[i, banned] = float("-inf")
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
                logits[i, ids] += torch.tensor(list(p.logit_bias.values()))

    def _apply_penalties(self, logits: torch.Tensor, reqs: list) -> torch.Tensor:
        """A penalized copy (the caller's logits stay as they are for a per-row retry): the
        (row, token) pairs of every row are gathered into one index, so each penalty is one
        gather and one scatter over the batch."""
        vocab = logits.shape[-1]
        blocked = [(i, self._blocked_tokens(r, vocab)) for i, r in enumerate(reqs)]
        blocked = [(i, ids) for i, ids in blocked if ids]
        repeat = [i for i, r in enumerate(reqs) if r.params.repetition_penalty != 1.0]
        counted = [
            i
            for i, r in enumerate(reqs)
            if (r.params.presence_penalty or r.params.frequency_penalty) and r.num_output_tokens
        ]
        if not (blocked or repeat or counted):
            return logits
        logits = logits.clone()
        for i, ids in blocked:
            logits[i, ids] = float("-inf")
        flat = logits.view(-1)
        if repeat:
            index = _flat_index(repeat, [reqs[i].all_token_ids for i in repeat], vocab).unique()
            rows = index // vocab
            penalty = torch.tensor([r.params.repetition_penalty for r in reqs])[rows]
            vals = flat[index]
            flat[index] = torch.where(vals > 0, vals / penalty, vals * penalty).clamp(
                -_FINITE, _FINITE
            )
        if counted:
            index, counts = _flat_index(
                counted, [reqs[i].output_token_ids for i in counted], vocab
            ).unique(return_counts=True)
            rows = index // vocab
            freq = torch.tensor([r.params.frequency_penalty for r in reqs])[rows]
            presence = torch.tensor([r.params.presence_penalty for r in reqs])[rows]
            flat[index] -= freq * counts.float() + presence
        return logits

    @staticmethod
    def _blocked_tokens(req: Request, vocab: int) -> Optional[list]:
        """Before ``min_tokens``, EOS and stop tokens cannot be sampled (an id the model
        cannot produce needs no blocking)."""
        p = req.params
        if req.num_output_tokens >= p.min_tokens:
            return None
        blocked = [t for t in p.stop_token_ids if t < vocab]
        if req.eos_token_id is not None and not p.ignore_eos and req.eos_token_id < vocab:
            blocked.append(req.eos_token_id)
        return blocked or None


def _flat_index(rows: list[int], token_lists: list[list[int]], vocab: int) -> torch.Tensor:
    """Positions ``row * vocab + token`` in the flattened logits of each row's tokens (ids
    the logits do not cover are left out)."""
    lengths = torch.tensor([len(t) for t in token_lists])
    tokens = torch.tensor([t for ts in token_lists for t in ts], dtype=torch.long)
    owner = torch.repeat_interleave(torch.tensor(rows), lengths)
    inside = tokens < vocab
    return (owner * vocab + tokens)[inside]


def _ranked(row_logprobs: torch.Tensor, sampled: float, top_n: int) -> TokenLogprob:
    """The sampled logprob with its vocabulary rank (1 = most likely; ties share the worse
    rank, as vLLM counts) and the top-N alternatives."""
    rank = int((row_logprobs >= sampled).sum())
    top: tuple[tuple[int, float], ...] = ()
    if top_n > 0:
        values, ids = torch.topk(row_logprobs, min(top_n, row_logprobs.numel()))
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(sampled, rank, top)


class PromptLogprobs:
    """vLLM's ``prompt_logprobs`` of one request's rows, worked out where the logits are: row
    j of ``logits`` scores prompt token ``first + j``; each entry is that token's logprob under
    the raw model distribution, its rank and the top-N. ``result()`` once ``fetch`` fetched."""

    def __init__(
        self,
        logits: torch.Tensor,
        prompt_token_ids: list[int],
        first: int,
        top_n: int,
        upload: HostToDevice,
        fetch: DeviceToHost,
    ) -> None:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        targets = upload.tensor(prompt_token_ids[first : first + logprobs.shape[0]], np.int64)
        values = logprobs.gather(1, targets[:, None])
        self.values = fetch.add(values[:, 0])
        self.ranks = fetch.add((logprobs >= values).sum(dim=1))
        self.top = None
        if top_n > 0:
            top_values, top_ids = torch.topk(logprobs, min(top_n, logprobs.shape[1]), dim=-1)
            self.top = (fetch.add(top_ids), fetch.add(top_values))

    def result(self) -> list[TokenLogprob]:
        values, ranks = self.values.value.tolist(), self.ranks.value.tolist()
        tops: list[tuple[tuple[int, float], ...]] = [()] * len(ranks)
        if self.top is not None:
            ids, top_values = (p.value.tolist() for p in self.top)
            tops = [tuple(zip(i, v)) for i, v in zip(ids, top_values)]
        return [TokenLogprob(v, rank, top) for v, rank, top in zip(values, ranks, tops)]


def vocabulary_constrained(reqs: list) -> Iterator[tuple[int, Request, Callable[[], list]]]:
    """The rows whose requests use vocabulary constraints: (row, request, the tokens its bad
    words look back on -- its output and, on a row verifying drafts, the drafts before it)."""
    row_in_request = 0
    for i, req in enumerate(reqs):
        row_in_request = row_in_request + 1 if i and reqs[i - 1] is req else 0
        if req.params.uses_vocabulary_constraints:
            yield i, req, functools.partial(_generated, req, row_in_request)


def _generated(req: Request, drafts: int) -> list:
    return req.output_token_ids + list(req.spec_token_ids[:drafts])


def banned_next_tokens(bad_words_token_ids: list, generated: list) -> list:
    """A bad word's last token is banned when the tokens before it were just generated."""
    banned = []
    for seq in bad_words_token_ids:
        prefix = seq[:-1]
        if not prefix or generated[len(generated) - len(prefix) :] == prefix:
            banned.append(seq[-1])
    return banned


def prepare(params: SamplingParams, tokenizer, vocab_size: int) -> None:
    """Resolve what needs the tokenizer or the vocabulary: range-check token ids (vLLM's
    messages) and tokenize ``bad_words`` (each word alone and after a space, so it is banned at
    the start of the text and inside it)."""
    if params.allowed_token_ids and any(t >= vocab_size for t in params.allowed_token_ids):
        raise ValueError("allowed_token_ids contains out-of-vocab token id!")
    if params.logit_bias:
        invalid = sorted(t for t in params.logit_bias if t >= vocab_size)
        if invalid:
            raise ValueError(
                f"token_id(s) {invalid} in logit_bias contain out-of-vocab token "
                f"ids. Vocabulary size: {vocab_size}"
            )
    sequences = []
    for word in params.bad_words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in sequences:
                sequences.append(ids)
    if any(t >= vocab_size for seq in sequences for t in seq):
        raise ValueError("bad_words contain out-of-vocab token ids")
    params.bad_words_token_ids = sequences
