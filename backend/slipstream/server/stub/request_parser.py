"""Turning one Triton inference request into (prompt, SamplingParams, options). Pure Python.

The inputs follow Triton's vLLM backend (``text_input``, ``stream``, ``sampling_parameters``
as a JSON string, ``exclude_input_in_output``, ``return_*``) plus TensorRT-LLM-style typed
sampling inputs (``max_tokens``, ``temperature``, ``stop_words``, ``end_id`` ...). A value is
taken from, in order: its typed input tensor, the ``sampling_parameters`` JSON, the request
parameters (what ``"parameters": {...}`` of the HTTP generate endpoint becomes).

Each tensor is read as its row of ``input_table.INPUTS`` says (``Reading``), into the option
or sampling field the row names. Nothing here imports Triton: ``parse_request`` takes a dict
of input name -> numpy array and the request parameters (dict or JSON string), so it is
tested without a server.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np

from slipstream.core.boolean_text import REQUEST, parse_bool
from slipstream.core.lora_errors import lora_name_error
from slipstream.core.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS, SamplingParams, show
from slipstream.server.stub.guided_decoding import REQUEST_KEYS, gather_structured_outputs
from slipstream.server.stub.input_table import (
    BY_NAME as INPUT_BY_NAME,
    INPUTS,
    Reading,
    RequestInput,
    TritonType,
)
from slipstream.server.stub.input_values import BadRequestError, scalar

DEFAULT_MAX_TOKENS = 16
# Largest sampling_parameters / request parameters JSON: far above any valid request (stop
# lists are bounded), small enough to parse in milliseconds.
MAX_JSON_BYTES = 1 << 20


@dataclass
class RequestOptions:
    stream: bool = False
    exclude_input_in_output: bool = False
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_cumulative_logprob: bool = False
    return_logprobs: bool = False
    return_prompt_logprobs: bool = False
    priority: int = 0
    apply_chat_template: bool = False
    # vLLM's request field: False tokenizes text without BOS (a chat template rendered by the
    # client, e.g. the OpenAI frontend, already holds it).
    add_special_tokens: bool = True


@dataclass
class ParsedRequest:
    prompt: str
    params: SamplingParams
    options: RequestOptions


# RequestOptions' flags: typed inputs (input_table) or names in the JSON / request parameters
_BOOL_OPTIONS = tuple(f.name for f in fields(RequestOptions) if f.type == "bool")
# The declared Triton types of the inputs, for error messages.
INPUT_TYPES = {row.name: row.data_type.wire_name for row in INPUTS}
# Typed inputs whose one value becomes a one-element list of the SamplingParams field.
_LIST_TARGETS = ("stop_token_ids",)
# Read before (prompt, JSON) or after (structured outputs, refusals) the other tensors.
_READ_APART = (Reading.PROMPT, Reading.JSON, Reading.GUIDED, Reading.REFUSED, Reading.POOLING)
# Other request-parameter names kept as settings (ids, timeouts... are not).
_PARAMETER_SETTINGS = ("priority", "stop_words")
_SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}
# vLLM's names for structured (guided) decoding (server/stub/guided_decoding.py reads them).
STRUCTURED_OUTPUT_KEYS = REQUEST_KEYS
# Request-parameter names kept for refuse_unsupported (so they are refused, not ignored)
# or for structured outputs.
_REFUSED = {*STRUCTURED_OUTPUT_KEYS, "logits_processors"}


def _is_int_dtype(a: np.ndarray) -> bool:
    return a.dtype.kind in "iu"


def _is_float_dtype(a: np.ndarray) -> bool:
    return a.dtype.kind == "f"


def _is_bytes_dtype(a: np.ndarray) -> bool:
    return a.dtype.kind in "OSU"


def _decode(name: str, value: Any) -> str:
    if isinstance(value, (bytes, bytearray, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadRequestError(f"input '{name}' is not valid UTF-8: {e}") from None
    if isinstance(value, str):
        return value
    raise BadRequestError(f"input '{name}' must be a string (BYTES), got {type(value).__name__}")


def _check_dtype(name: str, a: np.ndarray, ok: bool) -> None:
    if not ok:
        raise BadRequestError(
            f"input '{name}' must be {INPUT_TYPES.get(name, '?')}, got numpy "
            f"dtype {np.asarray(a).dtype}"
        )


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and parse_bool(value, REQUEST) is not None:
        return bool(parse_bool(value, REQUEST))
    raise BadRequestError(f"'{name}' must be a boolean, got {show(value)}")


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise BadRequestError(f"'{name}' must be an integer, got {show(value)}")
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise BadRequestError(f"'{name}' must be an integer, got {show(value)}")


def _load_json(subject: str, text: Union[str, bytes]) -> Any:
    """``subject`` with its verb, e.g. "request parameters are"."""
    if len(text) > MAX_JSON_BYTES:
        raise BadRequestError(
            f"{subject} {len(text)} bytes long; at most {MAX_JSON_BYTES} are allowed"
        )
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRequestError(f"{subject} not valid JSON: {e}") from None
    except RecursionError:  # the decoder recurses once per nesting level
        raise BadRequestError(f"{subject} nested too deeply") from None


def parameters_dict(parameters: Union[None, str, Mapping[str, Any]]) -> dict:
    if parameters is None or parameters == "":
        return {}
    if isinstance(parameters, (str, bytes)):
        parameters = _load_json("request parameters are", parameters)
    if not isinstance(parameters, Mapping):
        raise BadRequestError("request parameters must be a JSON object")
    return dict(parameters)


def parse_request(
    inputs: Mapping[str, np.ndarray],
    parameters: Union[None, str, Mapping[str, Any]] = None,
    *,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    default_apply_chat_template: bool = False,
    max_logprobs: int = MAX_LOGPROBS,
) -> ParsedRequest:
    """Validate one request. Raises ``BadRequestError`` (a ValueError) with a client-facing text."""
    inputs = {k: v for k, v in inputs.items() if v is not None}
    request_params = parameters_dict(parameters)
    prompt = _read_prompt(inputs)
    sampling_json = _read_sampling_json(inputs)
    values = _merged_settings(request_params, sampling_json)
    for name, value in inputs.items():
        _read_tensor(name, np.asarray(value), values)
    _refuse_inputs(inputs)
    if "stop_words" in values:  # from JSON / parameters: a string or a list of strings
        values.setdefault("stop", values.pop("stop_words"))
    explicit_exclude = any(
        "exclude_input_in_output" in source for source in (inputs, sampling_json, request_params)
    )
    options = _read_options(values, default_apply_chat_template, explicit_exclude)
    params = _sampling_params(values, inputs, default_max_tokens, max_logprobs)
    return ParsedRequest(prompt, params, options)


def _read_prompt(inputs: Mapping[str, np.ndarray]) -> str:
    if "text_input" not in inputs:
        raise BadRequestError("missing required input 'text_input'")
    arr = np.asarray(inputs["text_input"])
    _check_dtype("text_input", arr, _is_bytes_dtype(arr))
    prompt = _decode("text_input", scalar("text_input", arr))
    if not prompt:
        raise BadRequestError("input 'text_input' is empty")
    return prompt


def _read_sampling_json(inputs: Mapping[str, np.ndarray]) -> dict[str, Any]:
    if "sampling_parameters" not in inputs:
        return {}
    arr = np.asarray(inputs["sampling_parameters"])
    _check_dtype("sampling_parameters", arr, _is_bytes_dtype(arr))
    text = _decode("sampling_parameters", scalar("sampling_parameters", arr))
    if not text.strip():
        return {}
    loaded = _load_json("input 'sampling_parameters' is", text)
    if not isinstance(loaded, dict):
        raise BadRequestError(
            f"input 'sampling_parameters' must be a JSON object, got {type(loaded).__name__}"
        )
    return loaded


def _is_setting(key: str) -> bool:
    """Whether a request parameter is a setting: they carry other things too."""
    return (
        key in _SAMPLING_FIELDS
        or key in _REFUSED
        or key in _BOOL_OPTIONS
        or key in _PARAMETER_SETTINGS
    )


def _merged_settings(
    request_params: Mapping[str, Any], sampling_json: Mapping[str, Any]
) -> dict[str, Any]:
    """Lowest precedence first: request parameters, then sampling_parameters (the typed
    tensors, read next, override both)."""
    values = {key: value for key, value in request_params.items() if _is_setting(key)}
    values.update(sampling_json)
    return values


def _read_tensor(name: str, arr: np.ndarray, values: dict[str, Any]) -> None:
    """One typed input into ``values`` under its target's name."""
    row = INPUT_BY_NAME.get(name)
    if row is not None and row.reading in _READ_APART:
        return
    reader = _TENSOR_READERS.get(row.reading) if row is not None else None
    if row is None or reader is None:  # TensorRT-LLM's inputs are translated away before parsing
        raise BadRequestError(f"unknown input '{name}'")
    reader(row, arr, values)


