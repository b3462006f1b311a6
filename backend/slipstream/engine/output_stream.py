"""One request's outputs as a client of the engine loop reads them."""

from __future__ import annotations

import queue
from typing import Iterator, Optional

from slipstream.core.request import RequestOutput, merge_output


class OutputStream:
    """Incremental outputs of one request; iteration ends after the finished one.

    ``rejection`` is the exception when the request was refused after ``submit`` returned
    (its text prompt is checked on the tokenizer thread) or ended by the engine's death: a
    ``ValueError`` is the client's fault, an ``EngineDeadError`` the engine's."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: "queue.Queue[RequestOutput]" = queue.Queue()
        self.finished = False
        self.rejection: Optional[Exception] = None

    def put(self, output: RequestOutput) -> None:
        self._queue.put(output)

    def get(self, timeout: Optional[float] = None) -> RequestOutput:
        out = self._queue.get(timeout=timeout)
        if out.finished:
            self.finished = True
        return out

    def __iter__(self) -> Iterator[RequestOutput]:
        while not self.finished:
            yield self.get()

    def collect(self) -> RequestOutput:
        """Every output until the finished one, merged into one (blocking)."""
        total = RequestOutput(self.request_id)
        for out in self:
            merge_output(total, out)
        return total
