"""Keeps an engine serving: a dead ``EngineLoop`` is replaced by a fresh one, with backoff,
until too many restarts in a row say the problem is not transient (the caller is told, and
the Triton adapter then takes the whole server down so that an orchestrator restarts it).

While a restart is under way every new request is refused at once (``EngineDeadError``)
and ``health()`` reports it, so the server answers "not ready" instead of queueing work for
an engine that is not there.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Callable, Optional, Union

from slipstream.core.config import EngineConfig
from slipstream.core.stats import StatsSnapshot
from slipstream.engine.loop import (
    DEFAULT_FAILURE_THRESHOLD,
    DEFAULT_STEP_TIMEOUT_S,
    ENGINE_NOT_SERVING,
    EngineDeadError,
    EngineLoop,
    Health,
    HealthState,
    OutputStream,
)

log = logging.getLogger("slipstream")

ConfigSource = Union[EngineConfig, Callable[[], EngineConfig]]


class RestartBudget:
    """``max_restarts`` restarts within ``window_s``; the n-th restart in the window waits
    ``backoff_s * 2**(n-1)`` first."""

    def __init__(self, max_restarts: int, window_s: float, backoff_s: float) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.backoff_s = backoff_s
        self._deaths: list[float] = []  # monotonic times of deaths inside the window

    def death(self, now: float) -> int:
        """Count a death at ``now``: which restart in the window it asks for (1, 2, ...)."""
        self._deaths = [t for t in self._deaths if now - t < self.window_s] + [now]
        return len(self._deaths)

    def delay(self, attempt: int) -> float:
        """Seconds to wait before the ``attempt``-th restart in the window."""
        return self.backoff_s * 2 ** (attempt - 1)


class EngineSupervisor:
    def __init__(
        self,
        config: ConfigSource,
        *,
        on_output: Optional[Callable[[], None]] = None,
        on_give_up: Optional[Callable[[Health], None]] = None,
        failure_threshold: int = DEFAULT_FAILURE_THRESHOLD,
        max_restarts: int = 3,
        restart_window_s: float = 600.0,
        restart_backoff_s: float = 1.0,
        step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
        engine_kwargs: Optional[dict] = None,
    ) -> None:
        """``engine_kwargs`` go to every ``LLMEngine`` built (e.g. ``kv_event_sink``: the
        sink outlives engines, so a consumer sees one stream across restarts).
        ``max_restarts`` restarts are allowed within ``restart_window_s``; the next death
        calls ``on_give_up`` (on a supervisor thread) and leaves the engine dead. The n-th
        restart in the window waits ``restart_backoff_s * 2**(n-1)`` first."""
        self._config = config
        self._on_output = on_output
        self._on_give_up = on_give_up
        self._failure_threshold = failure_threshold
        self._step_timeout_s = step_timeout_s
        self._budget = RestartBudget(max_restarts, restart_window_s, restart_backoff_s)
        self._engine_kwargs = dict(engine_kwargs or {})
        self._lock = threading.Lock()
        self._loop: Optional[EngineLoop] = None
        self._override: Optional[Health] = Health(HealthState.STARTING)  # else: the loop's
        self._stopping = False
        self.restarts = 0  # engines started after the first one

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> "EngineSupervisor":
        """Build the first engine (raises what building it raises: a bad config is not a
        failure to retry)."""
        self._loop = self._new_loop()
        self._override = None
        return self

    def _new_loop(self) -> EngineLoop:
        config = self._config() if callable(self._config) else self._config
        return EngineLoop(
            config,
            on_output=self._on_output,
            on_dead=self._on_dead,
            failure_threshold=self._failure_threshold,
            step_timeout_s=self._step_timeout_s,
            **self._engine_kwargs,
        ).start()

    def shutdown(self, timeout: float = 30.0) -> None:
        with self._lock:
            self._stopping = True
            loop = self._loop
            self._override = Health(HealthState.STOPPED)
        if loop is not None:
            loop.shutdown(timeout)

    # -- what the server uses -------------------------------------------------------------------
    @property
    def loop(self) -> Optional[EngineLoop]:
        return self._loop

    def _serving_loop(self) -> EngineLoop:
        """The loop, which exists while no override health is set (a start or restart)."""
        loop = self._loop
        assert loop is not None, "no engine loop (not started, or restarting)"
        return loop

    def health(self) -> Health:
        override = self._override
        if override is not None:
            return override
        return self._serving_loop().health()

    def submit(self, *args, **kwargs) -> OutputStream:
        self._refuse_unless_serving()
        return self._serving_loop().submit(*args, **kwargs)

    def embed(self, *args, **kwargs) -> OutputStream:
        """A pooling request (``EngineLoop.embed``), refused as ``submit`` refuses."""
        self._refuse_unless_serving()
        return self._serving_loop().embed(*args, **kwargs)

    def _refuse_unless_serving(self) -> None:
        health = self._override
        if health is not None and health.state is not HealthState.STOPPED:
            raise EngineDeadError(f"{ENGINE_NOT_SERVING} ({health.state.value}): {health.error}")

    def abort(self, request_id: str) -> None:
        self._serving_loop().abort(request_id)

    @property
    def tokenizer(self):
        return self._loop.tokenizer

    def stats(self) -> StatsSnapshot:
        return self._loop.stats() if self._loop is not None else StatsSnapshot()

    # -- restarts -------------------------------------------------------------------------------
    def _on_dead(self, health: Health) -> None:
        # Called on the dying loop's thread: the restart (a model load) runs on its own.
        threading.Thread(
            target=self._restart, args=(health,), name="slipstream-restart", daemon=True
        ).start()

    def _restart(self, health: Health) -> None:
        while True:
            with self._lock:
                if self._stopping:
                    return
                attempt = self._budget.death(time.monotonic())
                if attempt > self._budget.max_restarts:
                    self._give_up(health, attempt - 1)
                    return
                self._override = Health(
                    HealthState.RESTARTING, health.consecutive_failures, health.error
                )
                old, self._loop = self._loop, None
            log.error(
                "slipstream engine died (%s); restart %d of %d in %.0f s",
                health.error,
                attempt,
                self._budget.max_restarts,
                self._budget.delay(attempt),
            )
            self._release(old)
            time.sleep(self._budget.delay(attempt))
            try:
                loop = self._new_loop()
            except Exception as exc:  # noqa: BLE001 - counted as another death
                log.error("slipstream engine restart failed: %s", exc)
                health = Health(HealthState.DEAD, 0, f"restart failed: {exc}")
                continue
            with self._lock:
                if self._stopping:
                    loop.shutdown()
                    return
                self._loop = loop
                self._override = None
                self.restarts += 1
            log.warning("slipstream engine restarted")
            return

    def _give_up(self, health: Health, restarts: int) -> None:
        reason = (
            f"the engine died {restarts + 1} times within {self._budget.window_s:.0f} s; last "
            f"error: {health.error}"
        )
        self._override = Health(HealthState.DEAD, health.consecutive_failures, reason)
        log.critical("slipstream: giving up on the engine: %s", reason)
        if self._on_give_up is not None:
            threading.Thread(
                target=self._on_give_up,
                args=(self._override,),
                name="slipstream-give-up",
                daemon=True,
            ).start()

    @staticmethod
    def _release(loop: Optional[EngineLoop]) -> None:
        """Free a dead engine's memory (its KV cache, the model) before loading another."""
        if loop is None:
            return
        loop.shutdown(timeout=5.0)
        engine, loop.engine = loop.engine, None
        del engine
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - best effort
            pass
