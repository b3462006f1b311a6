"""Drawing one token per sampled row on the logits' device, the whole batch at once.

The same rules as ``token_draw`` (the CPU sampler's draw): temperature, then top-k, min-p and
top-p, each row's token picked by inverse transform from ONE uniform number per row, so a
row's token depends only on its own logits and its own number. Here every step is a batched
tensor operation whose shapes the host knows before the step (no device value is read on
the host, nothing is sized by data), so the draw runs on a GPU without a synchronisation.

Rows are drawn in three groups, decided on the host from the parameters:

* ``WHOLE`` (neither top-k nor top-p): the softmax in vocabulary order, min-p applied;
* ``TOP_K`` (0 < top_k < vocab, top-p or not): one ``topk`` of the group's largest k gives
  each row's most likely tokens in order; ranks past the row's own k, min-p and top-p are
  masks over that prefix;
* ``NUCLEUS`` (top-p without top-k): the row's probabilities sorted (stable), the nucleus a
  mask over the sorted prefix: a token is kept while the mass before it is at most
  top_p x the row's mass, as ``Sampler.probabilities`` keeps it.

Inverse transform: the first position whose cumulative weight exceeds u x total; the target
is held strictly below the total, so a zero weight is never picked. A row whose weights are
not finite or sum to 0 (NaN logits, every token blocked) comes back flagged, not as a token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from slipstream.core.sampling_params import SamplingParams

_FINITE = torch.finfo(torch.float32).max


class DrawKind(enum.Enum):
    WHOLE = "whole"
    TOP_K = "top_k"
    NUCLEUS = "nucleus"


def kind_of(params: SamplingParams, vocab: int) -> DrawKind:
    if 0 < params.top_k < vocab:
        return DrawKind.TOP_K
    return DrawKind.NUCLEUS if params.top_p < 1.0 else DrawKind.WHOLE


@dataclass
class GroupPlan:
    """One group's rows and parameters, as host arrays (uploaded with the step's inputs)."""

    kind: DrawKind
    rows: np.ndarray  # int64: the group's rows in the sampled logits
    temperature: np.ndarray  # float32
    top_k: np.ndarray  # int64 (TOP_K only; else empty)
    top_p: np.ndarray  # float32
    min_p: np.ndarray  # float32
    uniforms: np.ndarray  # float64
    max_k: int = 0  # TOP_K: the group's largest k
    uses_min_p: bool = False

    def arrays(self) -> list[np.ndarray]:
        return [self.rows, self.temperature, self.top_k, self.top_p, self.min_p, self.uniforms]


@dataclass
class DeviceGroup:
    """A ``GroupPlan`` with its arrays on the device."""

    plan: GroupPlan
    rows: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    uniforms: torch.Tensor


def plan_groups(
    params: Sequence[SamplingParams], uniforms: np.ndarray, vocab: int
) -> list[GroupPlan]:
    """The draw groups of sampled rows ``params[i]`` with ``uniforms[i]`` (host only)."""
    by_kind: dict[DrawKind, list[int]] = {}
    for i, p in enumerate(params):
        by_kind.setdefault(kind_of(p, vocab), []).append(i)
    groups = []
    for kind, rows in by_kind.items():
        ps = [params[i] for i in rows]
        top_k = [p.top_k for p in ps] if kind is DrawKind.TOP_K else []
        groups.append(
            GroupPlan(
                kind,
                np.asarray(rows, dtype=np.int64),
                np.asarray([p.temperature for p in ps], dtype=np.float32),
                np.asarray(top_k, dtype=np.int64),
                np.asarray([p.top_p for p in ps], dtype=np.float32),
                np.asarray([p.min_p for p in ps], dtype=np.float32),
                np.asarray(uniforms, dtype=np.float64)[rows],
                max(top_k, default=0),
                any(p.min_p > 0.0 for p in ps),
            )
        )
    return groups


def bind(plan: GroupPlan, tensors: Sequence[torch.Tensor]) -> DeviceGroup:
    """The group with ``tensors`` (``plan.arrays()`` uploaded, in that order)."""
    return DeviceGroup(plan, *tensors)


def draw(logits: torch.Tensor, group: DeviceGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, ok) for the group's rows of ``logits [S, V]`` (penalties applied)."""
    rows = logits if len(group.plan.rows) == logits.shape[0] else logits[group.rows]
    scaled = (rows / group.temperature[:, None]).clamp_(max=_FINITE)
    probs = torch.softmax(scaled, dim=-1)
    kind = group.plan.kind
    if kind is DrawKind.WHOLE:
        if group.plan.uses_min_p:
            probs = _min_p(probs, probs.amax(dim=-1), group.min_p)
        return _pick(probs, group.uniforms)
    if kind is DrawKind.TOP_K:
        values, ids = probs.topk(group.plan.max_k, dim=-1)  # most likely first
        ranks = torch.arange(values.shape[-1], device=values.device)
        values = values.masked_fill(ranks[None, :] >= group.top_k[:, None], 0.0)
    else:
        values, ids = probs.sort(dim=-1, descending=True, stable=True)
    if group.plan.uses_min_p:
        values = _min_p(values, values[:, 0], group.min_p)
    values = _top_p(values, group.top_p)
    picked, ok = _pick(values, group.uniforms)
    return ids.gather(1, picked[:, None])[:, 0], ok


def _min_p(probs: torch.Tensor, most_likely: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    return probs.masked_fill(probs < (min_p * most_likely)[:, None], 0.0)


def _top_p(values: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Sorted weights with what lies past each row's nucleus set to 0: a token stays while
    the weight before it is at most top_p x the row's weight."""
    before = values.cumsum(dim=-1) - values
    total = values.sum(dim=-1, keepdim=True)
    outside = (before > top_p[:, None] * total) & (top_p < 1.0)[:, None]
    return values.masked_fill(outside, 0.0)


def _pick(weights: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse transform per row over non-negative ``weights``: (position, ok)."""
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1]
    target = (uniforms * total.double()).float()
    # strictly below the total: the position found then has a weight of its own
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    picked = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    ok = torch.isfinite(total) & (total > 0)
    return picked.clamp_(max=weights.shape[-1] - 1), ok


def sample_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    uniforms: torch.Tensor,
    upload=None,
) -> torch.Tensor:
    """``token_draw.sample_rows``' contract on the device path: one token per row of
    ``logits [S, V]`` for ``params[i]`` and ``uniforms[i]``; -1 where a row cannot be drawn.
    ``upload`` (a ``HostToDevice``) moves the parameters; default: plain tensors on the
    logits' device (tests)."""
    groups = plan_groups(params, uniforms.double().cpu().numpy(), logits.shape[-1])
    tokens = torch.full((logits.shape[0],), -1, dtype=torch.long, device=logits.device)
    for plan in groups:
        if upload is None:
            tensors = [torch.from_numpy(a).to(logits.device) for a in plan.arrays()]
        else:
            tensors = upload.upload(plan.arrays())
        group = bind(plan, tensors)
        drawn, ok = draw(logits, group)
        tokens.index_copy_(0, group.rows, torch.where(ok, drawn, -1))
    return tokens
