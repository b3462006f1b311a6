"""Triton Python backend (decoupled) for the Slipstream engine: the ``TritonPythonModel`` that a
model directory's ``1/model.py`` re-exports. Imported only inside the Python-backend stub.

Kept thin: request parsing is ``slipstream.server.stub.request_parser``, the response wire
format ``slipstream.server.stub.responses``,
the model config (auto-completed inputs/outputs, ``1/model.json``, parameters)
``slipstream.server.stub.model_config``, metrics ``slipstream.server.stub.metrics``; the engine
(``slipstream.engine.supervisor.EngineSupervisor``, which restarts a dead engine) runs its own
threads. The same class serves the Python backend layout
(``model_repository/slipstream/1/model.py``) and the Python-based backend
``triton_backends/slipstream/model.py`` (``backend: "slipstream"``), which behaves as Triton's vLLM
backend does. ``execute`` only parses and submits, then returns; ONE sender thread drains
every request's output stream and sends responses through that request's response sender,
ending each with the FINAL flag once.

Lifecycle (``slipstream.server.stub.lifecycle``): a watchdog process takes the server down if this
stub dies, since Triton 2.51 cannot restart it. While requests are in flight the sender checks
every ``READY_POLL_S`` that Triton still serves (its HTTP frontend answers, this model is
ready): once it is stopping or unloading the model, new requests are refused and those in
flight get until Triton's own exit timeout (less a margin) to finish, then end with
UNAVAILABLE, so that no client is cut off without a final response when Triton gives up.
"""

import json
import os
import queue
import threading
import time
import traceback

import triton_python_backend_utils as pb_utils

from slipstream import EngineConfig, SamplingParams
from slipstream.core.request import FinishReason
from slipstream.engine.loop import EngineDeadError, OverloadedError
from slipstream.engine.supervisor import EngineSupervisor
from slipstream.server.stub import embedding_request, model_config
from slipstream.server.stub.cancel_polls import CancelPolls
from slipstream.server.stub.deadlines import request_deadline
from slipstream.server.stub.health import UNHEALTHY_MESSAGE, engine_problem
from slipstream.server.stub.instance_device import instance_device
from slipstream.server.stub.lifecycle import HttpStopProbe, Watchdog, triton_exit_timeout
from slipstream.server.stub.metrics import ModelMetrics, NoMetrics
from slipstream.server.stub.request_parser import (
    BadRequestError,
    ParsedRequest,
    RequestOptions,
    _parameters_dict,
    lora_error,
    parse_request,
)
from slipstream.server.stub.responses import ResponseBuilder
from slipstream.server.stub.triton_log import forward_to_triton
from slipstream.server.trtllm import llmapi
from slipstream.server.trtllm.inputs import (
    PER_SEQUENCE_NEEDS_DECOUPLED,
    STREAMING_NOT_DECOUPLED,
    check_unsupported,
    split_rows,
    translate,
    trtllm_queue_full,
)
from slipstream.server.trtllm.outputs import TrtllmResponses
from slipstream.server.trtllm.row_sender import RowGroup
from slipstream.worker.device import keep_gpu_compiler_out, resolve_device

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
ERROR_PREFIX = "Error generating stream: "  # Triton vLLM backend's, which its clients match
CANCEL_POLLS = CancelPolls()
READY_POLL_S = 0.25  # how often, with requests in flight, Triton is asked if we still serve
DRAIN_MARGIN_S = 3.0  # ends a drain this long before Triton's exit timeout runs out


def _error(message, code=None):
    if code is None:
        return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))


def _request_timeout_us(request):
    try:
        return int(request.timeout())
    except Exception:  # an older stub without InferenceRequest.timeout
        return 0


def _code(name):
    return getattr(getattr(pb_utils, "TritonError", None), name, None)


class _Pending:
    """One in-flight request as the sender thread sees it."""

    def __init__(self, stream, sender, parsed, builder, track, arrival, deadline=None):
        self.stream, self.sender, self.parsed = stream, sender, parsed
        self.arrival, self.deadline = arrival, deadline  # a Deadline, or None
        self.timed_out = False  # aborted at its deadline
        self.options = parsed.options
        self.builder, self.track = builder, track  # responses; metrics
        self.cancelled = self.progressed = False
        self.shutdown_abort = False  # aborted because Triton is stopping
        self.last_cancel_check = float("-inf")


