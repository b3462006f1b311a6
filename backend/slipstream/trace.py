"""Per-step scheduler trace: which requests ran in each step, with how many prefill and
decode tokens, KV use, queue lengths and preemptions, exportable as Chrome trace JSON.

Open the JSON in ``chrome://tracing`` or https://ui.perfetto.dev: process "batch" has one
row per batch slot, so the picture is the batch timeline the continuous-batching papers
draw (requests entering and leaving slots, prefill chunks beside decodes); process
"engine" carries one event per step and counters for KV blocks, queue lengths and tokens.

A request keeps the lowest free slot from the step it is first scheduled until it
finishes, is aborted or is preempted (a resumed request takes a slot again), so a slot is
never shared by two live requests. Records live in a bounded buffer: a long-running server
keeps the most recent ``max_records`` steps.
"""

from __future__ import annotations

import json
import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from slipstream.core.request import Request, RequestStatus
from slipstream.core.scheduler_output import ScheduledRequest

DEFAULT_MAX_RECORDS = 100_000
_BATCH_PID = 1  # one thread (tid = slot) per batch slot
_ENGINE_PID = 2  # step events, counters, preemptions of requests without a slot


@dataclass
class TraceEntry:
    """One request's share of one step."""

    request_id: str
    slot: int
    num_prefill_tokens: int  # prompt (or recomputed) tokens, a chunk when prefill is chunked
    num_decode_tokens: int  # 1 + draft tokens for a request past its prompt, else 0
    num_spec_tokens: int = 0  # the draft tokens among the decode tokens
    finished: bool = False  # the request finished in this step

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


@dataclass
class StepRecord:
    step: int
    start: float  # time.perf_counter() seconds
    end: float
    entries: list[TraceEntry] = field(default_factory=list)  # in batch order
    kv_blocks_used: int = 0  # after the step (blocks of requests finished in it are free)
    kv_blocks_total: int = 0
    num_waiting: int = 0
    num_running: int = 0
    preempted: list[str] = field(default_factory=list)  # request ids preempted while scheduling
    swapped_out: list[str] = field(default_factory=list)
    swapped_in: list[str] = field(default_factory=list)
    num_padding_seqs: int = 0  # static/dynamic batching: rows that are pure padding
    num_padding_tokens: int = 0  # padded prompt tokens plus the padding rows' tokens

    @property
    def num_prefill_tokens(self) -> int:
        return sum(e.num_prefill_tokens for e in self.entries)

    @property
    def num_decode_tokens(self) -> int:
        return sum(e.num_decode_tokens for e in self.entries)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def duration(self) -> float:
        return self.end - self.start


def split_tokens(item: ScheduledRequest) -> tuple[int, int]:
    """(prefill, decode) tokens of one ``ScheduledRequest``.

    Decode means the step computes the request's one newest token (and its drafts) past
    the prompt and samples from it; everything else, including recomputing a preempted
    request's earlier outputs, is prefill work.
    """
    req = item.request
    drafts = len(item.spec_token_ids)
    real = item.num_new_tokens - drafts
    before = item.num_computed_before
    reaches_end = before + real == item.num_tokens_before
    if real == 1 and before >= req.num_prompt_tokens and reaches_end:
        return 0, 1 + drafts
    return real, drafts


class StepTracer:
    def __init__(self, max_records: int = DEFAULT_MAX_RECORDS) -> None:
        if max_records <= 0:
            raise ValueError("max_records must be positive")
        self.records: deque = deque(maxlen=max_records)
        self.num_steps = 0  # every step recorded, including those dropped from the buffer
        self._slots: dict[str, int] = {}  # request id -> slot
        self._holders: dict[str, Request] = {}  # to see when a request leaves the batch

    @property
    def num_dropped(self) -> int:
        return self.num_steps - len(self.records)

    def clear(self) -> None:
        self.records.clear()

    # -- recording -------------------------------------------------------------------------
    def record(self, sched, started: float, ended: float, engine) -> StepRecord:
        """Called by the engine after a step has run and its outputs were processed."""
        rec = StepRecord(step=self.num_steps, start=started, end=ended)
        self.num_steps += 1
        for item in sched.scheduled:
            rec.entries.append(self._entry(item))
        rec.preempted = [r.request_id for r in sched.preempted]
        rec.swapped_out = [r.request_id for r in sched.swapped_out]
        rec.swapped_in = [r.request_id for r in sched.swapped_in]
        rec.num_padding_seqs = sched.padding.num_padding_seqs
        rec.num_padding_tokens = sched.padding.num_tokens(sched.scheduled)
        bm, scheduler = engine.block_manager, engine.scheduler
        rec.kv_blocks_used = bm.num_used_blocks
        rec.kv_blocks_total = bm.num_usable_blocks
        rec.num_waiting = len(scheduler.waiting)
        rec.num_running = len(scheduler.running)
        self._release_departed()
        self.records.append(rec)
        return rec

    def _entry(self, item) -> TraceEntry:
        req = item.request
        prefill, decode = split_tokens(item)
        return TraceEntry(
            req.request_id,
            self._slot_of(req),
            prefill,
            decode,
            len(item.spec_token_ids),
            req.is_finished,
        )

    def _slot_of(self, req) -> int:
        slot = self._slots.get(req.request_id)
        if slot is None:
            taken = set(self._slots.values())
            slot = next(i for i in range(len(taken) + 1) if i not in taken)
            self._slots[req.request_id] = slot
            self._holders[req.request_id] = req
        return slot

    def _release_departed(self) -> None:
        # Finished, aborted, preempted (waiting again) and swapped-out requests give their
        # slot back; a running request that got no budget this step keeps it.
        for rid, req in list(self._holders.items()):
            if req.status is not RequestStatus.RUNNING:
                del self._holders[rid]
                del self._slots[rid]

    # -- export ------------------------------------------------------------------------------
    def to_chrome_trace(self) -> dict[str, Any]:
        """The records as Chrome trace events (``ts``/``dur`` in microseconds)."""
        records = list(self.records)
        origin = records[0].start if records else 0.0
        events = _metadata(records)
        slot_of_last: dict = {}  # request id -> its slot in the latest step it ran
        for rec in records:
            events.extend(_step_events(rec, origin, slot_of_last))
            for e in rec.entries:
                slot_of_last[e.request_id] = e.slot
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {"steps": self.num_steps, "dropped_steps": self.num_dropped},
        }

    def save(self, path: Union[str, os.PathLike]) -> Path:
        """Write the Chrome trace JSON (atomically: a reader never sees half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump(self.to_chrome_trace(), f)
        os.replace(tmp, path)
        return path


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _metadata(records: list) -> list:
    slots = sorted(
        {e.slot for r in records for e in r.entries}
        | {s for r in records for s in _padding_slots(r)}
    )
    events = [
        {"ph": "M", "name": "process_name", "pid": _BATCH_PID, "args": {"name": "batch"}},
        {"ph": "M", "name": "process_sort_index", "pid": _BATCH_PID, "args": {"sort_index": 0}},
        {"ph": "M", "name": "process_name", "pid": _ENGINE_PID, "args": {"name": "engine"}},
        {"ph": "M", "name": "process_sort_index", "pid": _ENGINE_PID, "args": {"sort_index": 1}},
        {"ph": "M", "name": "thread_name", "pid": _ENGINE_PID, "tid": 0, "args": {"name": "steps"}},
    ]
    for s in slots:
        events.append(
            {
                "ph": "M",
                "name": "thread_name",
                "pid": _BATCH_PID,
                "tid": s,
                "args": {"name": f"slot {s}"},
            }
        )
        events.append(
            {
                "ph": "M",
                "name": "thread_sort_index",
                "pid": _BATCH_PID,
                "tid": s,
                "args": {"sort_index": s},
            }
        )
    return events


def _padding_slots(rec: StepRecord) -> list:
    """Display rows for static batching's padding: the lowest slots no request uses."""
    used = {e.slot for e in rec.entries}
    free = (i for i in range(len(used) + rec.num_padding_seqs + 1) if i not in used)
    return [next(free) for _ in range(rec.num_padding_seqs)]


