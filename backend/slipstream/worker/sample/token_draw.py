"""Drawing one token per sampled row, for the whole batch at once.

Temperature, top-k, min-p and top-p are applied to every sampled row together; each row's
token is then picked by inverse transform from ONE uniform number per row (drawn by the
caller: a seeded request's from its own generator), so no row needs a pass of random numbers
over the vocabulary, and a row's token depends only on its own logits and its own number.

Top-p without sorting the vocabulary. A small model's nucleus at top_p 0.95 holds thousands
of tokens (SmolLM2-135M at temperature 0.8: 3,000-6,000 of 49,152), so a full sort per row
(~6 ms on one core) or a ``topk`` of the nucleus is what costs. Instead each row's
probabilities are binned by their log (``BIN_WIDTH`` nats below the row's most likely token,
one ``bincount`` for the batch gives each bin's mass), the bin where the cumulative mass
crosses top_p is found, and only that bin's tokens (tens to a few hundred) are sorted to
find the exact threshold ``t``: the nucleus is every token with probability >= ``t``. This
is the set ``Sampler.probabilities`` keeps, except that tokens tied exactly with the last
one kept are all kept.

Rows with top-k rank their k most likely tokens with one ``topk``; top-p then applies within.

Where the project's compiled CPU kernels load (``kernels/csrc/cpu_sampling.cpp``), all of this
runs there instead, a row per task with its working copy in the core's cache (the torch
operators below each stream the whole batch through memory: ~1 ms per operator at 32 rows on
one core here); the same rules, the same uniforms.
"""

from __future__ import annotations

import torch

from slipstream.core.sampling_params import SamplingParams

_FINITE = torch.finfo(torch.float32).max
BIN_WIDTH = 0.05  # nats of log-probability per bin
NUM_BINS = 640  # 32 nats: what lies below is one last bin (mass below e^-32 of the top)


def sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor
) -> torch.Tensor:
    """``logits [S, V]`` (penalties applied), ``params[i]`` and ``uniforms[i]`` (float64 in
    [0, 1)) for row i: one token id per row."""
    vocab = logits.shape[-1]
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    if compiled(logits):
        return torch.ops.slipstream_cpu.sample_rows(
            logits,
            temps,
            torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params]),
            torch.tensor([p.top_p for p in params], dtype=torch.float64),
            torch.tensor([p.min_p for p in params], dtype=torch.float32),
            uniforms,
        )
    scaled = (logits / temps[:, None]).clamp_(max=_FINITE)
    probs = torch.softmax(scaled, dim=-1)
    groups: dict[str, list[int]] = {"whole": [], "nucleus": [], "top_k": []}
    for i, p in enumerate(params):
        kind = "top_k" if 0 < p.top_k < vocab else "nucleus" if p.top_p < 1.0 else "whole"
        groups[kind].append(i)
    draw = {"whole": _draw_whole, "nucleus": _draw_nucleus, "top_k": _draw_top_k}
    tokens = torch.empty(len(params), dtype=torch.long)
    for kind, rows in groups.items():
        if len(rows) == len(params):
            return draw[kind](scaled, probs, params, uniforms)
        if rows:
            tokens[rows] = draw[kind](
                scaled[rows], probs[rows], [params[i] for i in rows], uniforms[rows]
            )
    return tokens


def compiled(logits: torch.Tensor) -> bool:
    """Whether the compiled sampling kernels take these logits (CPU float32, kernels built)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return False
    from slipstream.worker import kernels

    return kernels.load()


def _min_p(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``probs`` with what min_p drops set to 0 (the same tensor when no row uses min_p)."""
    if not any(p.min_p > 0.0 for p in params):
        return probs
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
    floor = min_p * probs.amax(dim=-1)
    return probs.masked_fill(probs < floor[:, None], 0.0)


