"""The load generator: a workload over tritonclient gRPC streaming, per-token arrival times.

All requests share ONE bidirectional gRPC stream (as a serving frontend multiplexing its
users would): responses are routed by request id in the stream's callback thread, which
stamps each response on arrival. Each response says how many tokens it carries
(``return_num_output_tokens``), so per-token times stay exact when a response holds
several. Lengths are exact: ``max_tokens`` = ``min_tokens`` and ``ignore_eos``; greedy unless
the request carries sampling parameters.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Sequence

import numpy as np

from slipstream_bench.driver import Progress, send_on_schedule
from slipstream_bench.metrics import RequestRecord
from slipstream_bench.workload import BenchRequest, Workload

MODEL_NAME = "slipstream"


def sampling_json(req: BenchRequest) -> str:
    return json.dumps(
        {
            "max_tokens": req.max_tokens,
            "min_tokens": req.max_tokens,
            "ignore_eos": True,
            **req.sampling_fields(),
        }
    )


def build_inputs(req: BenchRequest) -> list:
    import tritonclient.grpc as grpcclient

    def tensor(name: str, value: np.ndarray, dtype: str):
        t = grpcclient.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        return t

    return [
        tensor("text_input", np.array([req.prompt.encode("utf-8")], dtype=np.object_), "BYTES"),
        tensor("stream", np.array([True]), "BOOL"),
        tensor(
            "sampling_parameters",
            np.array([sampling_json(req).encode()], dtype=np.object_),
            "BYTES",
        ),
        tensor("return_num_output_tokens", np.array([True]), "BOOL"),
    ]


class _Collector:
    """The stream callback: stamp, count, route; signals when every request ended."""

    def __init__(self, records: dict, progress: Progress) -> None:
        self.records = records
        self.progress = progress
        self.pending = len(records)
        self.done = threading.Event()
        self.stream_errors: list = []
        self._lock = threading.Lock()

    def __call__(self, result, error) -> None:
        now = time.perf_counter()
        if error is not None:
            self._on_error(error)
            return
        response = result.get_response()
        rec = self.records.get(response.id)
        if rec is None:
            return
        count = result.as_numpy("num_output_tokens")
        n = int(count.reshape(-1)[0]) if count is not None and count.size else 0
        rec.add_tokens(now, n)
        text = result.as_numpy("text_output")
        if text is not None and text.size:
            rec.text += text.reshape(-1)[0].decode("utf-8", "replace")
        self.progress.update(n)
        if response.parameters["triton_final_response"].bool_param:
            self._finish_one()

    def _on_error(self, error) -> None:
        # Stream errors do not always name their request: fail the oldest one still open.
        rid = getattr(error, "request_id", None)
        with self._lock:
            self.stream_errors.append(str(error))
        rec = self.records.get(rid) if rid else None
        if rec is None:
            rec = next(
                (
                    r
                    for r in self.records.values()
                    if r.error is None and len(r.token_times) < r.max_tokens
                ),
                None,
            )
        if rec is not None:
            rec.error = str(error)
        self._finish_one()

    def _finish_one(self) -> None:
        with self._lock:
            self.pending -= 1
            if self.pending <= 0:
                self.done.set()


def run_triton(
    grpc_url: str,
    workload: Workload,
    offsets: Sequence[float],
    *,
    label: str = "triton",
    progress: bool = True,
    timeout: float = 3600.0,
    model: str = MODEL_NAME,
) -> list:
    """Send every request of ``workload`` at its offset; one RequestRecord per request."""
    import tritonclient.grpc as grpcclient

    records = {r.id: RequestRecord(r.id, r.prompt_len, r.max_tokens) for r in workload.requests}
    inputs = [build_inputs(r) for r in workload.requests]  # built before the clock starts
    bar = Progress(label, workload.total_output_tokens, progress)
    collector = _Collector(records, bar)
    client = grpcclient.InferenceServerClient(grpc_url)
    client.start_stream(callback=collector)

    def send(i: int) -> None:
        req = workload.requests[i]
        records[req.id].send_time = time.perf_counter()
        client.async_stream_infer(
            model, inputs[i], request_id=req.id, enable_empty_final_response=True
        )

    try:
        send_on_schedule(offsets, send, records=list(records.values()))
        if not collector.done.wait(timeout):
            raise TimeoutError(
                f"{label}: {collector.pending} requests unfinished after {timeout} s"
            )
    finally:
        client.stop_stream(cancel_requests=not collector.done.is_set())
        client.close()
        bar.close()
    return [records[r.id] for r in workload.requests]


def warm_up(grpc_url: str, workload: Workload, model: str = MODEL_NAME) -> None:
    """A few short requests, so one-time costs (first forward, allocator growth) stay out."""
    run_triton(
        grpc_url,
        workload,
        [0.0] * len(workload),
        label="warm-up",
        progress=False,
        timeout=600.0,
        model=model,
    )