def _read_option(row: RequestInput, arr: np.ndarray, values: dict[str, Any]) -> None:
    if row.data_type is TritonType.BOOL:
        _check_dtype(row.name, arr, arr.dtype.kind == "b")
        values[row.target] = bool(scalar(row.name, arr))
    else:
        _read_int(row, arr, values)


def _read_int(row: RequestInput, arr: np.ndarray, values: dict[str, Any]) -> None:
    _check_dtype(row.name, arr, _is_int_dtype(arr))
    value = int(scalar(row.name, arr))
    values[row.target] = [value] if row.target in _LIST_TARGETS else value


def _read_float(row: RequestInput, arr: np.ndarray, values: dict[str, Any]) -> None:
    _check_dtype(row.name, arr, _is_float_dtype(arr))
    value = float(scalar(row.name, arr))
    if not math.isfinite(value):
        raise BadRequestError(f"input '{row.name}' must be finite, got {value}")
    values[row.target] = value


def _read_stop_words(row: RequestInput, arr: np.ndarray, values: dict[str, Any]) -> None:
    _check_dtype(row.name, arr, _is_bytes_dtype(arr))
    if arr.size > MAX_STOP_STRINGS:  # before decoding every element
        raise BadRequestError(
            f"input '{row.name}' has {arr.size} strings; at most {MAX_STOP_STRINGS} are allowed"
        )
    values[row.target] = [_decode(row.name, x) for x in arr.reshape(-1)]