def _kind(e: TraceEntry) -> str:
    if e.num_prefill_tokens and e.num_decode_tokens:
        return "mixed"
    return "prefill" if e.num_prefill_tokens else "decode"


# Chrome's reserved colour names: prefill orange, decode green, padding grey.
_COLOURS = {
    "prefill": "thread_state_iowait",
    "decode": "thread_state_running",
    "mixed": "yellow",
    "padding": "grey",
}


def _step_events(rec: StepRecord, origin: float, slot_of_last: dict) -> list:
    ts, dur = _us(rec.start - origin), _us(rec.duration)
    events = [
        {
            "ph": "X",
            "name": f"step {rec.step}",
            "cat": "step",
            "pid": _ENGINE_PID,
            "tid": 0,
            "ts": ts,
            "dur": dur,
            "args": {
                "requests": len(rec.entries),
                "prefill_tokens": rec.num_prefill_tokens,
                "decode_tokens": rec.num_decode_tokens,
                "padding_seqs": rec.num_padding_seqs,
                "padding_tokens": rec.num_padding_tokens,
                "preempted": rec.preempted,
            },
        }
    ]
    for e in rec.entries:
        kind = _kind(e)
        events.append(
            {
                "ph": "X",
                "name": e.request_id,
                "cat": kind,
                "pid": _BATCH_PID,
                "tid": e.slot,
                "ts": ts,
                "dur": dur,
                "cname": _COLOURS[kind],
                "args": {
                    "step": rec.step,
                    "prefill_tokens": e.num_prefill_tokens,
                    "decode_tokens": e.num_decode_tokens,
                    "spec_tokens": e.num_spec_tokens,
                    "finished": e.finished,
                },
            }
        )
    for slot in _padding_slots(rec):
        events.append(
            {
                "ph": "X",
                "name": "padding",
                "cat": "padding",
                "pid": _BATCH_PID,
                "tid": slot,
                "ts": ts,
                "dur": dur,
                "cname": _COLOURS["padding"],
                "args": {"step": rec.step},
            }
        )
    for rid in rec.preempted:
        slot = slot_of_last.get(rid)
        where = (
            {"pid": _BATCH_PID, "tid": slot, "s": "t"}
            if slot is not None
            else {"pid": _ENGINE_PID, "tid": 0, "s": "p"}
        )
        swapped = rid in rec.swapped_out
        events.append(
            {
                "ph": "i",
                "name": f"preempt {rid}",
                "cat": "preemption",
                "ts": ts,
                **where,
                "args": {
                    "request_id": rid,
                    "step": rec.step,
                    "mode": "swap" if swapped else "recompute",
                },
            }
        )
    events.extend(_counters(rec, ts))
    return events


def _counters(rec: StepRecord, ts: float) -> list:
    base = {"ph": "C", "pid": _ENGINE_PID, "ts": ts}
    return [
        {
            **base,
            "name": "kv_blocks",
            "args": {"used": rec.kv_blocks_used, "free": rec.kv_blocks_total - rec.kv_blocks_used},
        },
        {
            **base,
            "name": "requests",
            "args": {"running": rec.num_running, "waiting": rec.num_waiting},
        },
        {
            **base,
            "name": "tokens",
            "args": {
                "prefill": rec.num_prefill_tokens,
                "decode": rec.num_decode_tokens,
                "padding": rec.num_padding_tokens,
            },
        },
    ]
