"""The engine on a background thread: thread-safe submission, one output stream per request.

Callers (the Triton adapter, benchmarks) never touch the engine directly: they submit,
read their stream, and may abort. All engine state is owned by the loop thread; other
threads talk to it through a command queue. Text prompts are tokenized on a tokenizer
thread, so a long prompt holds up neither the caller (Triton's ``execute``, which every
other new request waits behind) nor the engine's steps.

The loop watches its own health. A step that raises, or in which every request that moved
failed, is a failed step; ``failure_threshold`` of them in a row, or the loop thread dying,
make the engine DEAD: every request still in it ends with the error, new ones are refused
with ``EngineDeadError`` and ``health()`` says why (the server reports itself not ready and
restarts the engine, see ``slipstream.engine.supervisor``).

A step that never returns (a forward or kernel that hangs) is seen by the step watchdog, a
thread that looks at the running step's age: past ``step_timeout_s`` (the first steps, which
may compile kernels or capture graphs, get ``FIRST_STEPS_TIMEOUT_FACTOR`` times that) the
engine dies as above, from that thread: every client gets its error and the server is told,
though the stuck loop thread cannot be stopped.
"""

from __future__ import annotations

import enum
import gc
import itertools
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Protocol, Union

from slipstream.core.config import EngineConfig
from slipstream.core.pooling_params import PoolingParams
from slipstream.core.request import FinishReason, Request, RequestOutput, merge_output
from slipstream.core.sampling_params import SamplingParams
from slipstream.core.stats import StatsSnapshot
from slipstream.engine.admission import OverloadedError
from slipstream.engine.input_processor import InputProcessor, Prompt, PromptOptions, needs_tokenizer
from slipstream.engine.llm_engine import LLMEngine, StepResult
from slipstream.worker.distributed.errors import GroupFailure

log = logging.getLogger("slipstream")

__all__ = [
    "EngineDeadError",
    "EngineLoop",
    "Health",
    "HealthState",
    "OutputStream",
    "OverloadedError",
]

DEFAULT_FAILURE_THRESHOLD = 5  # failed steps in a row that mean the engine itself is broken
DEFAULT_STEP_TIMEOUT_S = 120.0  # a step running this long is hung (vLLM's iteration timeout: 60)
FIRST_STEPS = 3  # steps that may compile kernels or capture graphs first
FIRST_STEPS_TIMEOUT_FACTOR = 10
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