def _pick(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse transform per row over non-negative ``weights``: the first position whose
    cumulative weight exceeds u x total (a zero weight is never picked; where u x total
    rounds up to the total, the last position with a weight)."""
    cdf = weights.cumsum(dim=-1)
    target = (uniforms * cdf[:, -1].double()).float()[:, None]
    picked = torch.searchsorted(cdf, target, right=True)[:, 0]
    over = (picked >= weights.shape[-1]).nonzero()[:, 0].tolist()
    for row in over:
        picked[row] = weights[row].nonzero()[-1, 0]
    return picked


def _draw_whole(
    scaled: torch.Tensor, probs: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor
) -> torch.Tensor:
    """Neither top-k nor top-p: the whole vocabulary (min_p applied)."""
    return _pick(_min_p(probs, params), uniforms)


def _draw_top_k(
    scaled: torch.Tensor, probs: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor
) -> torch.Tensor:
    """The k most likely tokens by one ``topk`` (renormalised over them, as top-k masks the
    logits before the softmax), then min_p and top-p within them: each rule keeps a prefix."""
    top_k = torch.tensor([p.top_k for p in params])
    values, ids = probs.topk(int(top_k.max()), dim=-1)  # most likely first
    ranks = torch.arange(values.shape[-1])
    values = values.masked_fill(ranks[None, :] >= top_k[:, None], 0.0)
    values = _min_p(values, params)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64)
    before = values.cumsum(dim=-1, dtype=torch.float64) - values
    total = values.sum(dim=-1, dtype=torch.float64)
    outside = (before > (top_p * total)[:, None]) & (top_p < 1.0)[:, None]
    values = values.masked_fill(outside, 0.0)
    return ids.gather(1, _pick(values, uniforms)[:, None])[:, 0]


def _draw_nucleus(
    scaled: torch.Tensor, probs: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor
) -> torch.Tensor:
    """top-p (and min_p) over the whole vocabulary: the threshold from the binned masses."""
    probs = _min_p(probs, params)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64)
    threshold = nucleus_threshold(scaled, probs, top_p)
    return _pick(probs.masked_fill(probs < threshold[:, None], 0.0), uniforms)


def nucleus_threshold(
    scaled: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Per row, the smallest probability in the nucleus: the most likely tokens whose mass
    before each is at most ``top_p`` x the row's mass (``probs`` may hold zeros: dropped)."""
    rows, vocab = probs.shape
    bins = (scaled.amax(dim=-1, keepdim=True) - scaled).mul_(1.0 / BIN_WIDTH)
    bins = bins.clamp_(max=NUM_BINS - 1).to(torch.int32)
    bins += (torch.arange(rows, dtype=torch.int32) * NUM_BINS)[:, None]
    mass = torch.bincount(bins.view(-1), weights=probs.view(-1), minlength=rows * NUM_BINS)
    cumulative = mass.view(rows, NUM_BINS).to(torch.float64).cumsum(dim=-1)
    limit = top_p * cumulative[:, -1]
    crossing = torch.searchsorted(cumulative, limit[:, None], right=True)[:, 0]
    crossing.clamp_(max=NUM_BINS - 1)
    above = torch.where(
        crossing > 0, cumulative.gather(1, (crossing - 1).clamp(min=0)[:, None])[:, 0], 0.0
    )
    # the crossing bin's tokens, ranked within their row: row first, most likely first
    bin_id = (crossing + torch.arange(rows) * NUM_BINS).to(torch.int32)
    row, col = ((bins == bin_id[:, None]) & (probs > 0)).nonzero(as_tuple=True)
    values = probs[row, col].to(torch.float64)
    order = torch.argsort(row.to(torch.float64) * 2.0 + (1.0 - values))
    row, values = row[order], values[order]
    counts = torch.bincount(row, minlength=rows)
    starts = torch.cumsum(counts, dim=0) - counts
    running = torch.cumsum(values, dim=0)
    offset = (
        torch.where(
            counts > 0,
            running[starts.clamp(max=len(values) - 1)] - values[starts.clamp(max=len(values) - 1)],
            0.0,
        )
        if len(values)
        else torch.zeros(rows, dtype=torch.float64)
    )
    before = running - values - offset[row] + above[row]
    kept = before <= limit[row]
    threshold = torch.full((rows,), float("inf"), dtype=torch.float64)
    threshold.scatter_reduce_(0, row[kept], values[kept], reduce="amin")
    # a row whose crossing bin kept nothing (rounding): the bin above decides; keep its tokens
    empty = torch.isinf(threshold)
    if empty.any():
        threshold[empty] = 0.0  # falls back to the whole row: only on float edge cases
        for r in empty.nonzero()[:, 0].tolist():
            threshold[r] = _threshold_by_sort(probs[r], float(top_p[r]))
    return threshold.float()


def _threshold_by_sort(probs: torch.Tensor, top_p: float) -> float:
    """The same threshold for one row by a full sort (the rare fallback)."""
    values = probs.sort(descending=True).values.double()
    before = values.cumsum(0) - values
    kept = values[(before <= top_p * values.sum()) & (values > 0)]
    return float(kept[-1]) if len(kept) else float(values[0])
