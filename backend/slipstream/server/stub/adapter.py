"""Triton Python backend (decoupled) for the Slipstream engine: ``TritonAdapter``, the
``TritonPythonModel`` of the stub's own request vocabulary. The composition root
(``slipstream.server.triton_model``) subclasses it with TensorRT-LLM's interfaces
(``extensions``); a model directory's ``1/model.py`` re-exports that one. Imported only inside
the Python-backend stub.

Kept thin, one job per room: the model config (auto-completed inputs/outputs, ``1/model.json``,
parameters) is ``model_config``; a request's intake (its interface, rows, parsing, submission,
refusals) ``intake``; the sender thread that answers every request ``sender``; the shutdown
drain ``shutdown_watch``; metrics ``metrics``. The engine
(``slipstream.engine.supervisor.EngineSupervisor``, which restarts a dead engine) runs its own
threads. The same class serves the Python backend layout (``model_repository/slipstream``)
and the Python-based backend ``triton_backends/slipstream/model.py`` (``backend:
"slipstream"``), which behaves as Triton's vLLM backend does.

Lifecycle (``lifecycle``): a watchdog process takes the server down if this stub dies, since
Triton 2.51 cannot restart it. An engine that keeps dying takes the server down too (or, with
``ENABLE_VLLM_HEALTH_CHECK``, unloads the model), so that it stops reporting READY.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, ClassVar, Optional

import triton_python_backend_utils as pb_utils

from slipstream import EngineConfig
from slipstream.engine.health import SHUTTING_DOWN
from slipstream.engine.loop import Health
from slipstream.engine.supervisor import EngineSupervisor
from slipstream.server.stub import model_config
from slipstream.server.stub.extensions import Extensions
from slipstream.server.stub.health import UNHEALTHY_MESSAGE, engine_problem
from slipstream.server.stub.instance_device import instance_device
from slipstream.server.stub.intake import RequestIntake
from slipstream.server.stub.lifecycle import Watchdog, stop_server
from slipstream.server.stub.metrics import FamilyLimits, ModelMetrics, NoMetrics
from slipstream.server.stub.request_interface import ModelContext
from slipstream.server.stub.sender import ResponseSender
from slipstream.server.stub.shutdown_watch import ShutdownWatch
from slipstream.server.stub.triton_log import forward_to_triton
from slipstream.server.stub.wire import ErrorCode, error_response, send_final
from slipstream.worker.device import keep_gpu_compiler_out, resolve_device

# Between asking Triton to stop and ending the stub (the watchdog then kills the server): the
# time its frontends have to pass on the error responses of the requests that were in flight
# (a client whose connection drops first reads "Stream removed" instead of why it failed).
RESPONSE_GRACE_S = 1.0


class TritonAdapter:
    extensions: ClassVar[Extensions] = Extensions()

    @classmethod
    def auto_complete_config(cls, config):
        return model_config.auto_complete(config, cls.extensions.config_additions)

    def initialize(self, args: dict[str, Any]) -> None:
        forward_to_triton(pb_utils.Logger)  # the engine's own lines, start-up phases included
        config = json.loads(args["model_config"])
        raw = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.model_name, self.model_version = args["model_name"], args["model_version"]
        self.settings = settings = model_config.load_settings(
            raw,
            config.get("backend", "python"),
            args.get("model_repository", ""),
            pb_utils.get_model_dir() if hasattr(pb_utils, "get_model_dir") else None,
        )
        self.healthy = True
        self.gave_up = False  # the engine is beyond repair: the server is being taken down
        self.logger = pb_utils.Logger
        self.wake = threading.Event()  # the sender's: new requests, new engine outputs
        engine = dict(settings.engine)  # on the GPU Triton gives this instance (KIND_GPU)
        engine["device"] = instance_device(args, str(engine.get("device") or "auto"))
        engine_config = EngineConfig.from_dict(engine)
        model_config.check_instance_kind(args.get("model_instance_kind", ""), engine_config)
        keep_gpu_compiler_out(resolve_device(engine_config.device))
        # the adapters a request's lora_name may pick (None: LoRA off)
        lora_names = list(engine_config.lora_modules) if engine_config.enable_lora else None
        self.kv_events = self._make_kv_events(engine_config)
        self.engine = self._start_engine(engine_config)
        self.watchdog: Optional[Watchdog] = Watchdog.start()
        self.shutdown = ShutdownWatch(self._model_ready, self.logger)
        self.metrics = self._make_metrics(engine_config, lora_names is not None)
        self.sender = ResponseSender(
            self.engine,
            self.metrics,
            self.shutdown,
            self.logger,
            settings.metrics_interval_s,
            self.wake,
        )
        batched = int(config.get("max_batch_size") or 0) > 0  # TRT-LLM style: rows split here
        model = ModelContext(
            batched=batched,
            decoupled=bool((config.get("model_transaction_policy") or {}).get("decoupled")),
            output_names=frozenset(o["name"] for o in config.get("output", [])),
            encode=self._encode,
        )
        self.intake = RequestIntake(
            self.model_name,
            settings,
            self.engine,
            self.extensions.interfaces(settings, batched),
            model,
            self.sender,
            self.metrics,
            pb_utils,
            lora_names,
            engine_config.max_queue_size,
        )
        self.sender.start()
        self.logger.log_info(f"slipstream engine ready: {engine}")

    def _start_engine(self, engine_config: EngineConfig) -> EngineSupervisor:
        engine_kwargs = {"kv_event_sink": self.kv_events.publish} if self.kv_events else {}
        try:
            return EngineSupervisor(
                engine_config,
                on_output=self.wake.set,
                on_give_up=self._give_up,
                failure_threshold=self.settings.engine_failure_threshold,
                max_restarts=self.settings.max_engine_restarts,
                step_timeout_s=self.settings.step_timeout_s,
                engine_kwargs=engine_kwargs,
            ).start()
        except BaseException:
            if self.kv_events is not None:
                self.kv_events.shutdown()
            raise

    def _make_kv_events(self, engine_config: EngineConfig):
        if self.settings.kv_events is None:
            return None
        from slipstream.kv_events.publisher import KVEventPublisher

        # vLLM numbers adapters from 1 in the order they are configured (lora_id).
        lora_ids = {name: i + 1 for i, name in enumerate(engine_config.lora_modules)}
        return KVEventPublisher(self.settings.kv_events, lora_ids=lora_ids)

    def _make_metrics(self, engine_config: EngineConfig, lora: bool) -> ModelMetrics | NoMetrics:
        if not self.settings.report_metrics:
            return NoMetrics()
        try:
            return ModelMetrics(
                pb_utils,
                {"model": self.model_name, "version": self.model_version},
                self.settings.metric_families,
                FamilyLimits(
                    max_model_len=engine_config.max_model_len,
                    block_size=engine_config.block_size,
                    num_blocks=self.engine.stats().kv_blocks_total,
                    max_num_seqs=engine_config.max_num_seqs,
                    max_loras=engine_config.max_loras if lora else 0,
                ),
                self.extensions.metric_families,
            )
        except Exception as e:  # e.g. tritonserver --allow-metrics=false
            self.logger.log_warn(f"slipstream: custom metrics unavailable ({e})")
            return NoMetrics()

    def _encode(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text, add_special_tokens=False)

    def _model_ready(self) -> bool:
        return bool(pb_utils.is_model_ready(self.model_name, str(self.model_version)))

    # ----------------------------------------------------------------- execute
    def execute(self, requests: list[Any]) -> None:
        if self.settings.health_check and not self._check_health(requests):
            return None
        refusing = SHUTTING_DOWN if self.shutdown.draining else None
        for request in requests:
            self.intake.take(request, refusing)
        return None

    # ----------------------------------------------------------------- health
    def _check_health(self, requests: list[Any]) -> bool:
        """ENABLE_VLLM_HEALTH_CHECK: False (and every request answered) once unhealthy."""
        if self.healthy:
            problem = self.engine_problem()
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
                answer = error_response(UNHEALTHY_MESSAGE, ErrorCode.UNAVAILABLE)
                send_final(request.get_response_sender(), answer, self.logger)
        return self.healthy

    def engine_problem(self) -> Optional[str]:
        """Why the engine cannot serve, or None (a test's model.py may override it)."""
        return engine_problem(self.engine)

    def is_ready(self) -> bool:
        """Readiness for Triton versions that ask the model (python_backend after 25.12)."""
        return self.engine.health().ok and not self.shutdown.draining

    def _give_up(self, health: Health) -> None:
        """The engine keeps dying: take the server down so that a fresh one replaces it
        (with Triton 2.51 the only way to stop reporting READY). Requests in flight have
        their errors: once the sender has handed them to Triton, Triton is asked to stop (it
        stops answering ready at once and passes on the responses it holds), and after
        ``RESPONSE_GRACE_S`` this stub ends: the watchdog then takes the server down."""
        self.logger.log_error(f"slipstream: {health.error}")
        if self.settings.health_check:  # vllm_backend's way: unloaded, the server stays up
            self._check_health([])
            return
        if self.watchdog is None or not self.watchdog.alive:
            self.logger.log_error("slipstream: no watchdog; requests are refused until restart")
            return
        deadline = time.monotonic() + 5.0
        while self.sender.num_active and time.monotonic() < deadline:
            time.sleep(0.01)
        self.gave_up = True
        self.watchdog.fatal(health.error or "engine dead")
        stop_server()
        time.sleep(RESPONSE_GRACE_S)
        os._exit(1)

    # ----------------------------------------------------------------- finalize
    def finalize(self) -> None:
        started = time.monotonic()
        self.logger.log_info("slipstream: finalize, stopping the engine")
        # aborts what is left: every stream ends, the sender sends FINAL (a dead engine's
        # thread may be stuck in a hung step: it is not waited for)
        self.engine.shutdown(timeout=1.0 if self.gave_up else 30.0)
        if self.kv_events is not None:
            self.kv_events.shutdown()
        self.sender.stop(timeout=30)
        self.metrics.stop()
        if self.watchdog is not None and not self.gave_up:  # else it takes the server down
            self.watchdog.goodbye()
        self.logger.log_info(f"slipstream: finalized in {time.monotonic() - started:.2f} s")