class OutputStream:
    """Incremental outputs of one request; iteration ends after the finished one.

    ``rejection`` is the exception when the request was refused after ``submit`` returned
    (its text prompt is checked on the tokenizer thread) or ended by the engine's death: a
    ``ValueError`` is the client's fault, an ``EngineDeadError`` the engine's."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: "queue.Queue[RequestOutput]" = queue.Queue()
        self.finished = False
        self.rejection: Optional[Exception] = None

    def put(self, output: RequestOutput) -> None:
        self._queue.put(output)

    def get(self, timeout: Optional[float] = None) -> RequestOutput:
        out = self._queue.get(timeout=timeout)
        if out.finished:
            self.finished = True
        return out

    def __iter__(self) -> Iterator[RequestOutput]:
        while not self.finished:
            yield self.get()


class EngineSurface(Protocol):
    """All the loop asks of its engine (``LLMEngine`` has it; so may a test's fake)."""

    tokenizer: object
    input_processor: InputProcessor

    def add(self, req: Request, check_queue: bool = True) -> None: ...
    def embed(self, token_ids: list[int], params: PoolingParams) -> list[float]: ...
    def abort(self, request_id: str) -> Optional[RequestOutput]: ...
    def step(self) -> StepResult: ...
    def has_unfinished(self) -> bool: ...
    def num_waiting(self) -> int: ...
    def next_wakeup(self) -> Optional[float]: ...
    def check_queue_room(self, num_queued: int) -> None: ...
    def fail_running(self, message: str) -> list[RequestOutput]: ...
    def abort_all(self) -> list[RequestOutput]: ...
    def save_trace(self) -> Optional[str]: ...
    def get_stats(self) -> StatsSnapshot: ...


@dataclass
class _TokenizeJob:
    stream: OutputStream
    prompt: Prompt
    params: SamplingParams
    priority: int
    options: PromptOptions


@dataclass
class _PoolingJob:
    """A pooling (embedding) request: tokenized on the tokenizer thread, run on the loop
    thread between steps (``LLMEngine.embed``)."""

    stream: OutputStream
    prompt: Prompt
    params: PoolingParams
    options: PromptOptions
    truncate: Optional[int] = None
    token_ids: Optional[list[int]] = None


def _error_output(
    request_id: str, message: str, reason: FinishReason = FinishReason.ERROR
) -> RequestOutput:
    return RequestOutput(request_id, finished=True, finish_reason=reason, error=message)


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
        self._commands: "queue.Queue[tuple]" = queue.Queue()
        self._jobs: "queue.Queue[Union[_TokenizeJob, _PoolingJob, None]]" = queue.Queue()
        self._streams: dict[str, OutputStream] = {}
        self._lock = threading.Lock()  # guards _streams, _aborted_early, health, admission
        self._pending = 0  # submitted, not yet seen by the loop thread
        self._aborted_early: set[str] = set()  # aborted before the engine had them
        # Waiting requests as the loop thread last saw them; updated in the same critical
        # section that retires a pending request, so waiting + pending never undercounts.
        self._stats = StatsSnapshot()
        self._num_waiting = 0
        self._thread: Optional[threading.Thread] = None
        self._tokenizer_thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._closing = False  # shutdown began: nothing new is admitted
        self._on_output = on_output
        self._on_dead = on_dead
        self._failure_threshold = failure_threshold
        self._step_timeout_s = step_timeout_s
        self._step_started: Optional[float] = None  # monotonic start of the running step
        self._steps_started = 0
        self._watchdog_thread: Optional[threading.Thread] = None
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
            self._tokenizer_thread = threading.Thread(
                target=self._tokenizer_main, name="slipstream-tokenizer", daemon=True
            )
            self._tokenizer_thread.start()
            if self._step_timeout_s > 0:
                self._watchdog_thread = threading.Thread(
                    target=self._watch_steps, name="slipstream-step-watchdog", daemon=True
                )
                self._watchdog_thread.start()
        return self

    def _main(self, built: threading.Event, failure: list) -> None:
        try:
            self.engine = self._build()
            _freeze_heap()
            self._stats = self.engine.get_stats()
            self._num_waiting = self._stats.num_waiting
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
            self._close_engine()

    def _close_engine(self) -> None:
        """End the engine's other processes (a tensor-parallel group's ranks), from the loop
        thread as it ends (they die with the thread that started them: they are stopped
        first), or from ``shutdown`` when that thread is stuck in a step."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    @property
    def _built_engine(self) -> EngineSurface:
        """The engine, which ``start()`` built before anything uses it."""
        assert self.engine is not None, "the engine loop has not started"
        return self.engine

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def health(self) -> Health:
        return self._health

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort whatever is still running, deliver the final outputs, join the threads."""
        if self._thread is None:
            return
        with self._lock:
            self._closing = True
        self._jobs.put(None)  # the tokenizer ends what it holds (see _tokenizer_main)
        if self._tokenizer_thread is not None:
            self._tokenizer_thread.join(timeout)
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout)
        alive = self._thread.is_alive()
        self._thread = None
        with self._lock:
            if self._health.state is not HealthState.DEAD:
                self._health = Health(HealthState.STOPPED)
        self._save_trace(alive)
        self._close_engine()  # a stuck step's peers among its processes

    def _save_trace(self, loop_alive: bool) -> None:
        if self.engine is None:
            return
        if loop_alive:  # the records may still be changing under us
            log.warning("engine loop did not stop in time; step trace not written")
            return
        try:
            path = self.engine.save_trace()
        except OSError as exc:  # a bad path must not break shutdown
            log.error("cannot write the step trace: %s", exc)
            return
        if path is not None:
            log.info("step trace written to %s", path)

    def __enter__(self) -> "EngineLoop":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- client API ---------------------------------------------------------------------------
    def submit(
        self,
        prompt: Prompt,
        params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
        priority: int = 0,
        apply_chat_template: bool = False,
        add_special_tokens: bool = True,
    ) -> OutputStream:
        """Check what is cheap in the caller's thread (errors raise here) and queue the rest.

        Token-id prompts are validated here in full. A text prompt is checked for size
        here and tokenized on the tokenizer thread; if it is then refused, its stream ends
        with the error and ``stream.rejection`` set."""
        if self._thread is None or self._stop.is_set():
            raise EngineDeadError(f"{ENGINE_NOT_SERVING}: the engine loop is not running")
        self._refuse_if_dead()
        inputs = self._built_engine.input_processor
        params = params or SamplingParams()
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        options = PromptOptions(apply_chat_template, add_special_tokens)
        if needs_tokenizer(prompt):
            inputs.check(prompt, params)  # the rest on the tokenizer thread
            stream = self._admit(rid)
            self._jobs.put(_TokenizeJob(stream, prompt, params, priority, options))
            return stream
        req = inputs.process(prompt, params, rid, priority, options)
        stream = self._admit(rid)
        self._commands.put(("add", req))
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
        if self._thread is None or self._stop.is_set():
            raise EngineDeadError(f"{ENGINE_NOT_SERVING}: the engine loop is not running")
        self._refuse_if_dead()
        rid = request_id if request_id is not None else f"embd-{next(self._ids)}"
        if isinstance(prompt, str):
            self._built_engine.input_processor.check_prompt_size(prompt)
        stream = self._admit(rid)
        options = PromptOptions(add_special_tokens=add_special_tokens)
        pooling = params or PoolingParams()
        self._jobs.put(_PoolingJob(stream, prompt, pooling, options, truncate_prompt_tokens))
        return stream

    def _refuse_if_dead(self) -> None:
        health = self._health
        if health.state is HealthState.DEAD:
            raise EngineDeadError(f"{ENGINE_NOT_SERVING}: {health.error}")
        if self._closing:
            raise EngineDeadError(SHUTTING_DOWN)

    def _admit(self, request_id: str) -> OutputStream:
        with self._lock:
            self._refuse_if_dead()  # again, under the lock a dying loop sweeps streams with
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._built_engine.check_queue_room(self._num_waiting + self._pending)
            stream = OutputStream(request_id)
            self._streams[request_id] = stream
            self._pending += 1
        return stream

    def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._streams:
                self._aborted_early.add(request_id)  # in case the engine does not have it yet
        self._commands.put(("abort", request_id))

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
        stream = self.submit(prompt, params, **kw)
        total = RequestOutput(stream.request_id)
        for out in stream:
            merge_output(total, out)
        return total

    # -- the tokenizer thread -----------------------------------------------------------------
    def _tokenizer_main(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                break
            if self._closing or self._health.state is HealthState.DEAD:
                self._reject(job.stream, None)
                continue
            with self._lock:
                skip = job.stream.request_id in self._aborted_early
            if skip:
                self._reject(job.stream, None)
                continue
            inputs = self._built_engine.input_processor
            try:
                if isinstance(job, _PoolingJob):
                    job.token_ids = inputs.pooling_ids(job.prompt, job.options, job.truncate)
                    self._commands.put(("embed", job))
                    continue
                req = inputs.process(
                    job.prompt, job.params, job.stream.request_id, job.priority, job.options
                )
            except Exception as exc:  # noqa: BLE001 - refused: this request alone
                self._reject(job.stream, exc)
                continue
            self._commands.put(("add", req))
        while True:  # shutting down: what is still queued never reaches the engine
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self._reject(job.stream, None)

    def _reject(self, stream: OutputStream, exc: Optional[Exception]) -> None:
        """End a request that never reached the engine (refused, aborted or shut out)."""
        stream.rejection = exc
        if exc is None:
            out = RequestOutput(stream.request_id, finished=True, finish_reason=FinishReason.ABORT)
        else:
            out = _error_output(stream.request_id, str(exc))
        with self._lock:
            if self._streams.get(stream.request_id) is stream:  # not already swept by _die
                self._pending -= 1
        self._deliver([out])

    # -- the loop thread ----------------------------------------------------------------------
    def _run(self) -> None:
        engine = self._built_engine
        while not self._stop.is_set():
            self._drain_commands(block=not engine.has_unfinished())
            if self._stop.is_set():
                break
            fatal = _fatal_error(engine)
            if fatal is not None:  # seen between steps, even while idle
                self._die(fatal)
                return
            self._steps_started += 1
            self._step_started = time.monotonic()
            try:
                result = engine.step()
                error = None
            except GroupFailure as exc:  # no step can run any more
                self._step_started = None
                self._die(str(exc))
                return
            except Exception as exc:  # one bad batch must not kill the server
                log.error("engine step failed:\n%s", traceback.format_exc())
                error = f"internal error: {exc}"
                result = StepResult(engine.fail_running(error), ran=False)
            finally:
                self._step_started = None
            if self._health.state is HealthState.DEAD:  # declared hung while it ran
                return
            self._deliver(result.outputs)
            if self._record_step(result.outputs, error):
                return
            self._refresh_stats()
            if not result.ran and engine.has_unfinished():
                self._idle_wait()
        self._abort_all()

    def _watch_steps(self) -> None:
        """The step watchdog: a step past its timeout kills the engine (see the module)."""
        while not self._stop.wait(min(self._step_timeout_s / 4, 0.5)):
            started = self._step_started
            if started is None or self._health.state is HealthState.DEAD:
                continue
            fatal = _fatal_error(self._built_engine)
            if fatal is not None:  # the step under way waits on what will never come
                self._die(fatal)
                return
            limit = self._step_timeout_s * (
                FIRST_STEPS_TIMEOUT_FACTOR if self._steps_started <= FIRST_STEPS else 1
            )
            age = time.monotonic() - started
            if age > limit and self._step_started == started:
                self._die(
                    f"an engine step has run for {age:.0f} s, past step_timeout_s "
                    f"({limit:.0f} s): the engine is hung"
                )
                return

    def _record_step(self, outputs: list[RequestOutput], error: Optional[str]) -> bool:
        """Count a step towards the engine's health; True when the engine is now dead.

        A step that raised, or whose every output is an error, failed; one with any good
        output succeeded; one with no outputs (prefill chunks, nothing to do) says nothing."""
        if error is None and outputs:
            if all(o.finish_reason is FinishReason.ERROR for o in outputs):
                error = outputs[0].error
            elif self._health.consecutive_failures:
                self._health = Health(HealthState.HEALTHY)
        if error is None:
            return False
        count = self._health.consecutive_failures + 1
        self._health = Health(HealthState.HEALTHY, count, error)
        if count < self._failure_threshold:
            return False
        self._die(f"{count} engine steps in a row failed; last error: {error}")
        return True

    def _die(self, reason: str) -> None:
        """End every request with ``reason`` and refuse new ones; the loop thread exits."""
        log.critical("slipstream engine is dead: %s", reason)
        with self._lock:
            if self._health.state is HealthState.DEAD:  # the watchdog and the loop raced
                return
            self._health = Health(HealthState.DEAD, self._health.consecutive_failures, reason)
            streams = list(self._streams.values())
            self._streams.clear()
            self._pending = 0
        for stream in streams:
            stream.rejection = EngineDeadError(f"{ENGINE_FAILED}: {reason}")
            stream.put(_error_output(stream.request_id, f"{ENGINE_FAILED}: {reason}"))
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
        try:
            self._handle(self._commands.get(timeout=delay))
        except queue.Empty:
            pass

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.1) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        self._handle(command)
        while True:
            try:
                self._handle(self._commands.get_nowait())
            except queue.Empty:
                return

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            self._add(command[1])
        elif kind == "embed":
            self._embed(command[1])
        elif kind == "abort":
            out = self._built_engine.abort(command[1])
            if out is not None:
                self._deliver([out])

    def _add(self, req) -> None:
        with self._lock:
            aborted = req.request_id in self._aborted_early
        if aborted:
            out = RequestOutput(req.request_id, finished=True, finish_reason=FinishReason.ABORT)
        else:
            out = None
            try:
                self._built_engine.add(req, check_queue=False)  # submit admitted it already
            except Exception as exc:  # noqa: BLE001 - refused: this request alone
                out = _error_output(req.request_id, str(exc))
        with self._lock:
            self._pending -= 1
            self._num_waiting = self._built_engine.num_waiting()
        if out is not None:
            self._deliver([out])

    def _embed(self, job: _PoolingJob) -> None:
        rid = job.stream.request_id
        with self._lock:
            aborted = rid in self._aborted_early
        assert job.token_ids is not None  # the tokenizer thread set them
        if aborted:
            out = RequestOutput(rid, finished=True, finish_reason=FinishReason.ABORT)
        else:
            try:
                vector = self._built_engine.embed(job.token_ids, job.params)
                out = RequestOutput(
                    rid,
                    finished=True,
                    finish_reason=FinishReason.STOP,
                    num_prompt_tokens=len(job.token_ids),
                    embedding=vector,
                )
            except Exception as exc:  # noqa: BLE001 - this request alone fails
                log.error("pooling request failed:\n%s", traceback.format_exc())
                out = _error_output(rid, f"internal error: {exc}")
        with self._lock:
            self._pending -= 1
        self._deliver([out])

    def _refresh_stats(self) -> None:
        self._stats = self._built_engine.get_stats()
        with self._lock:
            self._num_waiting = self._stats.num_waiting

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self._lock:
                stream = self._streams.get(out.request_id)
                if out.finished:
                    self._streams.pop(out.request_id, None)
                    self._aborted_early.discard(out.request_id)
            if stream is not None:
                stream.put(out)
        if outputs and self._on_output is not None:
            self._on_output()

    def _abort_all(self) -> None:
        for out in self._built_engine.abort_all():
            self._deliver([out])
        while True:  # requests submitted but never added
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] in ("add", "embed"):
                rid = command[1].stream.request_id if command[0] == "embed" else None
                with self._lock:
                    self._pending -= 1
                self._deliver(
                    [
                        RequestOutput(
                            rid or command[1].request_id,
                            finished=True,
                            finish_reason=FinishReason.ABORT,
                        )
                    ]
                )
        self._refresh_stats()


def _fatal_error(engine: EngineSurface) -> Optional[str]:
    """Why ``engine`` can serve nothing more (``LLMEngine.fatal_error``), or None."""
    probe = getattr(engine, "fatal_error", None)
    return probe() if probe is not None else None


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
