"""The roofline: what the continuous run's steps would cost as raw model forwards alone.

For every step the engine ran (from its trace), the step put T tokens through the model and
took logits for S rows. The best a serving engine can do for that step is one plain forward
of T packed tokens with S logit rows: no scheduler, no KV-cache writes or reads, no
sampling, no detokenizing, no streaming. We time exactly that on the plain Hugging Face
model (sdpa; fastest of the stored, transposed and oneDNN-packed weight layouts, as the
engine may use any), as ``body(T)`` (forward, one logit row) plus ``head(S) - head(1)`` (the extra
``lm_head`` rows), at a grid of T and S covering the run, interpolating in between, and sum
over the steps. That sum is the best-possible time for the workload at the batch shapes the
run chose. Attention over cached context is left out, so this is a true lower bound, and a
strict one: on the 2-core CPU, the engine's paged KV attention (gather the blocks, then fused
SDPA) is 20-30% of a batch-8 decode step at 300-700 tokens of context, and a step with that
attention replaced by zeros costs what this forward does.
"""

from __future__ import annotations

import bisect
import time
from typing import Callable, Sequence

import torch

from slipstream.worker.layers.linear import prepare_linears
from slipstream_bench import timeline

MAX_GRID_POINTS = 24
REPEATS = 3


def grid(values: Sequence[int], max_points: int = MAX_GRID_POINTS) -> list:
    """The distinct values, or a geometric grid spanning them when there are too many."""
    distinct = sorted(set(int(v) for v in values if v > 0))
    if len(distinct) <= max_points:
        return distinct
    lo, hi = distinct[0], distinct[-1]
    ratio = (hi / lo) ** (1 / (max_points - 1))
    points = {lo, hi} | {round(lo * ratio**i) for i in range(max_points)}
    return sorted(points)


def interpolate(points: dict, x: float) -> float:
    xs = sorted(points)
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return points[x]
    if i == 0:
        return points[xs[0]] * x / xs[0]
    if i == len(xs):
        return points[xs[-1]] * x / xs[-1]
    a, b = xs[i - 1], xs[i]
    return points[a] + (points[b] - points[a]) * (x - a) / (b - a)


def best_time(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    fn()  # warm the allocator and kernels for this shape
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@torch.inference_mode()
def time_body(model, sizes: Sequence[int], vocab: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    out = {}
    for t in sizes:
        ids = torch.randint(0, vocab, (1, t), generator=gen)
        out[t] = best_time(lambda: model(input_ids=ids, logits_to_keep=1, use_cache=False))
    return out


@torch.inference_mode()
def time_head(model, sizes: Sequence[int]) -> dict:
    head = model.get_output_embeddings()
    hidden = torch.randn(max(sizes), head.in_features)
    return {s: best_time(lambda: head(hidden[:s])) for s in sizes}


def measure(model, body_sizes: Sequence[int], head_sizes: Sequence[int]) -> tuple:
    """Best of the weight layouts for every shape (the model keeps the last one)."""
    vocab = model.get_input_embeddings().num_embeddings
    bodies, heads = [time_body(model, body_sizes, vocab)], [time_head(model, head_sizes)]
    for layout in ("transposed", "onednn"):
        if prepare_linears(model, layout).value == layout:
            bodies.append(time_body(model, body_sizes, vocab))
            heads.append(time_head(model, head_sizes))
    return (
        {k: min(b[k] for b in bodies) for k in bodies[0]},
        {k: min(h[k] for h in heads) for k in heads[0]},
    )


def roofline(model, steps: Sequence[timeline.Step]) -> dict:
    """Best-possible time of ``steps``; ``model`` gets packed weights (use it last)."""
    if not steps:
        return {"best_possible_s": None, "num_steps": 0}
    tokens = [s.tokens for s in steps]
    rows = [max(r, 1) for r in timeline.sampled_rows(steps)]
    body_grid, head_grid = grid(tokens), grid(rows + [1])
    t0 = time.perf_counter()
    body, head = measure(model, body_grid, head_grid)
    base = head[min(head)] if 1 not in head else head[1]
    per_step = [
        interpolate(body, t) + max(interpolate(head, r) - base, 0.0) for t, r in zip(tokens, rows)
    ]
    return {
        "best_possible_s": sum(per_step),
        "num_steps": len(steps),
        "measure_s": time.perf_counter() - t0,
        "body_ms": {str(k): v * 1000 for k, v in body.items()},
        "head_ms": {str(k): v * 1000 for k, v in head.items()},
        "method": "plain HF forward of the step's packed tokens + lm_head rows, best of "
        f"{REPEATS}, stored vs transposed vs oneDNN-packed weights; no KV "
        "attention",
    }


def efficiency(result: dict, makespan_s: float, busy_s: float) -> dict:
    best = result.get("best_possible_s")
    if not best:
        return {}
    return {
        "vs_makespan": best / makespan_s if makespan_s else None,
        "vs_engine_busy": best / busy_s if busy_s else None,
    }
