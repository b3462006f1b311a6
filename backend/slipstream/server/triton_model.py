"""Triton Python backend (decoupled) for the Slipstream engine: the ``TritonPythonModel`` that a
model directory's ``1/model.py`` re-exports. Imported only inside the Python-backend stub.

Kept thin: request parsing and the response wire format are ``slipstream.server.protocol``,
the model config (auto-completed inputs/outputs, ``1/model.json``, parameters)
``slipstream.server.model_config``, metrics ``slipstream.server.metrics``; the engine
(``slipstream.engine_loop.EngineLoop``) runs its own thread. The same class serves the Python
backend layout (``model_repository/slipstream/1/model.py``) and the Python-based backend
``backends/slipstream/model.py`` (``backend: "slipstream"``), which behaves as Triton's vLLM
backend does. ``execute`` only parses and submits, then returns; ONE sender thread drains
every request's output stream and sends responses through that request's response sender,
ending each with the FINAL flag once.
"""
import json
import queue
import threading
import time
import traceback

import triton_python_backend_utils as pb_utils

from slipstream import EngineConfig
from slipstream.core.request import FinishReason
from slipstream.engine_loop import EngineLoop, OverloadedError
from slipstream.server import model_config
from slipstream.server.health import UNHEALTHY_MESSAGE, engine_problem
from slipstream.server.metrics import ModelMetrics, NoMetrics
from slipstream.server.protocol import (BadRequestError, ResponseBuilder, lora_error,
                                        parse_request)

INPUT_NAMES = ("text_input", "stream", "sampling_parameters", "exclude_input_in_output",
               "return_finish_reason", "return_num_input_tokens", "return_num_output_tokens",
               "return_cumulative_logprob", "return_logprobs", "apply_chat_template",
               "max_tokens", "min_tokens", "temperature", "top_p", "top_k",
               "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
               "stop_words", "end_id", "priority", "image", "embedding_request")
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
ERROR_PREFIX = "Error generating stream: "  # Triton vLLM backend's, which its clients match
CANCEL_POLL_S = 0.1  # each is_cancelled() is a round trip to the Triton process


def _error(message, code=None):
    if code is None:
        return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))
    return pb_utils.InferenceResponse(output_tensors=[],
                                      error=pb_utils.TritonError(message, code))


def _code(name):
    return getattr(getattr(pb_utils, "TritonError", None), name, None)


class _Pending:
    """One in-flight request as the sender thread sees it."""

    def __init__(self, stream, sender, parsed, builder, track):
        self.stream, self.sender, self.parsed = stream, sender, parsed
        self.options = parsed.options
        self.builder, self.track = builder, track  # responses; metrics
        self.cancelled = self.progressed = False
        self.next_cancel_check = 0.0


