"""What every load path shares: sending on an arrival schedule, and the progress bar."""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterable, Optional, Sequence

from slipstream_bench.metrics import RequestRecord

IN_FLIGHT_POLL_S = 0.0005  # how often a closed loop looks for a finished request


class Arrivals(list):
    """Send offsets in seconds (sorted), and how many requests may be in flight at once:
    0 = open loop (each goes out at its offset); 1 = one request at a time (the next goes out
    once the previous one has its last token), as a single user would send them."""

    def __init__(self, offsets: Iterable[float] = (), max_in_flight: int = 0) -> None:
        super().__init__(offsets)
        self.max_in_flight = max_in_flight


def send_on_schedule(
    offsets: Sequence[float],
    send: Callable[[int], None],
    start: Optional[float] = None,
    records: Optional[Sequence[RequestRecord]] = None,
) -> float:
    """Call ``send(i)`` at ``start + offsets[i]`` (perf_counter); returns ``start``.

    Offsets are sorted by construction (a Poisson process or all zero), so one sleeping
    loop suffices; with all-zero offsets everything goes out back to back. ``Arrivals``
    with ``max_in_flight`` also holds each send until fewer than that many of ``records``
    (request i's record is ``records[i]``) are unfinished.
    """
    start = time.perf_counter() if start is None else start
    limit = getattr(offsets, "max_in_flight", 0)
    for i, offset in enumerate(offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        if limit and records is not None:
            _wait_for_slot(records[:i], limit)
        send(i)
    return start


def _wait_for_slot(sent: Sequence[RequestRecord], limit: int) -> None:
    while sum(1 for rec in sent if not rec.finished) >= limit:
        time.sleep(IN_FLIGHT_POLL_S)


class Progress:
    """A tqdm bar over output tokens (thread-safe updates), or nothing when disabled."""

    def __init__(self, label: str, total_tokens: int, enabled: bool = True) -> None:
        self._bar = None
        self._lock = threading.Lock()
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_tokens,
                desc=f"{label:>14}",
                unit="tok",
                dynamic_ncols=True,
                leave=True,
                mininterval=0.5,
            )

    def update(self, tokens: int) -> None:
        if self._bar is not None and tokens:
            with self._lock:
                self._bar.update(tokens)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
