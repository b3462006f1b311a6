"""How long one request may run: Triton's per-request ``timeout`` and the server-wide
``max_request_seconds``, whichever ends first. Standard library only.

Triton 2.51 enforces a request's timeout only while the request waits in Triton's own queue,
which a decoupled Python model leaves at once; the model has to end it itself. The timeout
reaches the model as ``request.timeout()`` (microseconds: set from the ``timeout`` parameter
of ``/infer`` and gRPC requests) or, from the HTTP ``generate`` endpoints, which pass
parameters through untouched, as a ``timeout`` request parameter (microseconds as well).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union


@dataclass(frozen=True)
class Deadline:
    at: float  # time.monotonic() value
    seconds: float  # the limit it came from
    source: str  # "the request's timeout" or "max_request_seconds"

    def message(self, elapsed: float) -> str:
        return f"request timed out: it ran {elapsed:.1f} s, past {self.source} ({self.seconds:g} s)"


def _parameter_timeout_us(parameters: Union[None, str, Mapping[str, Any]]) -> int:
    if isinstance(parameters, (str, bytes)):
        try:
            parameters = json.loads(parameters or "{}")
        except ValueError:
            return 0
    value = (parameters or {}).get("timeout") if isinstance(parameters, Mapping) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        return 0
    return int(value)


def request_deadline(
    arrival: float, timeout_us: int, parameters, max_request_seconds: float
) -> Optional[Deadline]:
    """The earliest of the request's own timeout and the server's limit (None: no limit)."""
    own_us = timeout_us or _parameter_timeout_us(parameters)
    limits = []
    if own_us > 0:
        limits.append(Deadline(arrival + own_us / 1e6, own_us / 1e6, "the request's timeout"))
    if max_request_seconds > 0:
        limits.append(
            Deadline(arrival + max_request_seconds, max_request_seconds, "max_request_seconds")
        )
    return min(limits, key=lambda d: d.at) if limits else None
