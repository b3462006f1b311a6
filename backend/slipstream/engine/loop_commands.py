"""What other threads ask of the engine loop's thread, on one queue: add a request, run a
pooling request, abort one, or just wake up; and how the loop thread carries each out, between
steps (every engine call stays on that thread)."""

from __future__ import annotations

import logging
import queue
import traceback
from dataclasses import dataclass
from typing import Callable, Optional, Union

from slipstream.core.request import FinishReason, Request, RequestOutput
from slipstream.engine.stream_table import StreamTable, aborted_output, error_output
from slipstream.engine.surface import EngineSurface
from slipstream.engine.tokenizer_thread import PoolingJob

log = logging.getLogger("slipstream")


@dataclass(frozen=True)
class AddRequest:
    request: Request


@dataclass(frozen=True)
class EmbedRequest:
    job: PoolingJob


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class Wake:
    """Nothing to do but look at the stop flag."""


Command = Union[AddRequest, EmbedRequest, AbortRequest, Wake]


class LoopCommands:
    def __init__(
        self,
        engine: Callable[[], EngineSurface],
        streams: StreamTable,
        deliver: Callable[[list[RequestOutput]], None],
    ) -> None:
        self.engine, self.streams, self.deliver = engine, streams, deliver
        self.queue: "queue.Queue[Command]" = queue.Queue()

    def put(self, command: Command) -> None:
        self.queue.put(command)

    def drain(self, wait: Optional[float]) -> None:
        """Carry out every queued command, first waiting up to ``wait`` seconds for one."""
        try:
            command = self.queue.get(timeout=wait) if wait else self.queue.get_nowait()
            while True:
                self._handle(command)
                command = self.queue.get_nowait()
        except queue.Empty:
            return

    def abort_unadded(self) -> None:
        """End the requests submitted but never added (the loop is stopping)."""
        while True:
            try:
                command = self.queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, AddRequest):
                rid = command.request.request_id
            elif isinstance(command, EmbedRequest):
                rid = command.job.stream.request_id
            else:
                continue
            self.streams.retire_pending()
            self.deliver([aborted_output(rid)])

    def _handle(self, command: Command) -> None:
        if isinstance(command, AddRequest):
            self._add(command.request)
        elif isinstance(command, EmbedRequest):
            self._embed(command.job)
        elif isinstance(command, AbortRequest):
            out = self.engine().abort(command.request_id)
            if out is not None:
                self.deliver([out])

    def _add(self, req: Request) -> None:
        out: Optional[RequestOutput] = None
        engine = self.engine()
        if self.streams.aborted_early(req.request_id):
            out = aborted_output(req.request_id)
        else:
            try:
                engine.add(req, check_queue=False)  # submit admitted it already
            except Exception as exc:  # noqa: BLE001 - refused: this request alone
                out = error_output(req.request_id, str(exc))
        self.streams.retire_pending(engine.num_waiting())
        if out is not None:
            self.deliver([out])

    def _embed(self, job: PoolingJob) -> None:
        rid = job.stream.request_id
        assert job.token_ids is not None  # the tokenizer thread set them
        if self.streams.aborted_early(rid):
            out = aborted_output(rid)
        else:
            try:
                vector = self.engine().embed(job.token_ids, job.params)
                out = RequestOutput(
                    rid,
                    finished=True,
                    finish_reason=FinishReason.STOP,
                    num_prompt_tokens=len(job.token_ids),
                    embedding=vector,
                )
            except Exception as exc:  # noqa: BLE001 - this request alone fails
                log.error("pooling request failed:\n%s", traceback.format_exc())
                out = error_output(rid, f"internal error: {exc}")
        self.streams.retire_pending()
        self.deliver([out])
