"""How often the Triton adapter asks whether a request was cancelled.

Triton 2.51's Python backend tells a model nothing when a client cancels: the model asks,
with ``response_sender.is_cancelled()``, and each ask is a round trip to the tritonserver
process that wakes a thread in both processes on the cores the model runs on. So the asks
are rationed: a streaming request every ``streaming_s``, a request with nothing to send
(queued, or in a long prefill) every ``idle_s``, and all requests together at most
``per_second`` times a second (at batch 64 in the benchmark's burst the streaming polls alone
were 3,809 round trips against 4,658 responses).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CancelPolls:
    streaming_s: float = 0.1
    idle_s: float = 1.0
    per_second: float = 50.0  # at 64 in flight a cancel is seen within ~1.3 s

    def interval(self, has_output: bool, num_active: int) -> float:
        """Seconds between two asks about one request, with ``num_active`` in flight."""
        own = self.streaming_s if has_output else self.idle_s
        return max(own, num_active / self.per_second)

    def due(self, last_check: float, now: float, has_output: bool, num_active: int) -> bool:
        return now - last_check >= self.interval(has_output, num_active)
