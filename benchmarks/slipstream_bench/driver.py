"""What every load path shares: sending on an arrival schedule, and the progress bar."""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional, Sequence


def send_on_schedule(
    offsets: Sequence[float], send: Callable[[int], None], start: Optional[float] = None
) -> float:
    """Call ``send(i)`` at ``start + offsets[i]`` (perf_counter); returns ``start``.

    Offsets are sorted by construction (a Poisson process or all zero), so one sleeping
    loop suffices; with all-zero offsets everything goes out back to back.
    """
    start = time.perf_counter() if start is None else start
    for i, offset in enumerate(offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        send(i)
    return start


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
