"""The engine on a background thread: thread-safe submission, one output stream per request.

Callers (the Triton adapter, benchmarks) never touch the engine directly: they submit,
read their stream, and may abort. All engine state is owned by the loop thread; other
threads talk to it through a command queue.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from typing import Callable, Iterator, Optional

from slipstream.core.config import EngineConfig
from slipstream.core.request import FinishReason, RequestOutput
from slipstream.core.sampling_params import SamplingParams
from slipstream.core.stats import StatsSnapshot
from slipstream.engine import LLMEngine, OverloadedError, Prompt

log = logging.getLogger("slipstream")

__all__ = ["EngineLoop", "OutputStream", "OverloadedError"]


class OutputStream:
    """Incremental outputs of one request; iteration ends after the finished one."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: "queue.Queue[RequestOutput]" = queue.Queue()
        self.finished = False

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


class EngineLoop:
    def __init__(self, config_or_engine, *, on_output: Optional[Callable[[], None]] = None,
                 **engine_kwargs) -> None:
        """A config is turned into an engine by ``start()``, on the loop thread.

        ``on_output`` is called on the loop thread after each batch of outputs reaches the
        streams, so a reader can sleep until then instead of polling (a poller steals CPU
        from the model's threads)."""
        if isinstance(config_or_engine, EngineConfig):
            self._build = lambda: LLMEngine(config_or_engine, **engine_kwargs)
            self.engine: Optional[LLMEngine] = None
        else:
            self._build = lambda: config_or_engine
            self.engine = config_or_engine
        self._commands: "queue.Queue[tuple]" = queue.Queue()
        self._streams: dict[str, OutputStream] = {}
        self._lock = threading.Lock()  # guards _streams and admission counting
        self._pending = 0  # submitted, not yet seen by the loop thread
        # Waiting requests as the loop thread last saw them; updated in the same critical
        # section that retires a pending request, so waiting + pending never undercounts.
        self._stats = StatsSnapshot()
        self._num_waiting = 0
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._on_output = on_output

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
            self._thread = threading.Thread(target=self._main, args=(built, failure),
                                            name="slipstream-engine", daemon=True)
            self._thread.start()
            built.wait()
            if failure:
                self._thread.join()
                self._thread = None
                raise failure[0]
        return self

    def _main(self, built: threading.Event, failure: list) -> None:
        try:
            self.engine = self._build()
            self._stats = self.engine.get_stats()
            self._num_waiting = self._stats.num_waiting
        except BaseException as exc:  # handed to start()'s caller
            failure.append(exc)
            return
        finally:
            built.set()
        self._run()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort whatever is still running, deliver the final outputs, join the thread."""
        if self._thread is None:
            return
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout)
        alive = self._thread.is_alive()
        self._thread = None
        self._save_trace(alive)

    def _save_trace(self, loop_alive: bool) -> None:
        path = self.engine.config.trace_file
        if not path or self.engine.tracer is None:
            return
        if loop_alive:  # the records may still be changing under us
            log.warning("engine loop did not stop in time; step trace not written")
            return
        try:
            self.engine.tracer.save(path)
            log.info("step trace written to %s", path)
        except OSError as exc:  # a bad path must not break shutdown
            log.error("cannot write the step trace to %s: %s", path, exc)

    def __enter__(self) -> "EngineLoop":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- client API ---------------------------------------------------------------------------
    def submit(self, prompt: Prompt, params: Optional[SamplingParams] = None,
               request_id: Optional[str] = None, priority: int = 0,
               apply_chat_template: bool = False) -> OutputStream:
        """Validate in the caller's thread (errors raise here), then queue for the engine."""
        if self._thread is None or self._stop.is_set():
            raise RuntimeError("the engine loop is not running")
        req = self.engine.make_request(prompt, params, request_id, priority, apply_chat_template)
        with self._lock:
            if req.request_id in self._streams:
                raise ValueError(f"request id {req.request_id!r} is already in use")
            limit = self.engine.config.max_queue_size
            if limit and self._num_waiting + self._pending >= limit:
                raise OverloadedError(
                    f"server overloaded: {limit} requests already waiting; retry later")
            stream = OutputStream(req.request_id)
            self._streams[req.request_id] = stream
            self._pending += 1
        self._commands.put(("add", req))
        return stream

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def stats(self) -> StatsSnapshot:
        """The engine's counters as of its last step (immutable: safe to read anywhere)."""
        return self._stats

    def generate(self, prompt: Prompt, params: Optional[SamplingParams] = None, **kw) -> RequestOutput:
        """Blocking convenience: the whole output of one request."""
        from slipstream.engine import merge_output

        stream = self.submit(prompt, params, **kw)
        total = RequestOutput(stream.request_id)
        for out in stream:
            merge_output(total, out)
        return total

    # -- the loop thread ----------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._drain_commands(block=not engine.has_unfinished())
            if self._stop.is_set():
                break
            steps_before = engine.stats.steps
            try:
                outputs = engine.step()
            except Exception as exc:  # one bad batch must not kill the server
                log.error("engine step failed:\n%s", traceback.format_exc())
                outputs = self._fail_scheduled(f"internal error: {exc}")
            self._deliver(outputs)
            ran = engine.stats.steps != steps_before
            self._refresh_stats()
            if not ran and engine.has_unfinished():
                self._idle_wait()
        self._abort_all()

    def _idle_wait(self) -> None:
        # Dynamic batching holds requests for its delay window: sleep until then or a command.
        deadline = self.engine.scheduler.next_wakeup()
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
            req = command[1]
            try:
                self.engine.add(req, check_queue=False)  # submit admitted it already
            except Exception as exc:
                self._deliver([RequestOutput(req.request_id, finished=True,
                                             finish_reason=FinishReason.ERROR, error=str(exc))])
            with self._lock:
                self._pending -= 1
                self._num_waiting = len(self.engine.scheduler.waiting)
        elif kind == "abort":
            out = self.engine.abort(command[1])
            if out is not None:
                self._deliver([out])

    def _refresh_stats(self) -> None:
        self._stats = self.engine.get_stats()
        with self._lock:
            self._num_waiting = self._stats.num_waiting

    def _fail_scheduled(self, message: str) -> list:
        engine = self.engine
        victims = list(engine.scheduler.running)
        return [o for o in (engine.fail(r.request_id, message) for r in victims) if o is not None]

    def _deliver(self, outputs: list) -> None:
        for out in outputs:
            with self._lock:
                stream = self._streams.get(out.request_id)
                if out.finished:
                    self._streams.pop(out.request_id, None)
            if stream is not None:
                stream.put(out)
        if outputs and self._on_output is not None:
            self._on_output()

    def _abort_all(self) -> None:
        for rid in list(self.engine.requests):
            out = self.engine.abort(rid)
            if out is not None:
                self._deliver([out])
        while True:  # requests submitted but never added
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add":
                self._deliver([RequestOutput(command[1].request_id, finished=True,
                                             finish_reason=FinishReason.ABORT)])
        self._refresh_stats()
