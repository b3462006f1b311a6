"""Turning one Triton inference request into (prompt, SamplingParams, options). Pure Python.

The inputs follow Triton's vLLM backend (``text_input``, ``stream``, ``sampling_parameters``
as a JSON string, ``exclude_input_in_output``, ``return_*``) plus TensorRT-LLM-style typed
sampling inputs (``max_tokens``, ``temperature``, ``stop_words``, ``end_id`` ...). A value is
taken from, in order: its typed input tensor, the ``sampling_parameters`` JSON, the request
parameters (what ``"parameters": {...}`` of the HTTP generate endpoint becomes).

Nothing here imports Triton: ``parse_request`` takes a dict of input name -> numpy array and
the request parameters (dict or JSON string), so it is tested without a server.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from slipstream.core.lora_errors import lora_name_error
from slipstream.core.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS, SamplingParams, show
from slipstream.server.stub.guided_decoding import REQUEST_KEYS, TRTLLM_INPUTS, gather_structured_outputs

DEFAULT_MAX_TOKENS = 16
# Largest sampling_parameters / request parameters JSON: far above any valid request (stop
# lists are bounded), small enough to parse in milliseconds.
MAX_JSON_BYTES = 1 << 20


class BadRequestError(ValueError):
    """The request is malformed; the message is meant for the client."""


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


# input name -> (kind, SamplingParams field or option name)
_BOOL_OPTIONS = ("stream", "exclude_input_in_output", "return_finish_reason",
                 "return_num_input_tokens", "return_num_output_tokens",
                 "return_cumulative_logprob", "return_logprobs", "return_prompt_logprobs",
                 "apply_chat_template", "add_special_tokens")
_TYPED_INT = {"max_tokens": "max_tokens", "min_tokens": "min_tokens", "top_k": "top_k",
              "seed": "seed", "end_id": "stop_token_ids"}
_TYPED_FLOAT = {"temperature": "temperature", "top_p": "top_p",
                "repetition_penalty": "repetition_penalty",
                "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
# The declared Triton types (config.pbtxt) of the typed inputs, for error messages.
INPUT_TYPES = {"text_input": "BYTES", "stream": "BOOL", "sampling_parameters": "BYTES",
               **{k: "BOOL" for k in _BOOL_OPTIONS if k != "stream"},
               "max_tokens": "INT32", "min_tokens": "INT32", "top_k": "INT32", "end_id": "INT32",
               "priority": "INT32", "seed": "UINT64",
               **{k: "FP32" for k in _TYPED_FLOAT}, "stop_words": "BYTES",
               **{k: "BYTES" for k in TRTLLM_INPUTS}}
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


def _scalar(name: str, a: np.ndarray) -> Any:
    a = np.asarray(a)
    if a.size != 1:
        raise BadRequestError(f"input '{name}' must hold exactly one element, got shape "
                              f"{list(a.shape)}")
    return a.reshape(-1)[0]


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
        raise BadRequestError(f"input '{name}' must be {INPUT_TYPES.get(name, '?')}, got numpy "
                              f"dtype {np.asarray(a).dtype}")


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        low = value.strip().lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
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
        raise BadRequestError(f"{subject} {len(text)} bytes long; at most {MAX_JSON_BYTES} "
                              "are allowed")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRequestError(f"{subject} not valid JSON: {e}") from None
    except RecursionError:  # the decoder recurses once per nesting level
        raise BadRequestError(f"{subject} nested too deeply") from None


def _parameters_dict(parameters: Union[None, str, Mapping[str, Any]]) -> dict:
    if parameters is None or parameters == "":
        return {}
    if isinstance(parameters, (str, bytes)):
        parameters = _load_json("request parameters are", parameters)
    if not isinstance(parameters, Mapping):
        raise BadRequestError("request parameters must be a JSON object")
    return dict(parameters)


def parse_request(inputs: Mapping[str, np.ndarray],
                  parameters: Union[None, str, Mapping[str, Any]] = None, *,
                  default_max_tokens: int = DEFAULT_MAX_TOKENS,
                  default_apply_chat_template: bool = False,
                  max_logprobs: int = MAX_LOGPROBS) -> ParsedRequest:
    """Validate one request. Raises ``BadRequestError`` (a ValueError) with a client-facing text."""
    inputs = {k: v for k, v in inputs.items() if v is not None}
    request_params = _parameters_dict(parameters)

    # --- text_input
    if "text_input" not in inputs:
        raise BadRequestError("missing required input 'text_input'")
    arr = np.asarray(inputs["text_input"])
    _check_dtype("text_input", arr, _is_bytes_dtype(arr))
    prompt = _decode("text_input", _scalar("text_input", arr))
    if not prompt:
        raise BadRequestError("input 'text_input' is empty")

    # --- sampling_parameters JSON
    sp: dict = {}
    if "sampling_parameters" in inputs:
        arr = np.asarray(inputs["sampling_parameters"])
        _check_dtype("sampling_parameters", arr, _is_bytes_dtype(arr))
        text = _decode("sampling_parameters", _scalar("sampling_parameters", arr))
        if text.strip():
            sp = _load_json("input 'sampling_parameters' is", text)
            if not isinstance(sp, dict):
                raise BadRequestError("input 'sampling_parameters' must be a JSON object, got "
                                      f"{type(sp).__name__}")

    # Lowest precedence first: request parameters, then sampling_parameters, then tensors.
    values: dict = {}
    for source in (request_params, sp):
        for key, value in source.items():
            if source is request_params and key not in _SAMPLING_FIELDS and key not in _REFUSED \
                    and key not in _BOOL_OPTIONS and key not in ("priority", "stop_words"):
                continue  # request parameters carry other things too (ids, timeouts...)
            values[key] = value

    for name, value in inputs.items():
        arr = np.asarray(value)
        if name in ("text_input", "sampling_parameters", "image", *TRTLLM_INPUTS):
            continue
        if name in _BOOL_OPTIONS:
            _check_dtype(name, arr, arr.dtype.kind == "b")
            values[name] = bool(_scalar(name, arr))
        elif name in _TYPED_INT or name == "priority":
            _check_dtype(name, arr, _is_int_dtype(arr))
            v = int(_scalar(name, arr))
            values[_TYPED_INT.get(name, name)] = [v] if name == "end_id" else v
        elif name in _TYPED_FLOAT:
            _check_dtype(name, arr, _is_float_dtype(arr))
            v = float(_scalar(name, arr))
            if not math.isfinite(v):
                raise BadRequestError(f"input '{name}' must be finite, got {v}")
            values[_TYPED_FLOAT[name]] = v
        elif name == "stop_words":
            _check_dtype(name, arr, _is_bytes_dtype(arr))
            if arr.size > MAX_STOP_STRINGS:  # before decoding every element
                raise BadRequestError(f"input 'stop_words' has {arr.size} strings; at most "
                                      f"{MAX_STOP_STRINGS} are allowed")
            values["stop"] = [_decode(name, x) for x in arr.reshape(-1)]
        else:
            raise BadRequestError(f"unknown input '{name}'")

    if "image" in inputs:
        raise BadRequestError("input 'image' is not supported: this backend serves text-only "
                              "models")
    if "stop_words" in values:  # from JSON / parameters: a string or a list of strings
        values.setdefault("stop", values.pop("stop_words"))
        values.pop("stop_words", None)

    # --- options
    opts = RequestOptions(apply_chat_template=default_apply_chat_template)
    for name in _BOOL_OPTIONS:
        if name in values:
            setattr(opts, name, _as_bool(name, values.pop(name)))
    if "priority" in values:
        opts.priority = _as_int("priority", values.pop("priority"))
    explicit_exclude = any(n == "exclude_input_in_output" for n in inputs) or \
        "exclude_input_in_output" in sp or "exclude_input_in_output" in request_params
    if opts.stream:
        if explicit_exclude and not opts.exclude_input_in_output:
            raise BadRequestError(  # vLLM's text: its clients match it
                "When streaming, `exclude_input_in_output` = False is not allowed.")
        opts.exclude_input_in_output = True

    # --- sampling parameters
    try:
        gather_structured_outputs(values, inputs)
    except ValueError as e:
        raise BadRequestError(str(e)) from None
    refuse_unsupported(values, max_logprobs)
    values.setdefault("max_tokens", default_max_tokens)
    if isinstance(values.get("stop"), str):
        values["stop"] = [values["stop"]]
    if isinstance(values.get("stop_token_ids"), (int, np.integer)) and \
            not isinstance(values.get("stop_token_ids"), bool):
        values["stop_token_ids"] = [int(values["stop_token_ids"])]
    try:
        params = SamplingParams.from_dict(values)
    except (ValueError, TypeError) as e:
        raise BadRequestError(f"invalid sampling parameters: {e}") from None
    return ParsedRequest(prompt, params, opts)


def refuse_unsupported(values: dict, max_logprobs: int = MAX_LOGPROBS) -> None:
    """What vLLM accepts but this engine cannot honour gets a clear error (vLLM's texts for
    logprobs) instead of being ignored."""
    if values.get("logits_processors"):
        raise BadRequestError("per-request logits processors are not supported")
    values.pop("logits_processors", None)
    for key, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        got = values.get(key)
        if got is not None and not isinstance(got, bool) and str(got).strip().lstrip("-").isdigit() \
                and int(got) > max_logprobs:
            raise BadRequestError(f"Requested {what} logprobs of {int(got)}, which is greater "
                                  f"than max allowed: {max_logprobs}")


def lora_error(inputs: Mapping[str, np.ndarray],
               parameters: Union[None, str, Mapping[str, Any]] = None,
               supported: Optional[Sequence[str]] = None) -> Optional[str]:
    """vllm_backend's refusal of a ``lora_name`` (LoRA off: ``supported`` None; or not one of
    ``supported``), from the ``sampling_parameters`` JSON or the request parameters (HTTP
    ``"parameters"``); None when it may be served. A malformed request is left for
    ``parse_request`` to describe."""
    sources = []
    if inputs.get("sampling_parameters") is not None:
        try:
            sources.append(_load_json("sampling_parameters is", _decode("sampling_parameters", _scalar(
                "sampling_parameters", np.asarray(inputs["sampling_parameters"])))))
        except BadRequestError:
            pass
    try:
        sources.append(_parameters_dict(parameters))
    except BadRequestError:
        pass
    for source in sources:
        if isinstance(source, dict) and source.get("lora_name") not in (None, ""):
            return lora_name_error(str(source["lora_name"]), supported)
    return None