class TritonPythonModel:
    @classmethod
    def auto_complete_config(cls, config):
        return model_config.auto_complete(config)

    def initialize(self, args):
        config = json.loads(args["model_config"])
        raw = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.model_name = args["model_name"]
        settings = model_config.load_settings(
            raw, config.get("backend", "python"), args.get("model_repository", ""),
            pb_utils.get_model_dir() if hasattr(pb_utils, "get_model_dir") else None)
        self.settings = settings
        self.default_max_tokens = settings.default_max_tokens
        self.apply_chat_template = settings.apply_chat_template
        self.metrics_interval = settings.metrics_interval_s
        self.healthy = True
        self.logger = pb_utils.Logger
        self.incoming = queue.Queue()
        self.wake = threading.Event()  # set by execute and by the engine loop on new outputs
        engine_config = EngineConfig.from_dict(settings.engine)
        self.loop = EngineLoop(engine_config, on_output=self.wake.set)
        self.loop.start()
        self.metrics = self._make_metrics(args, engine_config)
        self.stopping = False
        self.sender_thread = threading.Thread(target=self._sender_loop, name="slipstream-sender",
                                              daemon=True)
        self.sender_thread.start()
        self.logger.log_info(f"slipstream engine ready: {settings.engine}")

    def _make_metrics(self, args, engine_config):
        if not self.settings.report_metrics:
            return NoMetrics()
        try:
            return ModelMetrics(pb_utils, {"model": args["model_name"],
                                           "version": args["model_version"]},
                                self.settings.metric_families,
                                max_model_len=engine_config.max_model_len,
                                block_size=engine_config.block_size,
                                num_blocks=self.loop.stats().kv_blocks_total)
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
            try:
                inputs = {}
                for name in INPUT_NAMES:
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    if tensor is not None:
                        inputs[name] = tensor.as_numpy()
                lora = lora_error(inputs, request.parameters())
                if lora is not None:  # vLLM answers this one without its prefix
                    self._reject(sender, _error(lora, _code("INVALID_ARG")))
                    continue
                if "embedding_request" in inputs:
                    raise BadRequestError(
                        f"Model {self.model_name} does not support 'embed' request")
                parsed = parse_request(inputs, request.parameters(),
                                       default_max_tokens=self.default_max_tokens,
                                       default_apply_chat_template=self.apply_chat_template,
                                       max_logprobs=self.settings.max_logprobs)
                kwargs = {"priority": parsed.options.priority}
                if parsed.options.apply_chat_template:
                    kwargs["apply_chat_template"] = True
                stream = self.loop.submit(parsed.prompt, parsed.params, **kwargs)
            except OverloadedError as e:
                self._reject(sender, _error(ERROR_PREFIX + str(e), _code("UNAVAILABLE")))
                continue
            except (BadRequestError, ValueError) as e:
                self._reject(sender, _error(ERROR_PREFIX + str(e), _code("INVALID_ARG")))
                continue
            except Exception as e:  # never let one request take the batch down
                self.logger.log_error(traceback.format_exc())
                self._reject(sender, _error(f"{ERROR_PREFIX}internal error: {e}"))
                continue
            self.incoming.put(_Pending(stream, sender, parsed,
                                       ResponseBuilder(parsed, self.loop.tokenizer),
                                       self.metrics.track(arrival, parsed.params)))
            self.wake.set()
        return None

    def _check_health(self, requests) -> bool:
        """ENABLE_VLLM_HEALTH_CHECK: False (and every request answered) once unhealthy."""
        if self.healthy:
            problem = self._engine_problem()
            if problem is not None:
                self.healthy = False
                self.logger.log_error(f"slipstream: engine unhealthy ({problem}); unloading "
                                      f"model {self.model_name}")
                try:
                    pb_utils.unload_model(self.model_name)  # non-blocking; explicit mode only
                except Exception as e:
                    self.logger.log_error(f"slipstream: could not unload the model: {e}")
        if not self.healthy:
            for request in requests:
                self._reject(request.get_response_sender(),
                             _error(UNHEALTHY_MESSAGE, _code("UNAVAILABLE")))
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
            if self.stopping and not active:
                break
            progressed = False
            now = time.monotonic()
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
            if now >= next_metrics:
                next_metrics = now + self.metrics_interval
                try:
                    self.metrics.update(self.loop.stats())
                except Exception as e:
                    self.logger.log_warn(f"slipstream metrics: {e}")
            if not progressed:
                # Woken by new outputs or requests; the timeout only paces cancellation
                # checks and metrics, so the model's CPU threads are not polled away.
                self.wake.wait(CANCEL_POLL_S if active else self.metrics_interval)
                self.wake.clear()

    def _drain(self, p, now):
        """Send what this request's stream holds; True once its FINAL response went out."""
        p.progressed = False
        if not p.cancelled and now >= p.next_cancel_check:
            p.next_cancel_check = now + CANCEL_POLL_S
            if p.sender.is_cancelled():
                p.cancelled = True
                self.logger.log_info(f"slipstream: cancelling request {p.stream.request_id}")
                self.loop.abort(p.stream.request_id)
        outs = []
        while not (outs and outs[-1].finished):
            try:
                outs.append(p.stream.get(timeout=0))
            except queue.Empty:
                break
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
            if p.options.stream:
                p.sender.send(self._response(p.builder.streamed(out)))
            else:
                p.builder.absorb(out)
        return False

    @staticmethod
    def _response(outputs):
        return pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, value) for name, value in outputs.items()])

    def _finish(self, p, out):
        end = time.monotonic()
        self.metrics.on_finish(p.track, out, end)  # before the last response: a client sees it
        if p.cancelled:
            self.logger.log_info(f"slipstream: request {p.stream.request_id} cancelled")
            p.sender.send(flags=FINAL)
        elif out.finish_reason is FinishReason.ERROR or (
                out.finish_reason is FinishReason.ABORT and out.error):
            p.sender.send(_error(f"{ERROR_PREFIX}{out.error or 'unknown error'}"), flags=FINAL)
        elif out.finish_reason is FinishReason.ABORT:
            p.sender.send(_error("request aborted (server shutting down)", _code("UNAVAILABLE")),
                          flags=FINAL)
        elif p.options.stream:
            p.sender.send(self._response(p.builder.streamed(out)), flags=FINAL)
        else:
            p.sender.send(self._response(p.builder.final(out)), flags=FINAL)

    # ----------------------------------------------------------------- finalize
    def finalize(self):
        self.logger.log_info("slipstream: finalize, stopping the engine")
        self.loop.shutdown()  # aborts what is left: every stream ends, the sender sends FINAL
        self.stopping = True
        self.wake.set()
        self.sender_thread.join(timeout=30)
        self.metrics.stop()
