"""The batch timeline of a run, read back from the engine's Chrome trace JSON.

``slipstream.trace.StepTracer`` writes one ``X`` event per step (pid "engine", name
``step N``) and one per request per step (pid "batch", ``tid`` = the request's slot,
``args`` with its prefill/decode tokens), plus grey ``padding`` events for static
batching's dummy rows. The server writes it on shutdown (``trace_file``); the in-process
engine hands ``tracer.to_chrome_trace()`` over directly. Both go through ``parse``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

BATCH_PID, ENGINE_PID = 1, 2


@dataclass
class Slice:
    """One request's share of one step."""

    request_id: str
    slot: int
    prefill_tokens: int
    decode_tokens: int
    finished: bool = False

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens


@dataclass
class Step:
    index: int
    start_s: float  # from the trace's first step
    dur_s: float
    slices: list = field(default_factory=list)
    padding_slots: list = field(default_factory=list)
    padding_tokens: int = 0

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.slices)


def load(source: Union[str, Path, dict]) -> list:
    trace = source if isinstance(source, dict) else json.loads(Path(source).read_text())
    return parse(trace)


def parse(trace: dict) -> list:
    steps: dict = {}
    slices: list = []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X":
            continue
        if ev.get("pid") == ENGINE_PID and ev.get("cat") == "step":
            index = int(ev["name"].split()[-1])
            args = ev.get("args", {})
            steps[index] = Step(
                index,
                ev["ts"] / 1e6,
                ev["dur"] / 1e6,
                padding_tokens=int(args.get("padding_tokens", 0)),
            )
        elif ev.get("pid") == BATCH_PID:
            slices.append(ev)
    for ev in slices:
        step = steps.get(int(ev["args"]["step"]))
        if step is None:
            continue
        if ev.get("cat") == "padding":
            step.padding_slots.append(int(ev["tid"]))
            continue
        a = ev["args"]
        step.slices.append(
            Slice(
                ev["name"],
                int(ev["tid"]),
                int(a.get("prefill_tokens", 0)),
                int(a.get("decode_tokens", 0)),
                bool(a.get("finished")),
            )
        )
    return [steps[i] for i in sorted(steps)]


def after(steps: Sequence[Step], first_index: int) -> list:
    """The steps of the measured run: those from ``first_index`` on (warm-up came before)."""
    kept = [s for s in steps if s.index >= first_index]
    if kept:  # time from the first measured step
        origin = kept[0].start_s
        kept = [
            Step(s.index, s.start_s - origin, s.dur_s, s.slices, s.padding_slots, s.padding_tokens)
            for s in kept
        ]
    return kept


def sampled_rows(steps: Sequence[Step]) -> list:
    """Rows that get logits in each step: every decode, and a prefill chunk that ends its
    prompt (the request decodes or finishes next). A chunk in the middle samples nothing."""
    last_step_of: dict = {}
    for i, step in enumerate(steps):
        for s in step.slices:
            last_step_of[s.request_id] = i
    next_is_decode: set = set()
    seen_decode: dict = {}
    for i in range(len(steps) - 1, -1, -1):
        for s in steps[i].slices:
            if s.prefill_tokens and (
                seen_decode.get(s.request_id) or (s.finished and last_step_of[s.request_id] == i)
            ):
                next_is_decode.add((i, s.request_id))
            seen_decode[s.request_id] = bool(s.decode_tokens) and not s.prefill_tokens
    return [
        sum(1 for s in step.slices if s.decode_tokens or (i, s.request_id) in next_is_decode)
        for i, step in enumerate(steps)
    ]


def summary(steps: Sequence[Step]) -> dict:
    if not steps:
        return {"num_steps": 0}
    seqs = [len(s.slices) for s in steps]
    pads = [len(s.padding_slots) for s in steps]
    return {
        "num_steps": len(steps),
        "busy_s": sum(s.dur_s for s in steps),
        "span_s": steps[-1].start_s + steps[-1].dur_s - steps[0].start_s,
        "mean_seqs_per_step": sum(seqs) / len(steps),
        "max_seqs_per_step": max(seqs),
        "mean_tokens_per_step": sum(s.tokens for s in steps) / len(steps),
        "prefill_tokens": sum(x.prefill_tokens for s in steps for x in s.slices),
        "decode_tokens": sum(x.decode_tokens for s in steps for x in s.slices),
        "padding_rows_fraction": sum(pads) / max(sum(pads) + sum(seqs), 1),
        "padding_tokens": sum(s.padding_tokens for s in steps),
    }


def batch_size_histogram(steps: Sequence[Step]) -> dict:
    hist: dict = {}
    for s in steps:
        hist[len(s.slices)] = hist.get(len(s.slices), 0) + 1
    return dict(sorted(hist.items()))


def to_json(steps: Sequence[Step], max_steps: Optional[int] = None) -> list:
    """Compact form for the results file: [index, start, dur, [[rid, slot, p, d], ...], pads]."""
    chosen = steps if max_steps is None else steps[:max_steps]
    return [
        [
            s.index,
            round(s.start_s, 6),
            round(s.dur_s, 6),
            [[x.request_id, x.slot, x.prefill_tokens, x.decode_tokens] for x in s.slices],
            s.padding_slots,
        ]
        for s in chosen
    ]
