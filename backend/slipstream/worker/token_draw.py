"""Drawing one token per sampled row, for the whole batch at once.

Temperature, top-k, min-p and top-p are applied to every sampled row together; each row's
token is then picked by inverse transform from ONE uniform number per row (drawn by the
caller: a seeded request's from its own generator), so no row needs a pass of random numbers
over the vocabulary, and a row's token depends only on its own logits and its own number.

Top-p without sorting the vocabulary: tokens less likely than
``tail = (1 - top_p) * mass / (2 * vocab)`` can never be in the nucleus (together they hold
less than half of the ``1 - top_p`` the nucleus leaves out), so only the tokens at or above
``max(tail, min_p threshold)`` (top-k rows: the k most likely) are ranked, with one
``topk`` over the batch. The result is exactly the distribution ``Sampler.probabilities``
describes (up to float rounding), whatever the shape of the distribution; a flat one only
makes the ranked set larger.
"""
from __future__ import annotations

import torch

from slipstream.core.sampling_params import SamplingParams

_FINITE = torch.finfo(torch.float32).max


def sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                uniforms: torch.Tensor) -> torch.Tensor:
    """``logits [S, V]`` (penalties applied), ``params[i]`` and ``uniforms[i]`` (float64 in
    [0, 1)) for row i: one token id per row."""
    vocab = logits.shape[-1]
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    probs = torch.softmax((logits / temps[:, None]).clamp_(max=_FINITE), dim=-1)
    truncated = [i for i, p in enumerate(params) if p.top_p < 1.0 or 0 < p.top_k < vocab]
    if len(truncated) == len(params):
        return _draw_ranked(probs, params, uniforms)
    tokens = torch.empty(len(params), dtype=torch.long)
    whole = [i for i in range(len(params)) if i not in set(truncated)]
    tokens[whole] = _draw_whole(probs[whole], [params[i] for i in whole], uniforms[whole])
    if truncated:
        tokens[truncated] = _draw_ranked(probs[truncated], [params[i] for i in truncated],
                                         uniforms[truncated])
    return tokens


def _min_p_floor(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor | None:
    """Per row, the probability below which min_p drops a token (None: no row uses min_p)."""
    if not any(p.min_p > 0.0 for p in params):
        return None
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
    return min_p * probs.amax(dim=-1)


def _pick(weights: torch.Tensor, uniforms: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Inverse transform per row over non-negative ``weights``: the first position whose
    cumulative weight exceeds u x total (a zero weight is never picked), at most ``last``
    (u x total rounding up to the total)."""
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)
    target = (uniforms * cdf[:, -1])[:, None]
    return torch.minimum(torch.searchsorted(cdf, target, right=True)[:, 0], last)


def _draw_whole(probs: torch.Tensor, params: list[SamplingParams],
                uniforms: torch.Tensor) -> torch.Tensor:
    """Rows without top-k or top-p: the whole vocabulary (min_p masked), in vocabulary order."""
    floor = _min_p_floor(probs, params)
    if floor is not None:
        probs = probs.masked_fill(probs < floor[:, None], 0.0)
    positions = torch.arange(probs.shape[-1])
    last = torch.where(probs > 0, positions, 0).amax(dim=-1)  # the last token that can be drawn
    return _pick(probs, uniforms, last)


def _draw_ranked(probs: torch.Tensor, params: list[SamplingParams],
                 uniforms: torch.Tensor) -> torch.Tensor:
    """Rows with top-k and/or top-p: their candidates ranked by one ``topk``, each rule a
    prefix of that ranking."""
    vocab = probs.shape[-1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64)
    has_k = top_k > 0
    floor = _min_p_floor(probs, params)
    kept = probs if floor is None else probs.masked_fill(probs < floor[:, None], 0.0)
    mass = kept.sum(dim=-1, dtype=torch.float64)  # what top-p measures against (no top-k)
    tail = torch.where(has_k | (top_p >= 1.0), 0.0, (1.0 - top_p) * mass / (2 * vocab))
    threshold = tail.float() if floor is None else torch.maximum(floor, tail.float())
    count = (probs >= threshold[:, None]).sum(dim=-1)
    count = torch.where(has_k, torch.minimum(count, top_k), count).clamp_(min=1)
    values, ids = probs.topk(int(count.max()), dim=-1)  # sorted, most likely first
    ranks = torch.arange(values.shape[-1])
    values = values.masked_fill(ranks[None, :] >= count[:, None], 0.0)
    # top-k rows: top-p over the top-k set renormalised; the others: over the whole vocabulary
    denom = torch.where(has_k, values.sum(dim=-1, dtype=torch.float64), mass)
    before = values.cumsum(dim=-1, dtype=torch.float64) - values
    outside = (before > (top_p * denom)[:, None]) & (top_p < 1.0)[:, None]
    values = values.masked_fill(outside, 0.0)
    last = (values > 0).sum(dim=-1).clamp_(min=1) - 1  # kept tokens are a prefix
    return ids.gather(1, _pick(values, uniforms, last)[:, None])[:, 0]
