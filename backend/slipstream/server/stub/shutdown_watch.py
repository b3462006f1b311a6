"""Whether Triton is unloading the model or stopping, seen from inside the stub.

Triton tells a model nothing before ``finalize``, which comes only once every request in
flight has ended, or never if its exit timeout runs out first (it then exits and may crash
mid-stream). So while requests are in flight the sender asks, every ``READY_POLL_S``, whether
Triton still serves (its HTTP frontend answers, this model is ready); once not, the model
drains: new requests are refused, those in flight get what is left of Triton's exit timeout
(less ``DRAIN_MARGIN_S``), then are aborted, so that each ends with an error while Triton
still waits for it.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from slipstream.server.stub.lifecycle import HttpStopProbe, triton_exit_timeout
from slipstream.server.stub.pending import PendingRequest

READY_POLL_S = 0.25  # how often, with requests in flight, Triton is asked if we still serve
DRAIN_MARGIN_S = 3.0  # ends a drain this long before Triton's exit timeout runs out


class ShutdownWatch:
    def __init__(self, model_ready: Callable[[], bool], logger) -> None:
        """``model_ready``: Triton's answer for this model (raises once Triton stops)."""
        self.model_ready, self.logger = model_ready, logger
        self.drain_grace = max(triton_exit_timeout() - DRAIN_MARGIN_S, 0.0)
        self.stop_probe = HttpStopProbe()
        self.draining_since: Optional[float] = None  # when Triton began unloading or stopping
        self.next_ready_check = 0.0
        self.not_ready_checks, self.first_not_ready = 0, 0.0

    @property
    def draining(self) -> bool:
        return self.draining_since is not None

    def watch(
        self, active: Sequence[PendingRequest], now: float, abort: Callable[[str], None]
    ) -> None:
        """Look again (when due); abort what is still running once the grace is spent."""
        if self.draining_since is None and not self._stopping(now, len(active)):
            return
        assert self.draining_since is not None
        if now - self.draining_since >= self.drain_grace:
            for p in active:
                if not p.shutdown_abort:
                    p.shutdown_abort = True
                    abort(p.request_id)

    def _stopping(self, now: float, num_active: int) -> bool:
        if now < self.next_ready_check:
            return False
        self.next_ready_check = now + READY_POLL_S
        # The HTTP frontend refusing connections is certain: it never serves again.
        certain = self.stop_probe.stopping()
        if not certain:
            try:
                if self.model_ready():
                    self.not_ready_checks = 0
                    return False
            except Exception:  # "Server not ready": tritonserver is stopping
                pass
        self.not_ready_checks += 1
        if self.not_ready_checks == 1:
            self.first_not_ready = now
        if self.not_ready_checks == 1 and not certain:  # a drain cannot be undone: look again
            return False
        self.draining_since = self.first_not_ready
        self.logger.log_warn(
            f"slipstream: Triton is unloading this model or stopping; "
            f"{num_active} requests get {self.drain_grace:.0f} s to finish"
        )
        return True
