"""The engine on a background thread: thread-safe submission, one output stream per request.

Callers (the Triton adapter, benchmarks) never touch the engine directly: they submit,
read their stream, and may abort. All engine state is owned by the loop thread; other
threads talk to it through a command queue. Its rooms: the streams and the admission counts
the threads share (``stream_table``), the commands other threads give the loop thread
(``loop_commands``), the tokenizer thread (``tokenizer_thread``), the step watchdog
(``step_watchdog``), the health rule (``health``), what it asks of its engine (``surface``).

The loop watches its own health (``health.StepFailures``): too many failed steps in a row, a
hung step, or the loop thread dying make the engine DEAD: every request still in it ends with
the error, new ones are refused with ``EngineDeadError`` and ``health()`` says why (the server
reports itself not ready and restarts the engine, see ``slipstream.engine.supervisor``).
"""

from __future__ import annotations

import gc
import itertools
import logging
import threading
import time
import traceback
from typing import TYPE_CHECKING, Callable, Optional

from slipstream.core.config import EngineConfig
from slipstream.core.pooling_params import PoolingParams
from slipstream.core.request import RequestOutput
from slipstream.core.sampling_params import SamplingParams
from slipstream.core.stats import StatsSnapshot
from slipstream.engine.admission import OverloadedError
from slipstream.engine.health import (
    DEFAULT_FAILURE_THRESHOLD,
    ENGINE_FAILED,
    ENGINE_NOT_SERVING,
    SHUTTING_DOWN,
    EngineDeadError,
    Health,
    HealthState,
    StepFailures,
)
from slipstream.engine.input_processor import (
    ClientRequest,
    Prompt,
    PromptOptions,
    RequestSettings,
    needs_tokenizer,
)
from slipstream.engine.llm_engine import LLMEngine, StepResult
from slipstream.engine.loop_commands import (
    AbortRequest,
    AddRequest,
    EmbedRequest,
    LoopCommands,
    Wake,
)
from slipstream.engine.output_stream import OutputStream
from slipstream.engine.step_watchdog import DEFAULT_STEP_TIMEOUT_S, StepWatchdog
from slipstream.engine.stream_table import StreamTable, error_output
from slipstream.engine.surface import EngineSurface
from slipstream.engine.tokenizer_thread import PoolingJob, TokenizeJob, TokenizerThread
from slipstream.worker.distributed.errors import GroupFailure

if TYPE_CHECKING:
    from typing_extensions import Unpack

log = logging.getLogger("slipstream")

__all__ = [
    "DEFAULT_FAILURE_THRESHOLD",
    "DEFAULT_STEP_TIMEOUT_S",
    "ENGINE_FAILED",
    "ENGINE_NOT_SERVING",
    "SHUTTING_DOWN",
    "EngineDeadError",
    "EngineLoop",
    "EngineSurface",
    "Health",
    "HealthState",
    "OutputStream",
    "OverloadedError",
]