def _submit_options(options: RequestOptions) -> dict[str, object]:
    """``EngineLoop.submit``'s keyword arguments for a request's options (only what differs
    from its defaults)."""
    kwargs: dict[str, object] = {"priority": options.priority}
    if options.apply_chat_template:
        kwargs["apply_chat_template"] = True
    if not options.add_special_tokens:
        kwargs["add_special_tokens"] = False
    return kwargs


class TritonPythonModel:
    @classmethod
    def auto_complete_config(cls, config):
        return model_config.auto_complete(config)

    def initialize(self, args):
        forward_to_triton(pb_utils.Logger)  # the engine's own lines, start-up phases included
        config = json.loads(args["model_config"])
        raw = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.model_name, self.model_version = args["model_name"], args["model_version"]
        settings = model_config.load_settings(
            raw,
            config.get("backend", "python"),
            args.get("model_repository", ""),
            pb_utils.get_model_dir() if hasattr(pb_utils, "get_model_dir") else None,
        )
        self.settings = settings
        # TRT-LLM style configs: a batch dimension (rows split here), unary answers.
        self.batched = int(config.get("max_batch_size") or 0) > 0
        self.decoupled = bool((config.get("model_transaction_policy") or {}).get("decoupled"))
        self.output_names = {o["name"] for o in config.get("output", [])}
        self.default_max_tokens = settings.default_max_tokens
        self.apply_chat_template = settings.apply_chat_template
        self.metrics_interval = settings.metrics_interval_s
        self.healthy = True
        self.logger = pb_utils.Logger
        self.incoming = queue.Queue()
        self.wake = threading.Event()  # set by execute and by the engine loop on new outputs
        engine = dict(settings.engine)
        engine["device"] = instance_device(args, str(engine.get("device") or "auto"))
        engine_config = EngineConfig.from_dict(engine)
        model_config.check_instance_kind(args.get("model_instance_kind", ""), engine_config)
        keep_gpu_compiler_out(resolve_device(engine_config.device))
        self.max_queue_size = engine_config.max_queue_size
        # the adapters a request's lora_name may pick (None: LoRA off)
        self.lora_names = list(engine_config.lora_modules) if engine_config.enable_lora else None
        self.kv_events = self._make_kv_events(settings, engine_config)
        engine_kwargs = {"kv_event_sink": self.kv_events.publish} if self.kv_events else {}
        try:
            self.loop = EngineSupervisor(
                engine_config,
                on_output=self.wake.set,
                on_give_up=self._give_up,
                failure_threshold=settings.engine_failure_threshold,
                max_restarts=settings.max_engine_restarts,
                step_timeout_s=settings.step_timeout_s,
                engine_kwargs=engine_kwargs,
            ).start()
        except BaseException:
            if self.kv_events is not None:
                self.kv_events.shutdown()
            raise
        self.watchdog = Watchdog.start()
        self.drain_grace = max(triton_exit_timeout() - DRAIN_MARGIN_S, 0.0)
        self.stop_probe = HttpStopProbe()
        self.draining_since = None  # when Triton began unloading this model or stopping
        self.num_active = 0
        self.metrics = self._make_metrics(args, engine_config)
        self.stopping = False
        self.next_ready_check = 0.0
        self.not_ready_checks, self.first_not_ready = 0, 0.0
        self.sender_thread = threading.Thread(
            target=self._sender_loop, name="slipstream-sender", daemon=True
        )
        self.sender_thread.start()
        self.logger.log_info(f"slipstream engine ready: {engine}")

    @staticmethod
    def _make_kv_events(settings, engine_config):
        if settings.kv_events is None:
            return None
        from slipstream.kv_events.publisher import KVEventPublisher

        # vLLM numbers adapters from 1 in the order they are configured (lora_id).
        lora_ids = {name: i + 1 for i, name in enumerate(engine_config.lora_modules)}
        return KVEventPublisher(settings.kv_events, lora_ids=lora_ids)

    def _make_metrics(self, args, engine_config):
        if not self.settings.report_metrics:
            return NoMetrics()
        try:
            return ModelMetrics(
                pb_utils,
                {"model": args["model_name"], "version": args["model_version"]},
                self.settings.metric_families,
                max_model_len=engine_config.max_model_len,
                block_size=engine_config.block_size,
                num_blocks=self.loop.stats().kv_blocks_total,
                max_num_seqs=engine_config.max_num_seqs,
                max_loras=engine_config.max_loras if self.lora_names is not None else 0,
            )
        except Exception as e:  # e.g. tritonserver --allow-metrics=false
            self.logger.log_warn(f"slipstream: custom metrics unavailable ({e})")
            return NoMetrics()

    # ----------------------------------------------------------------- execute
    def execute(self, requests):
        if self.settings.health_check and not self._check_health(requests):
            return None
        for request in requests:
            arrival = time.monotonic()
            sender = request.get_response_sender()
            if self.draining_since is not None:
                self._reject(sender, _error("the server is shutting down", _code("UNAVAILABLE")))
                continue
            try:
                inputs = {}
                for name in model_config.INPUT_NAMES + llmapi.INPUT_NAMES:
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    if tensor is not None:
                        inputs[name] = tensor.as_numpy()
                check_unsupported(inputs, request.requested_output_names(), self.output_names)
                rows = split_rows(inputs, self.batched)
            except Exception as e:  # never let one request take the batch down
                self._refuse(sender, e)
                continue
            senders = [sender]
            if self.batched or not self.decoupled:
                senders = RowGroup(sender, len(rows), self.decoupled, pb_utils).senders()
            deadline = request_deadline(
                arrival,
                _request_timeout_us(request),
                request.parameters(),
                self.settings.max_request_seconds,
            )
            for index, (row, row_sender) in enumerate(zip(rows, senders)):
                self._submit(row, request.parameters(), row_sender, arrival, index, deadline)
        return None

    def _submit(self, inputs, parameters, sender, arrival, batch_index, deadline=None):
        """Parse one request (or row of a batched one) and hand it to the engine; a bad one
        gets its error response here."""
        if embedding_request.INPUT in inputs:
            self._submit_embedding(inputs, sender, arrival, deadline)
            return
        try:
            lora = lora_error(inputs, parameters, self.lora_names)
            if lora is not None:  # vLLM answers this one without its prefix
                self._reject(sender, _error(lora, _code("INVALID_ARG")))
                return
            row = self._translate(inputs, batch_index)
            parsed = self._parse(row, parameters)
            stream = self.loop.submit(
                parsed.prompt, parsed.params, **_submit_options(parsed.options)
            )
        except Exception as e:  # never let one request take the batch down
            self._refuse(sender, e)
            return
        inner = ResponseBuilder(parsed, self.loop.tokenizer)
        if self.settings.interface == "llmapi":
            builder = llmapi.LlmapiResponses(inner, row.options)
        else:
            builder = TrtllmResponses(inner, row.options, self.loop.tokenizer)
        self.incoming.put(
            _Pending(
                stream,
                sender,
                parsed,
                builder,
                self.metrics.track(arrival, parsed.params),
                arrival,
                deadline,
            )
        )
        self.wake.set()

    def _submit_embedding(self, inputs, sender, arrival, deadline) -> None:
        """A pooling request (``embedding_request.py``): one response with the vector."""
        try:
            req = embedding_request.parse_embedding_request(inputs, self.model_name)
            stream = self.loop.embed(
                req.prompt,
                req.params,
                add_special_tokens=req.add_special_tokens,
                truncate_prompt_tokens=req.truncate_prompt_tokens,
            )
        except Exception as e:  # never let one request take the batch down
            self._refuse(sender, e)
            return
        parsed = ParsedRequest("", SamplingParams(max_tokens=1), RequestOptions())
        builder = embedding_request.EmbeddingResponses(req)
        track = self.metrics.track(arrival, parsed.params)
        self.incoming.put(_Pending(stream, sender, parsed, builder, track, arrival, deadline))
        self.wake.set()

    def _translate(self, inputs, batch_index: int):
        """The row's TensorRT-LLM (or LLM-API) inputs mapped onto what the parser reads."""
        if self.settings.interface == "llmapi":
            row = llmapi.translate(inputs)
        else:
            row = translate(
                inputs,
                self._encode,
                batch_index=batch_index,
                with_indices=self.batched,
                trtllm_defaults=self.settings.compatibility == "trtllm",
            )
        if row.options.return_log_probs and "cum_log_probs" not in self.output_names:
            raise BadRequestError(
                "input 'return_log_probs' needs the outputs cum_log_probs "
                "and output_log_probs, which this model does not declare "
                '(set its compatibility parameter to "trtllm")'
            )
        if row.options.return_perf_metrics and "arrival_time_ns" not in self.output_names:
            raise BadRequestError(
                "input 'return_perf_metrics' needs the perf metrics "
                "outputs, which this model does not declare (set its "
                'compatibility parameter to "trtllm")'
            )
        row.options.with_indices &= "batch_index" in self.output_names
        return row

    def _parse(self, row, parameters):
        if row.parameters:  # TRT-LLM inputs win over the same request parameters
            parameters = {**_parameters_dict(parameters), **row.parameters}
        parsed = parse_request(
            row.inputs,
            parameters,
            default_max_tokens=self.default_max_tokens,
            default_apply_chat_template=self.apply_chat_template,
            max_logprobs=self.settings.max_logprobs,
        )
        if parsed.options.stream and not self.decoupled:
            raise BadRequestError(STREAMING_NOT_DECOUPLED)
        if row.options.num_return_sequences > 1 and not self.decoupled:
            raise BadRequestError(PER_SEQUENCE_NEEDS_DECOUPLED)
        return parsed

    def _refuse(self, sender, e: Exception) -> None:
        """The one error response of a request that cannot be served: UNAVAILABLE when the
        engine cannot take it, INVALID_ARG when the request is wrong, else an internal error
        (logged with its traceback)."""
        if isinstance(e, OverloadedError):
            self._reject(sender, _error(self._overloaded_text(e), _code("UNAVAILABLE")))
        elif isinstance(e, EngineDeadError):
            self._reject(sender, _error(ERROR_PREFIX + str(e), _code("UNAVAILABLE")))
        elif isinstance(e, ValueError):  # BadRequestError included
            self._reject(sender, _error(ERROR_PREFIX + str(e), _code("INVALID_ARG")))
        else:
            self.logger.log_error(traceback.format_exc())
            self._reject(sender, _error(f"{ERROR_PREFIX}internal error: {e}"))

    def _encode(self, text):
        return self.loop.tokenizer.encode(text, add_special_tokens=False)

    def _overloaded_text(self, error):
        if self.settings.compatibility == "trtllm":
            return trtllm_queue_full(self.max_queue_size)
        return ERROR_PREFIX + str(error)

    def _check_health(self, requests) -> bool:
        """ENABLE_VLLM_HEALTH_CHECK: False (and every request answered) once unhealthy."""
        if self.healthy:
            problem = self._engine_problem()
            if problem is not None:
                self.healthy = False
                self.logger.log_error(
                    f"slipstream: engine unhealthy ({problem}); unloading model {self.model_name}"
                )
                try:
                    pb_utils.unload_model(self.model_name)  # non-blocking; explicit mode only
                except Exception as e:
                    self.logger.log_error(f"slipstream: could not unload the model: {e}")
        if not self.healthy:
            for request in requests:
                self._reject(
                    request.get_response_sender(), _error(UNHEALTHY_MESSAGE, _code("UNAVAILABLE"))
                )
        return self.healthy

    def _engine_problem(self):
        """Why the engine cannot serve, or None (a test's model.py may override it)."""
        return engine_problem(self.loop)

    def _reject(self, sender, response):
        try:
            sender.send(response, flags=FINAL)
        except Exception as e:  # the client is gone: nothing to tell it
            self.logger.log_warn(f"slipstream: could not send an error response: {e}")

    # ----------------------------------------------------------------- sender thread
    def _sender_loop(self):
        active = []
        next_metrics = 0.0
        while True:
            try:
                while True:
                    active.append(self.incoming.get_nowait())
            except queue.Empty:
                pass
            self.num_active = len(active)
            if self.stopping and not active:
                break
            now = time.monotonic()
            if active:
                self._watch_shutdown(active, now)
            progressed = self._drain_all(active, now)
            if now >= next_metrics:
                next_metrics = now + self.metrics_interval
                self._refresh_metrics()
            if not progressed:
                # Woken by new outputs or requests; the timeout only paces cancellation
                # checks and metrics, so the model's CPU threads are not polled away.
                self.wake.wait(CANCEL_POLLS.streaming_s if active else self.metrics_interval)
                self.wake.clear()

    def _drain_all(self, active, now) -> bool:
        """Send what every request in flight has; drop the finished ones from ``active``.
        Whether any moved."""
        progressed = False
        for p in list(active):
            try:
                if self._drain(p, now):
                    active.remove(p)
                    progressed = True
                elif p.progressed:
                    progressed = True
            except Exception as e:  # a failed send: end this request only
                self.logger.log_error(f"slipstream sender: {e}\n{traceback.format_exc()}")
                active.remove(p)
                self.loop.abort(p.stream.request_id)
                try:
                    p.sender.send(_error(f"{ERROR_PREFIX}internal error: {e}"), flags=FINAL)
                except Exception:
                    pass
        return progressed

    def _refresh_metrics(self) -> None:
        try:
            self.metrics.update(self.loop.stats())
        except Exception as e:
            self.logger.log_warn(f"slipstream metrics: {e}")

    def _watch_shutdown(self, active, now):
        """Triton tells a model nothing before finalize, which comes only once every request
        in flight has ended, or never if its exit timeout runs out first (it then exits and
        may crash mid-stream). So ask whether we are still ready; once not, give requests
        what is left of that timeout, then end them with an error while Triton still waits."""
        if self.draining_since is None:
            if now < self.next_ready_check:
                return
            self.next_ready_check = now + READY_POLL_S
            # The HTTP frontend refusing connections is certain: it never serves again.
            certain = self.stop_probe.stopping()
            if not certain:
                try:
                    if pb_utils.is_model_ready(self.model_name, str(self.model_version)):
                        self.not_ready_checks = 0
                        return
                except Exception:  # "Server not ready": tritonserver is stopping
                    pass
            self.not_ready_checks += 1
            if self.not_ready_checks == 1:
                self.first_not_ready = now
            if self.not_ready_checks == 1 and not certain:  # a drain cannot be undone: look again
                return
            self.draining_since = self.first_not_ready
            self.logger.log_warn(
                f"slipstream: Triton is unloading this model or stopping; "
                f"{len(active)} requests get {self.drain_grace:.0f} s to finish"
            )
        if now - self.draining_since >= self.drain_grace:
            for p in active:
                if not p.shutdown_abort:
                    p.shutdown_abort = True
                    self.loop.abort(p.stream.request_id)

    def _drain(self, p, now):
        """Send what this request's stream holds; True once its FINAL response went out."""
        p.progressed = False
        outs = []
        while not (outs and outs[-1].finished):
            try:
                outs.append(p.stream.get(timeout=0))
            except queue.Empty:
                break
        self._poll_cancellation(p, now, has_output=bool(outs))
        self._enforce_deadline(p, now)
        if not outs:
            return False
        p.progressed = True
        self.metrics.on_outputs(p.track, outs, time.monotonic())
        for out in outs:
            if out.finished:
                self._finish(p, out)
                return True
            if p.cancelled:
                continue
            if p.options.stream and p.builder.streams:
                outputs = p.builder.streamed(out)
                if outputs is not None:  # None: nothing to send for this output
                    p.sender.send(self._response(outputs))
            else:
                p.builder.absorb(out)
        return False

    def _poll_cancellation(self, p, now, has_output: bool) -> None:
        if p.cancelled or not CANCEL_POLLS.due(
            p.last_cancel_check, now, has_output, self.num_active
        ):
            return
        p.last_cancel_check = now
        if p.sender.is_cancelled():
            p.cancelled = True
            self.logger.log_info(f"slipstream: cancelling request {p.stream.request_id}")
            self.loop.abort(p.stream.request_id)

    def _enforce_deadline(self, p, now) -> None:
        if p.deadline is None or p.timed_out or p.cancelled or now < p.deadline.at:
            return
        p.timed_out = True
        self.logger.log_warn(
            f"slipstream: request {p.stream.request_id} {p.deadline.message(now - p.arrival)}"
        )
        self.loop.abort(p.stream.request_id)

    @staticmethod
    def _response(outputs):
        return pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, value) for name, value in outputs.items()]
        )

    def _finish(self, p, out):
        end = time.monotonic()
        self.metrics.on_finish(p.track, out, end)  # before the last response: a client sees it
        if p.cancelled:
            self.logger.log_info(f"slipstream: request {p.stream.request_id} cancelled")
            p.sender.send(flags=FINAL)
            return
        error = self._end_error(p, out, end)
        if error is not None:
            p.sender.send(error, flags=FINAL)
        elif p.options.stream and p.builder.streams:
            p.sender.send(self._response(p.builder.streamed(out)), flags=FINAL)
        else:
            *responses, last = p.builder.finals(out)
            for outputs in responses:  # num_return_sequences: one response per sequence
                p.sender.send(self._response(outputs))
            p.sender.send(self._response(last), flags=FINAL)

    def _end_error(self, p, out, end):
        """The error response ending a request that did not complete, or None."""
        refused = p.stream.rejection
        if isinstance(refused, ValueError):  # found invalid after submit (tokenized later)
            return _error(str(refused), _code("INVALID_ARG"))
        if isinstance(refused, EngineDeadError):
            return _error(str(refused), _code("UNAVAILABLE"))
        if out.finish_reason is FinishReason.ERROR:
            return _error(f"{ERROR_PREFIX}{out.error or 'unknown error'}")
        if out.finish_reason is not FinishReason.ABORT:
            return None
        if p.timed_out:
            return _error(ERROR_PREFIX + p.deadline.message(end - p.arrival), _code("UNAVAILABLE"))
        if p.shutdown_abort:
            return _error(
                f"request aborted: the server is shutting down and it did not "
                f"finish within {self.drain_grace:.0f} s",
                _code("UNAVAILABLE"),
            )
        if out.error:
            return _error(f"{ERROR_PREFIX}{out.error}")
        return _error("request aborted (server shutting down)", _code("UNAVAILABLE"))

    # ----------------------------------------------------------------- health
    def is_ready(self):
        """Readiness for Triton versions that ask the model (python_backend after 25.12)."""
        return self.loop.health().ok and self.draining_since is None

    def _give_up(self, health):
        """The engine keeps dying: take the server down so that a fresh one replaces it
        (with Triton 2.51 the only way to stop reporting READY). Requests in flight have
        their errors; let the sender deliver them first."""
        self.logger.log_error(f"slipstream: {health.error}")
        if self.settings.health_check:  # vllm_backend's way: unloaded, the server stays up
            self._check_health([])
            return
        if self.watchdog is None or not self.watchdog.alive:
            self.logger.log_error("slipstream: no watchdog; requests are refused until restart")
            return
        deadline = time.monotonic() + 5.0
        while self.num_active and time.monotonic() < deadline:
            time.sleep(0.05)
        self.watchdog.fatal(health.error or "engine dead")
        os._exit(1)

    # ----------------------------------------------------------------- finalize
    def finalize(self):
        started = time.monotonic()
        self.logger.log_info("slipstream: finalize, stopping the engine")
        self.loop.shutdown()  # aborts what is left: every stream ends, the sender sends FINAL
        if self.kv_events is not None:
            self.kv_events.shutdown()
        self.stopping = True
        self.wake.set()
        self.sender_thread.join(timeout=30)
        self.metrics.stop()
        if self.watchdog is not None:
            self.watchdog.goodbye()
        self.logger.log_info(f"slipstream: finalized in {time.monotonic() - started:.2f} s")
