"""The one admission rule for ``max_queue_size``: a request is refused, not queued, when the
queue is full. The offline engine counts its waiting requests; the engine loop adds those
submitted but not yet handed to the engine thread."""

from __future__ import annotations

from dataclasses import dataclass

OVERLOADED = "server overloaded"  # every queue-full message starts so (frontends match it)
RETRY_AFTER_S = 1  # what a refused client is told to wait before it tries again


class OverloadedError(RuntimeError):
    """The waiting queue is full: the request is refused instead of queued."""

    @classmethod
    def queue_full(cls, limit: int) -> "OverloadedError":
        return cls(
            f"{OVERLOADED}: {limit} requests already waiting (max_queue_size); "
            f"retry after {RETRY_AFTER_S} s"
        )


@dataclass(frozen=True)
class QueueLimit:
    max_queue_size: int  # 0: no limit

    def check(self, num_queued: int) -> None:
        """Raise ``OverloadedError`` when ``num_queued`` requests already fill the queue."""
        if self.max_queue_size and num_queued >= self.max_queue_size:
            raise OverloadedError.queue_full(self.max_queue_size)
