"""A Triton model's configuration as the Slipstream backend reads it.

* ``auto_complete``: the inputs of ``input_table`` (Triton's vLLM backend's, Slipstream's typed
  sampling inputs) and what the model's request interfaces add (``ConfigAdditions``: the
  composition root passes TensorRT-LLM's), so a model directory needs only
  ``backend: "slipstream"`` and the shipped ``config.pbtxt`` lists none, and the outputs;
  decoupled unless the ``decoupled`` parameter is "false"; ``max_batch_size`` is the config's
  (0 when it sets none: no batch dimension), and Triton never batches requests itself.
* ``load_settings``: engine and server settings from config.pbtxt ``parameters`` and
  ``1/model.json`` (vLLM's engine arguments, ``engine_args``); parameters win over model.json,
  so ``slipstream serve --set`` overrides either.

Defaults depend on the backend named in config.pbtxt: under ``slipstream`` the custom metrics
are on, vLLM-named families too (what the inference gateway and vLLM's dashboards read); under
``vllm`` (the alias) Triton vLLM backend's (custom metrics only with ``REPORT_CUSTOM_METRICS``);
under ``python`` (``model_repository/slipstream/1/model.py``) Slipstream's own (its metrics on,
``metric_families`` adds ``vllm``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Protocol, TypeVar

from slipstream.core.boolean_text import EXACT, JSON_FLAG, SETTING, parse_bool
from slipstream.core.config import EngineConfig
from slipstream.core.sampling_params import MAX_LOGPROBS
from slipstream.kv_events.config import KVEventsConfig
from slipstream.server.stub import input_table
from slipstream.server.stub.engine_arg_reader import (
    MODEL_JSON,
    read_model_json,
    resolve_model,
    translate,
)
from slipstream.server.stub.input_table import Reading, RequestInput
from slipstream.server.stub.multi_lora import read_multi_lora
from slipstream.server.stub.request_interface import ConfigAdditions, no_additions
from slipstream.server.stub.request_parser import DEFAULT_MAX_TOKENS

METRIC_FAMILIES = ("slipstream", "vllm", "trtllm")
PATH_SETTINGS = ("model", "tokenizer", "speculative_model")


# The model's inputs are input_table.INPUTS (what the parser reads, auto-completed here).
INPUT_NAMES = input_table.INPUT_NAMES
OUTPUTS: list[Mapping[str, object]] = [
    {"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "finish_reason", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "cumulative_logprob", "data_type": "TYPE_FP32", "dims": [-1]},
    {"name": "logprobs", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "prompt_logprobs", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "num_input_tokens", "data_type": "TYPE_UINT32", "dims": [1]},
    {"name": "num_output_tokens", "data_type": "TYPE_UINT32", "dims": [-1]},
]
# Settings of model.py that are not engine settings (everything else in config.pbtxt
# ``parameters`` goes to EngineConfig.from_dict).
SERVER_PARAMETERS = {
    "default_max_tokens": str(DEFAULT_MAX_TOKENS),
    "apply_chat_template": "false",
    "metrics_interval_ms": "1000",
    # Triton vLLM backend's switches; "" = the default of the model's backend (model_config.py).
    "REPORT_CUSTOM_METRICS": "",
    "ENABLE_VLLM_HEALTH_CHECK": "false",
    "metric_families": "",
    # failed engine steps in a row, or requests failing in it with none served between,
    # that make it dead (engine/health.py)
    "engine_failure_threshold": "5",
    # Engine restarts inside the stub within 10 minutes before the server is taken down. 0:
    # a dead engine takes the server down at once, as a crash does (Triton 2.51 cannot make a
    # model not ready otherwise; its supervisor then restarts it).
    "max_engine_restarts": "0",
    "step_timeout_s": "120",  # a step running longer is hung: the engine dies (0 = no watchdog)
    "max_request_seconds": "0",  # a request running longer ends with an error (0 = no limit)
    "decoupled": "",  # "false": a non-decoupled model (unary infer); model_config.auto_complete
    "compatibility": "",  # "trtllm": TensorRT-LLM's semantics and error texts; "" = vLLM's
    "interface": "",  # "llmapi": TensorRT-LLM's LLM-API model's inputs and outputs
    "kv_events_config": "",  # vLLM's KVEventsConfig as JSON (slipstream/kv_events/config.py)
}


def split_parameters(params: Mapping[str, str]) -> tuple:
    """(engine settings, server settings) from a model config's parameters."""
    server = dict(SERVER_PARAMETERS)
    engine = {}
    for key, value in params.items():
        if key in SERVER_PARAMETERS:
            server[key] = value
        else:
            engine[key] = value
    return engine, server


