"""The stub's one sender thread: it drains every request's output stream and sends the
responses through that request's response sender, ending each with the FINAL flag once.

``execute`` only parses and submits; this thread does everything after: streamed and final
responses, the error that ends a request that did not complete, cancellation polls (rationed:
``cancel_polls``), deadlines, the shutdown drain (``shutdown_watch``) and the metrics'
refresh. It sleeps until the engine has new outputs or a request arrives (``wake``), so the
model's CPU threads are not polled away.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from typing import Optional

from slipstream.core.request import FinishReason, RequestOutput
from slipstream.engine.loop import EngineDeadError
from slipstream.engine.supervisor import EngineSupervisor
from slipstream.server.stub.cancel_polls import CancelPolls
from slipstream.server.stub.metrics import ModelMetrics, NoMetrics
from slipstream.server.stub.pending import PendingRequest
from slipstream.server.stub.shutdown_watch import ShutdownWatch
from slipstream.server.stub.wire import ERROR_PREFIX, FINAL, ErrorCode, error_response, response

CANCEL_POLLS = CancelPolls()


class ResponseSender:
    def __init__(
        self,
        engine: EngineSupervisor,
        metrics: ModelMetrics | NoMetrics,
        shutdown: ShutdownWatch,
        logger,
        metrics_interval_s: float,
        wake: threading.Event,
    ) -> None:
        """``wake``: set on new requests here and by the engine on new outputs."""
        self.engine, self.metrics, self.shutdown = engine, metrics, shutdown
        self.logger, self.metrics_interval = logger, metrics_interval_s
        self.incoming: "queue.Queue[PendingRequest]" = queue.Queue()
        self.wake = wake
        self.num_active = 0
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="slipstream-sender", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def add(self, pending: PendingRequest) -> None:
        self.incoming.put(pending)
        self.wake.set()

    def stop(self, timeout: float = 30.0) -> None:
        """Once the engine has ended every stream: send what is left, then end the thread."""
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout=timeout)

    # ----------------------------------------------------------------- the thread
    def _run(self) -> None:
        active: list[PendingRequest] = []
        next_metrics = 0.0
        while True:
            try:
                while True:
                    active.append(self.incoming.get_nowait())
            except queue.Empty:
                pass
            self.num_active = len(active)
            if self.stopping and not active:
                break
            now = time.monotonic()
            if active:
                self.shutdown.watch(active, now, self.engine.abort)
            progressed = self._drain_all(active, now)
            if now >= next_metrics:
                next_metrics = now + self.metrics_interval
                self._refresh_metrics()
            if not progressed:
                # The timeout only paces cancellation checks and metrics.
                self.wake.wait(CANCEL_POLLS.streaming_s if active else self.metrics_interval)
                self.wake.clear()

    def _drain_all(self, active: list[PendingRequest], now: float) -> bool:
        """Send what every request in flight has; drop the finished ones from ``active``.
        Whether any moved."""
        progressed = False
        for p in list(active):
            try:
                if self._drain(p, now):
                    active.remove(p)
                    progressed = True
                elif p.progressed:
                    progressed = True
            except Exception as e:  # a failed send: end this request only
                self.logger.log_error(f"slipstream sender: {e}\n{traceback.format_exc()}")
                active.remove(p)
                self.engine.abort(p.request_id)
                try:
                    p.sender.send(error_response(f"{ERROR_PREFIX}internal error: {e}"), flags=FINAL)
                except Exception:
                    pass
        return progressed

    def _refresh_metrics(self) -> None:
        try:
            self.metrics.update(self.engine.stats())
        except Exception as e:
            self.logger.log_warn(f"slipstream metrics: {e}")

    def _drain(self, p: PendingRequest, now: float) -> bool:
        """Send what this request's stream holds; True once its FINAL response went out."""
        p.progressed = False
        outs: list[RequestOutput] = []
        while not (outs and outs[-1].finished):
            try:
                outs.append(p.stream.get(timeout=0))
            except queue.Empty:
                break
        self._poll_cancellation(p, now, has_output=bool(outs))
        self._enforce_deadline(p, now)
        if not outs:
            return False
        p.progressed = True
        self.metrics.on_outputs(p.track, outs, time.monotonic())
        for out in outs:
            if out.finished:
                self._finish(p, out)
                return True
            if p.cancelled:
                continue
            if p.options.stream:
                outputs = p.builder.streamed(out)
                if outputs is not None:  # None: nothing to send for this output
                    p.sender.send(response(outputs))
            else:
                p.builder.absorb(out)
        return False

    def _poll_cancellation(self, p: PendingRequest, now: float, has_output: bool) -> None:
        if p.cancelled or not CANCEL_POLLS.due(
            p.last_cancel_check, now, has_output, self.num_active
        ):
            return
        p.last_cancel_check = now
        if p.sender.is_cancelled():
            p.cancelled = True
            self.logger.log_info(f"slipstream: cancelling request {p.request_id}")
            self.engine.abort(p.request_id)

    def _enforce_deadline(self, p: PendingRequest, now: float) -> None:
        if p.deadline is None or p.timed_out or p.cancelled or now < p.deadline.at:
            return
        p.timed_out = True
        self.logger.log_warn(
            f"slipstream: request {p.request_id} {p.deadline.message(now - p.arrival)}"
        )
        self.engine.abort(p.request_id)

    def _finish(self, p: PendingRequest, out: RequestOutput) -> None:
        end = time.monotonic()
        self.metrics.on_finish(p.track, out, end)  # before the last response: a client sees it
        if p.cancelled:
            self.logger.log_info(f"slipstream: request {p.request_id} cancelled")
            p.sender.send(flags=FINAL)
            return
        error = self._end_error(p, out, end)
        if error is not None:
            p.sender.send(error, flags=FINAL)
            return
        if p.options.stream:
            last = p.builder.streamed(out)
            p.sender.send(response(last) if last is not None else None, flags=FINAL)
            return
        *responses, final = p.builder.finals(out)
        for outputs in responses:  # num_return_sequences: one response per sequence
            p.sender.send(response(outputs))
        p.sender.send(response(final), flags=FINAL)

    def _end_error(self, p: PendingRequest, out: RequestOutput, end: float) -> Optional[object]:
        """The error response ending a request that did not complete, or None."""
        refused = p.stream.rejection
        if isinstance(refused, ValueError):  # found invalid after submit (tokenized later)
            return error_response(str(refused), ErrorCode.INVALID_ARG)
        if isinstance(refused, EngineDeadError):
            return error_response(str(refused), ErrorCode.UNAVAILABLE)
        if out.finish_reason is FinishReason.ERROR:
            return error_response(f"{ERROR_PREFIX}{out.error or 'unknown error'}")
        if out.finish_reason is not FinishReason.ABORT:
            return None
        if p.timed_out:
            assert p.deadline is not None  # only a deadline times a request out
            return error_response(
                ERROR_PREFIX + p.deadline.message(end - p.arrival), ErrorCode.UNAVAILABLE
            )
        if p.shutdown_abort:
            return error_response(
                f"request aborted: the server is shutting down and it did not "
                f"finish within {self.shutdown.drain_grace:.0f} s",
                ErrorCode.UNAVAILABLE,
            )
        if out.error:
            return error_response(f"{ERROR_PREFIX}{out.error}")
        return error_response("request aborted (server shutting down)", ErrorCode.UNAVAILABLE)
