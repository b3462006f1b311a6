"""An engine's health as its loop reports it, and the rule that counts failed steps.

A step that raised, or in which every request that moved failed, is a failed step;
``failure_threshold`` of them in a row make the engine DEAD (``EngineLoop`` then ends every
request and refuses new ones; the supervisor restarts it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Sequence

from slipstream.core.request import FinishReason, RequestOutput

DEFAULT_FAILURE_THRESHOLD = 5  # failed steps in a row that mean the engine itself is broken


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
    """Counts failed steps in a row; says when they mean the engine is broken."""

    def __init__(self, threshold: int = DEFAULT_FAILURE_THRESHOLD) -> None:
        self.threshold = threshold

    def record(
        self, health: Health, outputs: Sequence[RequestOutput], error: Optional[str]
    ) -> tuple[Health, Optional[str]]:
        """The health after one step, and why the engine is dead (None: it serves on).

        A step that raised (``error``), or whose every output is an error, failed; one with
        any good output succeeded; one with no outputs (prefill chunks, nothing to do) says
        nothing."""
        if error is None and outputs:
            if all(o.finish_reason is FinishReason.ERROR for o in outputs):
                error = outputs[0].error
            elif health.consecutive_failures:
                return Health(HealthState.HEALTHY), None
        if error is None:
            return health, None
        count = health.consecutive_failures + 1
        failing = Health(HealthState.HEALTHY, count, error)
        if count < self.threshold:
            return failing, None
        return failing, f"{count} engine steps in a row failed; last error: {error}"
