"""The same workload on the engine in this process (``EngineLoop``), without Triton or gRPC.

It takes the very engine settings the server's continuous mode loads, submits the same
text, and reads outputs the way the Triton model's sender thread does (one thread, woken by
the engine loop when outputs arrive, draining every request's stream), so the difference to
the Triton run is the Triton + gRPC streaming path alone.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Mapping, Optional, Sequence

from slipstream.core.config import EngineConfig
from slipstream.core.sampling_params import SamplingParams
from slipstream.core.stats import StatsSnapshot
from slipstream.engine.loop import EngineLoop
from slipstream_bench import timeline
from slipstream_bench.driver import Progress, send_on_schedule
from slipstream_bench.metrics import RequestRecord, records_to_json, summarize
from slipstream_bench.workload import Workload

POLL_S = 0.05  # a fallback: the engine loop wakes the poller when outputs arrive


def exact_params(max_tokens: int, sampling: Optional[dict] = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=max_tokens,
        ignore_eos=True,
        **(sampling or {"temperature": 0.0}),
    )


def make_loop(settings: Mapping[str, str], on_output=None) -> EngineLoop:
    values = {k: v for k, v in settings.items() if k != "trace_file"}
    values["trace_steps"] = "true"  # the tracer is read directly, no file
    return EngineLoop(EngineConfig.from_dict(values), on_output=on_output).start()


class _Poller(threading.Thread):
    """Drain every open stream; stamp outputs when seen."""

    def __init__(self, progress: Progress, wake: threading.Event) -> None:
        super().__init__(name="bench-poller", daemon=True)
        self.progress = progress
        self.wake = wake
        self.incoming: "queue.Queue" = queue.Queue()
        self.open: list = []
        self.expected = 0
        self.finished = threading.Event()
        self._done = 0

    def add(self, stream, record: RequestRecord) -> None:
        self.incoming.put((stream, record))
        self.wake.set()

    def run(self) -> None:
        while self._done < self.expected:
            self._take_new()
            if not self._sweep():
                self.wake.wait(POLL_S)
                self.wake.clear()
        self.finished.set()

    def _take_new(self) -> None:
        while True:
            try:
                self.open.append(self.incoming.get_nowait())
            except queue.Empty:
                return

    def _sweep(self) -> bool:
        moved = False
        for item in list(self.open):
            stream, rec = item
            while True:
                try:
                    out = stream.get(timeout=0)
                except queue.Empty:
                    break
                moved = True
                rec.add_tokens(time.perf_counter(), len(out.token_ids))
                rec.text += out.text
                self.progress.update(len(out.token_ids))
                if out.finished:
                    if out.finish_reason == "error" or out.error:
                        rec.error = out.error or out.finish_reason
                    self.open.remove(item)
                    self._done += 1
                    break
        return moved


def run_requests(
    loop: EngineLoop,
    wake: threading.Event,
    workload: Workload,
    offsets: Sequence[float],
    *,
    label: str = "inprocess",
    progress: bool = True,
    timeout: float = 3600.0,
) -> list:
    """``wake``: the event the loop sets on new outputs (``make_loop(on_output=wake.set)``)."""
    records = [RequestRecord(r.id, r.prompt_len, r.max_tokens) for r in workload.requests]
    bar = Progress(label, workload.total_output_tokens, progress)
    poller = _Poller(bar, wake)
    poller.expected = len(records)
    poller.start()

    def send(i: int) -> None:
        req, rec = workload.requests[i], records[i]
        rec.send_time = time.perf_counter()
        poller.add(loop.submit(req.prompt, exact_params(req.max_tokens, req.sampling)), rec)

    try:
        send_on_schedule(offsets, send, records=records)
        if not poller.finished.wait(timeout):
            raise TimeoutError(f"{label}: requests unfinished after {timeout} s")
    finally:
        bar.close()
    return records


def run_inprocess(
    settings: Mapping[str, str],
    workload: Workload,
    offsets: Sequence[float],
    warmup: Optional[Workload],
    *,
    label: str = "inprocess",
    progress: bool = True,
) -> dict:
    t0 = time.perf_counter()
    wake = threading.Event()
    loop = make_loop(settings, on_output=wake.set)
    startup = time.perf_counter() - t0
    try:
        if warmup is not None:
            run_requests(loop, wake, warmup, [0.0] * len(warmup), progress=False)
        first_step = loop.engine.tracer.num_steps
        stats_before = loop.stats()
        records = run_requests(loop, wake, workload, offsets, label=label, progress=progress)
    finally:
        loop.shutdown()  # joins the loop thread: the tracer and counters hold still now
    stats_after = loop.engine.get_stats()
    trace = loop.engine.tracer.to_chrome_trace()
    steps = timeline.after(timeline.parse(trace), first_step)
    return {
        "label": label,
        "kind": "inprocess",
        "settings": dict(settings),
        "startup_s": startup,
        "summary": summarize(records),
        "engine": stats_delta(stats_before, stats_after),
        "steps": timeline.summary(steps),
        "batch_sizes": timeline.batch_size_histogram(steps),
        "records": records_to_json(records),
        "timeline": timeline.to_json(steps),
    }


def stats_delta(before: StatsSnapshot, after: StatsSnapshot) -> dict:
    """Counters of the measured run alone (the engine counts from its start), as JSON."""
    counters = (
        "prompt_tokens_total",
        "generation_tokens_total",
        "preemptions_total",
        "num_finished",
        "steps",
        "busy_seconds",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "spec_draft_tokens",
        "spec_accepted_tokens",
    )
    delta = dataclasses.replace(
        after, **{k: getattr(after, k) - getattr(before, k) for k in counters}
    )
    out = dataclasses.asdict(delta)
    out["prefix_cache_hit_rate"] = delta.prefix_cache_hit_rate
    out["spec_acceptance_rate"] = delta.spec_acceptance_rate
    return out