class EngineLoop:
    def __init__(
        self,
        config_or_engine,
        *,
        on_output: Optional[Callable[[], None]] = None,
        on_dead: Optional[Callable[[Health], None]] = None,
        failure_threshold: int = DEFAULT_FAILURE_THRESHOLD,
        step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
        **engine_kwargs,
    ) -> None:
        """A config is turned into an engine by ``start()``, on the loop thread.

        ``on_output`` is called on the loop thread after each batch of outputs reaches the
        streams, so a reader can sleep until then instead of polling (a poller steals CPU
        from the model's threads). ``on_dead`` is called once, on the loop thread (the
        step watchdog's for a hung step), when the engine dies (after every request in it
        has been ended). ``step_timeout_s`` <= 0: no step watchdog."""
        if isinstance(config_or_engine, EngineConfig):
            self._build = lambda: LLMEngine(config_or_engine, **engine_kwargs)
            self.engine: Optional[EngineSurface] = None
        else:
            self._build = lambda: config_or_engine
            self.engine = config_or_engine
        self._streams = StreamTable()
        self._commands = LoopCommands(lambda: self._built_engine, self._streams, self._deliver)
        self._stats = StatsSnapshot()
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._closing = False  # shutdown began: nothing new is admitted
        self._on_output, self._on_dead = on_output, on_dead
        self._failures = StepFailures(failure_threshold)
        self._watchdog = StepWatchdog(
            step_timeout_s, self._stop, self._die, lambda: _fatal_error(self.engine)
        )
        self._tokenizer = TokenizerThread(
            lambda: self._built_engine.input_processor,
            self._streams,
            self._refusing,
            lambda req: self._commands.put(AddRequest(req)),
            lambda job: self._commands.put(EmbedRequest(job)),
            self._deliver,
        )
        self._health = Health(HealthState.STARTING)
        self._ids = itertools.count()

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> "EngineLoop":
        """Build the engine on the loop thread and return once it is ready (or raise what
        building it raised).

        Every torch op of the engine, model loading included, runs on that one thread: a
        second thread that has run a parallel op keeps its own OpenMP pool, and with more
        pool threads than cores libgomp stops spinning at barriers, which slowed CPU steps
        by 30-100% here."""
        if self._thread is None:
            built = threading.Event()
            failure: list = []
            self._thread = threading.Thread(
                target=self._main, args=(built, failure), name="slipstream-engine", daemon=True
            )
            self._thread.start()
            built.wait()
            if failure:
                self._thread.join()
                self._thread = None
                raise failure[0]
            self._tokenizer.start()
            self._watchdog.start()
        return self

    def _main(self, built: threading.Event, failure: list) -> None:
        try:
            self.engine = self._build()
            _freeze_heap()
            self._refresh_stats()
            self._health = Health(HealthState.HEALTHY)
        except BaseException as exc:  # handed to start()'s caller
            failure.append(exc)
            return
        finally:
            built.set()
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - a bug or a fatal error: nothing must hang
            log.critical("engine loop crashed:\n%s", traceback.format_exc())
            self._die(f"engine loop crashed: {type(exc).__name__}: {exc}")
        finally:
            _close(self.engine)

    @property
    def _built_engine(self) -> EngineSurface:
        """The engine, which ``start()`` built before anything uses it."""
        assert self.engine is not None, "the engine loop has not started"
        return self.engine

    @property
    def tokenizer(self):
        return self._built_engine.tokenizer

    def health(self) -> Health:
        return self._health

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort whatever is still running, deliver the final outputs, join the threads."""
        if self._thread is None:
            return
        with self._streams.lock:
            self._closing = True
        self._tokenizer.stop(timeout)
        self._stop.set()
        self._commands.put(Wake())
        self._thread.join(timeout)
        alive = self._thread.is_alive()
        self._thread = None
        with self._streams.lock:
            if self._health.state is not HealthState.DEAD:
                self._health = Health(HealthState.STOPPED)
        if self.engine is not None:
            _save_trace(self.engine, alive)
        _close(self.engine)  # a stuck step's peers among its processes

    def __enter__(self) -> "EngineLoop":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- client API ---------------------------------------------------------------------------
    def submit(
        self,
        prompt: Prompt,
        params: Optional[SamplingParams] = None,
        **settings: Unpack[RequestSettings],
    ) -> OutputStream:
        """Check what is cheap in the caller's thread (errors raise here) and queue the rest.

        Token-id prompts are validated here in full. A text prompt is checked for size
        here and tokenized on the tokenizer thread; if it is then refused, its stream ends
        with the error and ``stream.rejection`` set."""
        self._refuse_if_not_running()
        inputs = self._built_engine.input_processor
        rid = settings.get("request_id")
        if rid is None:
            rid = settings["request_id"] = f"req-{next(self._ids)}"
        client = ClientRequest.of(prompt, params, **settings)
        if needs_tokenizer(prompt):
            inputs.check(prompt, client.params)  # the rest on the tokenizer thread
            stream = self._streams.admit(rid, self._admission)
            self._tokenizer.put(TokenizeJob(stream, client))
            return stream
        req = inputs.process(client)
        stream = self._streams.admit(rid, self._admission)
        self._commands.put(AddRequest(req))
        return stream

    def embed(
        self,
        prompt: Prompt,
        params: Optional[PoolingParams] = None,
        request_id: Optional[str] = None,
        add_special_tokens: bool = True,
        truncate_prompt_tokens: Optional[int] = None,
    ) -> OutputStream:
        """A pooling request: its stream ends with one output holding ``embedding`` (or the
        error). Admitted as ``submit`` admits (a dead engine, a full queue refuse it)."""
        self._refuse_if_not_running()
        rid = request_id if request_id is not None else f"embd-{next(self._ids)}"
        if isinstance(prompt, str):
            self._built_engine.input_processor.check_prompt_size(prompt)
        stream = self._streams.admit(rid, self._admission)
        options = PromptOptions(add_special_tokens=add_special_tokens)
        pooling = params or PoolingParams()
        self._tokenizer.put(PoolingJob(stream, prompt, pooling, options, truncate_prompt_tokens))
        return stream

    def _refuse_if_not_running(self) -> None:
        if self._thread is None or self._stop.is_set():
            raise EngineDeadError(f"{ENGINE_NOT_SERVING}: the engine loop is not running")
        self._refuse_if_dead()

    def _refuse_if_dead(self) -> None:
        health = self._health
        if health.state is HealthState.DEAD:
            raise EngineDeadError(f"{ENGINE_NOT_SERVING}: {health.error}")
        if self._closing:
            raise EngineDeadError(SHUTTING_DOWN)

    def _admission(self, num_queued: int) -> None:
        """Under the streams' lock (which a dying loop sweeps them under): refused when
        dead, closing, or the queue is full."""
        self._refuse_if_dead()
        self._built_engine.check_queue_room(num_queued)

    def _refusing(self) -> bool:
        return self._closing or self._health.state is HealthState.DEAD

    def abort(self, request_id: str) -> None:
        self._streams.mark_aborted(request_id)
        self._commands.put(AbortRequest(request_id))

    def stats(self) -> StatsSnapshot:
        """The engine's counters as of its last step (immutable: safe to read anywhere)."""
        return self._stats

    def generate(
        self, prompt: Prompt, params: Optional[SamplingParams] = None, **kw
    ) -> RequestOutput:
        """Blocking convenience: the whole output of one request (n = 1; with n > 1 read the
        stream, each output names its sequence in ``index``)."""
        if params is not None and params.n > 1:
            raise ValueError(
                "generate returns one sequence: submit n > 1 requests and read each output's index"
            )
        return self.submit(prompt, params, **kw).collect()

    # -- the loop thread ----------------------------------------------------------------------
    def _run(self) -> None:
        engine = self._built_engine
        while not self._stop.is_set():
            self._commands.drain(wait=None if engine.has_unfinished() else 0.1)
            if self._stop.is_set():
                break
            fatal = _fatal_error(engine)
            if fatal is not None:  # seen between steps, even while idle
                self._die(fatal)
                return
            self._watchdog.step_begins()
            try:
                result = engine.step()
                error = None
            except GroupFailure as exc:  # no step can run any more
                self._watchdog.step_ends()
                self._die(str(exc))
                return
            except Exception as exc:  # one bad batch must not kill the server
                log.error("engine step failed:\n%s", traceback.format_exc())
                error = f"internal error: {exc}"
                result = StepResult(engine.fail_running(error), ran=False)
            finally:
                self._watchdog.step_ends()
            if self._health.state is HealthState.DEAD:  # declared hung while it ran
                return
            self._deliver(result.outputs)
            self._health, death = self._failures.record(self._health, result.outputs, error)
            if death is not None:
                self._die(death)
                return
            self._refresh_stats()
            if not result.ran and engine.has_unfinished():
                self._idle_wait()
        self._abort_all()

    def _die(self, reason: str) -> None:
        """End every request with ``reason`` and refuse new ones; the loop thread exits."""
        log.critical("slipstream engine is dead: %s", reason)
        with self._streams.lock:
            if self._health.state is HealthState.DEAD:  # the watchdog and the loop raced
                return
            self._health = Health(HealthState.DEAD, self._health.consecutive_failures, reason)
            self._watchdog.dead = True
            streams = self._streams.sweep()
        for stream in streams:
            stream.rejection = EngineDeadError(f"{ENGINE_FAILED}: {reason}")
            stream.put(error_output(stream.request_id, f"{ENGINE_FAILED}: {reason}"))
        if streams and self._on_output is not None:
            self._on_output()
        if self._on_dead is not None:
            try:
                self._on_dead(self._health)
            except Exception:  # noqa: BLE001 - a failing observer must not hide the death
                log.error("on_dead callback failed:\n%s", traceback.format_exc())

    def _idle_wait(self) -> None:
        # Dynamic batching holds requests for its delay window: sleep until then or a command.
        deadline = self._built_engine.next_wakeup()
        delay = 0.001 if deadline is None else max(min(deadline - time.monotonic(), 0.05), 0.0005)
        self._commands.drain(wait=delay)

    def _refresh_stats(self) -> None:
        self._stats = self._built_engine.get_stats()
        self._streams.set_waiting(self._stats.num_waiting)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        self._streams.deliver(outputs)
        if outputs and self._on_output is not None:
            self._on_output()

    def _abort_all(self) -> None:
        self._deliver(self._built_engine.abort_all())
        self._commands.abort_unadded()
        self._refresh_stats()