_TENSOR_READERS: dict[Reading, Callable[[RequestInput, np.ndarray, dict[str, Any]], None]] = {
    Reading.OPTION: _read_option,
    Reading.SAMPLING_INT: _read_int,
    Reading.SAMPLING_FLOAT: _read_float,
    Reading.STOP_WORDS: _read_stop_words,
}


def _refuse_inputs(inputs: Mapping[str, np.ndarray]) -> None:
    for name in inputs:
        row = INPUT_BY_NAME.get(name)
        if row is not None and row.reading is Reading.REFUSED:
            raise BadRequestError(f"input '{name}' is not supported: {row.refusal}")


def _read_options(
    values: dict[str, Any], default_apply_chat_template: bool, explicit_exclude: bool
) -> RequestOptions:
    """Take the options out of ``values`` (what stays is sampling settings)."""
    options = RequestOptions(apply_chat_template=default_apply_chat_template)
    for name in _BOOL_OPTIONS:
        if name in values:
            setattr(options, name, _as_bool(name, values.pop(name)))
    if "priority" in values:
        options.priority = _as_int("priority", values.pop("priority"))
    if options.stream:
        if explicit_exclude and not options.exclude_input_in_output:
            raise BadRequestError(  # vLLM's text: its clients match it
                "When streaming, `exclude_input_in_output` = False is not allowed."
            )
        options.exclude_input_in_output = True
    return options


def _sampling_params(
    values: dict[str, Any],
    inputs: Mapping[str, np.ndarray],
    default_max_tokens: int,
    max_logprobs: int,
) -> SamplingParams:
    try:
        gather_structured_outputs(values, inputs)
    except ValueError as e:
        raise BadRequestError(str(e)) from None
    refuse_unsupported(values, max_logprobs)
    values.setdefault("max_tokens", default_max_tokens)
    if isinstance(values.get("stop"), str):
        values["stop"] = [values["stop"]]
    stop_ids = values.get("stop_token_ids")
    if isinstance(stop_ids, (int, np.integer)) and not isinstance(stop_ids, bool):
        values["stop_token_ids"] = [int(stop_ids)]
    try:
        return SamplingParams.from_dict(values)
    except (ValueError, TypeError) as e:
        raise BadRequestError(f"invalid sampling parameters: {e}") from None


def refuse_unsupported(values: dict, max_logprobs: int = MAX_LOGPROBS) -> None:
    """What vLLM accepts but this engine cannot honour gets a clear error (vLLM's texts for
    logprobs) instead of being ignored."""
    if values.get("logits_processors"):
        raise BadRequestError("per-request logits processors are not supported")
    values.pop("logits_processors", None)
    for key, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        got = values.get(key)
        if got is None or isinstance(got, bool):
            continue
        if str(got).strip().lstrip("-").isdigit() and int(got) > max_logprobs:
            raise BadRequestError(
                f"Requested {what} logprobs of {int(got)}, which is greater "
                f"than max allowed: {max_logprobs}"
            )


def lora_error(
    inputs: Mapping[str, np.ndarray],
    parameters: Union[None, str, Mapping[str, Any]] = None,
    supported: Optional[Sequence[str]] = None,
) -> Optional[str]:
    """vllm_backend's refusal of a ``lora_name`` (LoRA off: ``supported`` None; or not one of
    ``supported``), from the ``sampling_parameters`` JSON or the request parameters (HTTP
    ``"parameters"``); None when it may be served. A malformed request is left for
    ``parse_request`` to describe."""
    sources = []
    if inputs.get("sampling_parameters") is not None:
        try:
            text = _decode(
                "sampling_parameters",
                scalar("sampling_parameters", np.asarray(inputs["sampling_parameters"])),
            )
            sources.append(_load_json("sampling_parameters is", text))
        except BadRequestError:
            pass
    try:
        sources.append(parameters_dict(parameters))
    except BadRequestError:
        pass
    for source in sources:
        if isinstance(source, dict) and source.get("lora_name") not in (None, ""):
            return lora_name_error(str(source["lora_name"]), supported)
    return None
