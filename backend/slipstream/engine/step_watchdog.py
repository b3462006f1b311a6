"""The step watchdog: a thread that looks at the running step's age. A step that never
returns (a forward or kernel that hangs) is past ``step_timeout_s`` (the first steps, which
may compile kernels or capture graphs, get ``FIRST_STEPS_TIMEOUT_FACTOR`` times that), and
the engine dies from this thread: every client gets its error and the server is told, though
the stuck loop thread cannot be stopped."""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

FatalProbe = Callable[[], Optional[str]]  # why the engine can serve nothing more, or None

DEFAULT_STEP_TIMEOUT_S = 120.0  # a step running this long is hung (vLLM's iteration timeout: 60)
FIRST_STEPS = 3  # steps that may compile kernels or capture graphs first
FIRST_STEPS_TIMEOUT_FACTOR = 10


class StepWatchdog:
    def __init__(
        self,
        timeout_s: float,
        stopped: threading.Event,
        on_hung: Callable[[str], None],
        fatal: FatalProbe = lambda: None,
    ) -> None:
        """``on_hung(reason)`` is called once, from the watchdog's thread: for a step past its
        time, or a step under way while ``fatal()`` says the engine broke (a tensor-parallel
        rank died: the step waits on what will never come)."""
        self.timeout_s, self.stopped, self.on_hung = timeout_s, stopped, on_hung
        self.fatal = fatal
        self.step_started: Optional[float] = None  # monotonic start of the running step
        self.steps_started = 0
        self.dead = False  # the engine died (of anything): nothing left to watch
        self.thread: Optional[threading.Thread] = None

    def start(self) -> None:
        if self.timeout_s > 0:
            self.thread = threading.Thread(
                target=self._run, name="slipstream-step-watchdog", daemon=True
            )
            self.thread.start()

    def step_begins(self) -> None:
        self.steps_started += 1
        self.step_started = time.monotonic()

    def step_ends(self) -> None:
        self.step_started = None

    def _run(self) -> None:
        while not self.stopped.wait(min(self.timeout_s / 4, 0.5)):
            started = self.step_started
            if started is None or self.dead:
                continue
            fatal = self.fatal()
            if fatal is not None:
                self.on_hung(fatal)
                return
            limit = self.timeout_s * (
                FIRST_STEPS_TIMEOUT_FACTOR if self.steps_started <= FIRST_STEPS else 1
            )
            age = time.monotonic() - started
            if age > limit and self.step_started == started:
                self.on_hung(
                    f"an engine step has run for {age:.0f} s, past step_timeout_s "
                    f"({limit:.0f} s): the engine is hung"
                )
                return