DEFAULT_MAX_QUEUE_SIZE = 256  # waiting requests beyond which a server refuses new ones


@dataclass
class ModelSettings:
    engine: dict  # for EngineConfig.from_dict
    default_max_tokens: int
    apply_chat_template: bool
    metrics_interval_s: float
    report_metrics: bool  # REPORT_CUSTOM_METRICS (and not model.json's disable_log_stats)
    metric_families: tuple  # which of METRIC_FAMILIES to export
    health_check: bool  # ENABLE_VLLM_HEALTH_CHECK
    max_logprobs: int
    engine_failure_threshold: int  # failed steps (or requests) in a row that make it dead
    max_engine_restarts: int  # restarts within 10 minutes before the server is taken down
    step_timeout_s: float = 120.0  # a step running longer is hung (0: no step watchdog)
    max_request_seconds: float = 0.0  # a request running longer ends with an error (0: none)
    compatibility: str = "vllm"  # whose error texts: "vllm" or "trtllm"
    interface: str = ""  # "llmapi": TensorRT-LLM's LLM-API model (trtllm/llmapi.py)
    kv_events: Optional[KVEventsConfig] = None  # set when KV events are published


class AutoCompleteConfig(Protocol):
    """What ``auto_complete`` uses of Triton's ``pb_utils.ModelConfig``."""

    def as_dict(self) -> dict[str, Any]: ...

    def add_input(self, input: dict[str, object]) -> None: ...

    def add_output(self, output: Mapping[str, object]) -> None: ...

    def set_model_transaction_policy(self, transaction_policy_dict: dict[str, bool]) -> None: ...

    def set_max_batch_size(self, max_batch_size: int) -> None: ...


_Config = TypeVar("_Config", bound=AutoCompleteConfig)


def auto_complete(
    config: _Config, additions: Callable[[Mapping[str, Any]], ConfigAdditions] = no_additions
) -> _Config:
    """Triton's ``auto_complete_config`` hook: add what the config leaves out (the native
    inputs and outputs, and what ``additions`` says the model's interfaces add)."""
    declared = config.as_dict()
    have_inputs = {i["name"] for i in declared.get("input", [])}
    have_outputs = {o["name"] for o in declared.get("output", [])}
    extra = additions(declared)
    outputs = list(extra.outputs) if extra.replace_outputs else [*OUTPUTS, *extra.outputs]
    for row in (*input_table.INPUTS, *extra.inputs):
        if row.name not in have_inputs:
            config.add_input(_input_entry(row, extra.optional_prompt))
    for entry in outputs:
        if entry["name"] not in have_outputs:
            config.add_output(entry)
    # Decoupled unless the decoupled parameter is "false": that model answers unary infer.
    config.set_model_transaction_policy(dict(decoupled=not _wants_unary(declared)))
    # A config's own max_batch_size > 0 is kept: clients then send a batch dimension and
    # the adapter splits each request into its rows. Triton never batches requests itself
    # (no dynamic_batching): the engine does, across requests.
    if int(declared.get("max_batch_size") or 0) <= 0:
        config.set_max_batch_size(0)
    return config


def _input_entry(row: RequestInput, optional_prompt: bool) -> dict[str, object]:
    entry = row.config_entry()
    if optional_prompt and row.reading is Reading.PROMPT:
        # optional, so that a request without it reaches the interface that names what it
        # carries instead (the adapter requires text_input itself)
        entry["optional"] = True
    return entry


def config_parameter(declared: Mapping[str, Any], key: str) -> str:
    """A config.pbtxt parameter's value, trimmed and lower-cased ("" when absent)."""
    value = (declared.get("parameters") or {}).get(key) or {}
    return str(value.get("string_value", "")).strip().lower()


def _wants_unary(declared: Mapping[str, Any]) -> bool:
    """Triton's config JSON reads ``decoupled: false`` whether the file said so or said
    nothing (and our own configs leave it out), so the ``decoupled`` parameter decides."""
    return parse_bool(config_parameter(declared, "decoupled"), EXACT) is False


def _bool(name: str, value: str, default: bool) -> bool:
    if value.strip() == "":
        return default
    parsed = parse_bool(value, EXACT)
    if parsed is None:
        raise ValueError(f'config parameter {name} must be "true" or "false", got {value!r}')
    return parsed


def _families(value: str, default: tuple) -> tuple:
    if not value.strip():
        return default
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    unknown = [n for n in names if n not in METRIC_FAMILIES]
    if unknown:
        raise ValueError(f"metric_families: unknown {unknown}; choose from {METRIC_FAMILIES}")
    return names


