"""One request in flight as the stub's sender thread sees it: where its outputs come from,
where its responses go, and what has happened to it so far. Pure Python (no Triton)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from slipstream.engine.loop import OutputStream
from slipstream.server.stub.deadlines import Deadline
from slipstream.server.stub.metrics import RequestTrack
from slipstream.server.stub.request_interface import Responses
from slipstream.server.stub.request_parser import ParsedRequest, RequestOptions


@dataclass
class PendingRequest:
    stream: OutputStream  # the engine's outputs
    sender: Any  # the request's (or its row's) response sender
    parsed: ParsedRequest
    builder: Responses  # what each output becomes
    track: RequestTrack  # what the metrics remember
    arrival: float  # time.monotonic() when execute saw it
    deadline: Optional[Deadline] = None
    timed_out: bool = False  # aborted at its deadline
    cancelled: bool = False  # the client cancelled it
    progressed: bool = False  # the last drain sent or kept something
    shutdown_abort: bool = False  # aborted because Triton is stopping
    last_cancel_check: float = float("-inf")

    @property
    def options(self) -> RequestOptions:
        return self.parsed.options

    @property
    def request_id(self) -> str:
        return self.stream.request_id
