"""An engine's health as its loop reports it, and the rule that tells a broken engine from a
broken request (``StepFailures``): once it says so the engine is DEAD (``EngineLoop`` then ends
every request and refuses new ones; the supervisor restarts it, or the server goes away for
its orchestrator to replace).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Sequence

from slipstream.core.request import FinishReason, RequestOutput

DEFAULT_FAILURE_THRESHOLD = 5  # failed steps (or requests) in a row that mean a broken engine
# How the loop's refusals and failures begin: frontends map them to a status by these texts
# (an error crosses Triton's gRPC stream as text only).
ENGINE_FAILED = "the engine failed"  # it died (crash, hung step, failing steps): it restarts
ENGINE_NOT_SERVING = "the engine is not serving"  # dead or restarting
SHUTTING_DOWN = "the server is shutting down"


class HealthState(str, enum.Enum):
    STARTING = "starting"
    HEALTHY = "healthy"
    DEAD = "dead"  # crashed, or failing step after step: it serves nothing any more
    RESTARTING = "restarting"  # a dead engine being replaced (EngineSupervisor)
    STOPPED = "stopped"  # shut down on purpose


@dataclass(frozen=True)
class Health:
    state: HealthState
    consecutive_failures: int = 0
    error: Optional[str] = None  # the last failed step's error, or why the engine died

    @property
    def ok(self) -> bool:
        return self.state is HealthState.HEALTHY


class EngineDeadError(RuntimeError):
    """The engine is not serving (dead, restarting or stopped): the request is refused at
    once instead of waiting on an engine that will never answer."""


class StepFailures:
    """Says when failures mean the engine itself is broken, not a request: ``threshold``
    failed steps in a row, or ``threshold`` different requests failing inside the engine
    with none served in between (the window every failing request belongs to).

    A step fails when it raised (``error``) or every output it made is an error; one with
    any good output served a request and closes the window; one with no outputs (prefill
    chunks, nothing to do) says nothing. The second rule is what sees a forward that fails
    for everyone: the engine retries a failed batch one request at a time, so each request
    fails alone, and a batch of them makes only one failed step. One request that breaks the
    forward by itself still fails alone and the engine serves on: the requests beside it are
    served, or the next one is."""

    def __init__(self, threshold: int = DEFAULT_FAILURE_THRESHOLD) -> None:
        self.threshold = threshold
        self.failed_requests: set[str] = set()  # failed inside the engine since one was served

    def record(
        self, health: Health, outputs: Sequence[RequestOutput], error: Optional[str]
    ) -> tuple[Health, Optional[str]]:
        """The health after one step, and why the engine is dead (None: it serves on)."""
        failed = [o for o in outputs if o.finish_reason is FinishReason.ERROR]
        if error is None and len(failed) < len(outputs):  # a request was served
            self.failed_requests.clear()
            return (Health(HealthState.HEALTHY) if health.consecutive_failures else health), None
        if error is None and not outputs:
            return health, None
        error = error or failed[0].error
        self.failed_requests.update(o.request_id for o in failed)
        count = health.consecutive_failures + 1
        failing = Health(HealthState.HEALTHY, count, error)
        if count >= self.threshold:
            return failing, f"{count} engine steps in a row failed; last error: {error}"
        if len(self.failed_requests) >= self.threshold:
            return failing, (
                f"{len(self.failed_requests)} requests in a row failed in the engine, none "
                f"served in between; last error: {error}"
            )
        return failing, None
