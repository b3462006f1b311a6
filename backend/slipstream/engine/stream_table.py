"""The streams of the requests an engine loop serves: shared by the caller's thread (which
admits requests), the tokenizer thread and the loop thread (which deliver their outputs),
under one lock. It also counts what the admission rule needs: requests submitted but not yet
seen by the loop thread, and the waiting ones as the loop thread last saw them (updated in the
same critical section that retires a pending request, so waiting + pending never
undercounts)."""

from __future__ import annotations

import threading
from typing import Callable, Optional

from slipstream.core.request import FinishReason, RequestOutput
from slipstream.engine.output_stream import OutputStream


def error_output(
    request_id: str, message: str, reason: FinishReason = FinishReason.ERROR
) -> RequestOutput:
    return RequestOutput(request_id, finished=True, finish_reason=reason, error=message)


def aborted_output(request_id: str) -> RequestOutput:
    return RequestOutput(request_id, finished=True, finish_reason=FinishReason.ABORT)


class StreamTable:
    def __init__(self) -> None:
        self.lock = threading.Lock()  # also guards the loop's health transitions
        self._streams: dict[str, OutputStream] = {}
        self._pending = 0  # submitted, not yet seen by the loop thread
        self._aborted_early: set[str] = set()  # aborted before the engine had them
        self.num_waiting = 0

    def admit(self, request_id: str, check: Callable[[int], None]) -> OutputStream:
        """A new request's stream; ``check`` (called under the lock with the queued count)
        raises to refuse it."""
        with self.lock:
            check(self.num_waiting + self._pending)
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            stream = OutputStream(request_id)
            self._streams[request_id] = stream
            self._pending += 1
        return stream

    def mark_aborted(self, request_id: str) -> None:
        """In case the engine does not have the request yet."""
        with self.lock:
            if request_id in self._streams:
                self._aborted_early.add(request_id)

    def aborted_early(self, request_id: str) -> bool:
        with self.lock:
            return request_id in self._aborted_early

    def retire_pending(self, num_waiting: Optional[int] = None) -> None:
        """A submitted request reached the engine (or never will)."""
        with self.lock:
            self._pending -= 1
            if num_waiting is not None:
                self.num_waiting = num_waiting

    def set_waiting(self, num_waiting: int) -> None:
        with self.lock:
            self.num_waiting = num_waiting

    def reject(self, stream: OutputStream, exc: Optional[Exception]) -> RequestOutput:
        """The final output of a request that never reached the engine (refused, aborted or
        shut out); it is no longer pending."""
        stream.rejection = exc
        if exc is None:
            out = aborted_output(stream.request_id)
        else:
            out = error_output(stream.request_id, str(exc))
        with self.lock:
            if self._streams.get(stream.request_id) is stream:  # not already swept
                self._pending -= 1
        return out

    def deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self.lock:
                stream = self._streams.get(out.request_id)
                if out.finished:
                    self._streams.pop(out.request_id, None)
                    self._aborted_early.discard(out.request_id)
            if stream is not None:
                stream.put(out)

    def sweep(self) -> list[OutputStream]:
        """Every open stream, forgotten (the caller holds ``lock``: the engine is dying)."""
        streams = list(self._streams.values())
        self._streams.clear()
        self._pending = 0
        return streams