def _close(engine: Optional[EngineSurface]) -> None:
    """End the engine's other processes (a tensor-parallel group's ranks), from the loop
    thread as it ends (they die with the thread that started them: they are stopped first),
    or from ``shutdown`` when that thread is stuck in a step."""
    close = getattr(engine, "close", None)
    if close is not None:
        close()


def _fatal_error(engine: Optional[EngineSurface]) -> Optional[str]:
    """Why ``engine`` can serve nothing more (``LLMEngine.fatal_error``), or None."""
    probe = getattr(engine, "fatal_error", None)
    return probe() if probe is not None else None


def _save_trace(engine: EngineSurface, loop_alive: bool) -> None:
    if loop_alive:  # the records may still be changing under us
        log.warning("engine loop did not stop in time; step trace not written")
        return
    try:
        path = engine.save_trace()
    except OSError as exc:  # a bad path must not break shutdown
        log.error("cannot write the step trace: %s", exc)
        return
    if path is not None:
        log.info("step trace written to %s", path)


def _freeze_heap() -> None:
    """Move everything alive after start-up (the model, the tokenizer, the libraries: ~380k
    objects for the default model) out of the cyclic collector's reach, as vLLM does after
    loading: a full collection then scans only what serving allocates. Measured here, a full
    collection took ~200 ms with them and under 1 ms after ``gc.freeze()``: one such pause
    lands in a step and on every running request's inter-token latency. What an earlier
    start froze is thawed first: a loop the supervisor replaced lives in reference cycles, and
    frozen it could never be collected (the whole dead engine, model included, would stay)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