def load_settings(
    parameters: Mapping[str, str], backend: str, model_dir: Path, version_dir: Optional[Path] = None
) -> ModelSettings:
    """Everything a model needs to start, checked; ``ValueError`` says what is wrong."""
    model_dir = Path(model_dir)
    version_dir = Path(version_dir) if version_dir is not None else model_dir / "1"
    engine_params, server = split_parameters(parameters)
    vllm_args = translate(read_model_json(version_dir) or {}, where=str(version_dir / MODEL_JSON))
    # Parameters take vLLM's names and Slipstream's own, and win over model.json.
    param_args = translate(
        engine_params, spelling=SETTING, own_names=True, where="config parameters"
    )
    engine = {**vllm_args.engine, **param_args.engine}
    disable_log_stats = _first(param_args.disable_log_stats, vllm_args.disable_log_stats, False)
    max_logprobs = _first(param_args.max_logprobs, vllm_args.max_logprobs, MAX_LOGPROBS)
    search = [model_dir, version_dir, Path.cwd()]
    for key in PATH_SETTINGS:
        if isinstance(engine.get(key), str) and engine[key]:
            engine[key] = resolve_model(engine[key], search)
    if parse_bool(str(engine.get("enable_lora", "")), JSON_FLAG) and "lora_modules" not in engine:
        engine["lora_modules"] = read_multi_lora(version_dir, search)
    # A server refuses work it cannot start soon instead of queueing without bound
    # (model.json or the config may still say 0: unbounded).
    engine.setdefault("max_queue_size", DEFAULT_MAX_QUEUE_SIZE)
    kv_events = _kv_events(server["kv_events_config"] or vllm_args.kv_events_config, engine)
    own_layout = backend == "python"
    # On by default except under the vllm alias, which keeps Triton vLLM backend's default
    # (off) for repositories written for it: routers and dashboards read these series.
    report = _bool(
        "REPORT_CUSTOM_METRICS", server["REPORT_CUSTOM_METRICS"], default=backend != "vllm"
    )
    return ModelSettings(
        engine=engine,
        default_max_tokens=int(server["default_max_tokens"]),
        apply_chat_template=_bool("apply_chat_template", server["apply_chat_template"], False),
        metrics_interval_s=float(server["metrics_interval_ms"]) / 1000.0,
        report_metrics=report and not disable_log_stats,
        metric_families=_families(
            server["metric_families"], ("slipstream",) if own_layout else ("slipstream", "vllm")
        ),
        health_check=_bool("ENABLE_VLLM_HEALTH_CHECK", server["ENABLE_VLLM_HEALTH_CHECK"], False),
        max_logprobs=max_logprobs,
        engine_failure_threshold=int(server["engine_failure_threshold"]),
        max_engine_restarts=int(server["max_engine_restarts"]),
        step_timeout_s=float(server["step_timeout_s"]),
        max_request_seconds=float(server["max_request_seconds"]),
        compatibility=_compatibility(server["compatibility"]),
        interface=_interface(server["interface"]),
        kv_events=kv_events,
    )


def _first(*values: Any) -> Any:
    """The first value that is set (not None)."""
    return next(v for v in values if v is not None)


def check_instance_kind(kind: str, engine: EngineConfig) -> None:
    """A tensor-parallel model spans devices and processes of its own: Triton must run it as
    one ``KIND_MODEL`` instance, as Triton's vLLM backend requires for multi-device models
    (``kind`` is Triton's ``model_instance_kind``: CPU, GPU or MODEL)."""
    if engine.tensor_parallel_size > 1 and kind and kind != "MODEL":
        raise ValueError(
            f"tensor_parallel_size={engine.tensor_parallel_size} needs instance_group kind "
            f"KIND_MODEL (the ranks take their own devices), not KIND_{kind}"
        )


def _interface(value: str) -> str:
    value = value.strip()
    if value not in ("", "llmapi"):
        raise ValueError(f'interface must be "llmapi" or left out, got {value!r}')
    return value


def _kv_events(value, engine: dict) -> Optional[KVEventsConfig]:
    """The events config when events are on; they need vLLM's block hashes, which become the
    default (an explicit ``builtin`` is refused)."""
    config = KVEventsConfig.parse(value)
    if config is None or not config.enabled:
        return None
    algo = str(engine.get("prefix_caching_hash_algo") or "sha256_cbor")
    if algo != "sha256_cbor":
        raise ValueError(
            "kv_events_config: KV events carry vLLM's block hashes, which need "
            f"prefix_caching_hash_algo sha256_cbor, not {algo!r}"
        )
    engine["prefix_caching_hash_algo"] = algo
    return config


def _compatibility(value: str) -> str:
    value = value.strip() or "vllm"
    if value not in ("vllm", "trtllm"):
        raise ValueError(f'compatibility must be "vllm" or "trtllm", got {value!r}')
    return value
