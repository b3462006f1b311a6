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
from slipstream.server.guided_decoding import REQUEST_KEYS, TRTLLM_INPUTS, gather_structured_outputs

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
# vLLM's names for structured (guided) decoding (server/guided_decoding.py reads them).
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


def output_names(options: RequestOptions) -> list:
    """The output tensors a request asked for (text_output always)."""
    names = ["text_output"]
    for flag, name in (("return_finish_reason", "finish_reason"),
                       ("return_num_input_tokens", "num_input_tokens"),
                       ("return_num_output_tokens", "num_output_tokens"),
                       ("return_cumulative_logprob", "cumulative_logprob"),
                       ("return_logprobs", "logprobs"),
                       ("return_prompt_logprobs", "prompt_logprobs")):
        if getattr(options, flag):
            names.append(name)
    return names


def build_outputs(options: RequestOptions, text: str, *, finish_reason: Optional[str],
                  num_input_tokens: int, num_output_tokens: int, cumulative_logprob: float,
                  logprobs_json: str = "null", prompt_logprobs_json: str = "null") -> dict:
    """name -> numpy array for the requested outputs of one response, in Triton's vLLM
    backend's wire format: ``finish_reason`` is ``"None"`` until the last response,
    ``num_input_tokens`` a UINT32 scalar, ``num_output_tokens`` UINT32 [1] (tokens in this
    response when streaming), ``logprobs`` a JSON string (``"null"`` when not asked for)."""
    return build_sequence_outputs(options, [text], finish_reasons=[finish_reason],
                                  num_input_tokens=num_input_tokens,
                                  num_output_tokens=[num_output_tokens],
                                  cumulative_logprobs=[cumulative_logprob],
                                  logprobs_json=[logprobs_json],
                                  prompt_logprobs_json=prompt_logprobs_json)


def build_sequence_outputs(options: RequestOptions, texts: Sequence[str], *,
                           finish_reasons: Sequence[Optional[str]], num_input_tokens: int,
                           num_output_tokens: Sequence[int], cumulative_logprobs: Sequence[float],
                           logprobs_json: Sequence[str], prompt_logprobs_json: str = "null") -> dict:
    """``build_outputs`` for ``n`` sequences: as vLLM's backend returns ``n`` > 1, each
    per-sequence output holds one element per sequence, in index order; ``prompt_logprobs``
    (this backend's addition) is one JSON string for the request."""
    def strings(values) -> np.ndarray:
        return np.array([str(v).encode("utf-8") for v in values], dtype=np.object_)

    out = {"text_output": strings(texts)}
    if options.return_finish_reason:
        out["finish_reason"] = strings(finish_reasons)
    if options.return_num_input_tokens:
        out["num_input_tokens"] = np.asarray(num_input_tokens, dtype=np.uint32)
    if options.return_num_output_tokens:
        out["num_output_tokens"] = np.asarray(list(num_output_tokens), dtype=np.uint32)
    if options.return_cumulative_logprob:
        out["cumulative_logprob"] = np.array(list(cumulative_logprobs), dtype=np.float32)
    if options.return_logprobs:
        out["logprobs"] = strings(logprobs_json)
    if options.return_prompt_logprobs:
        out["prompt_logprobs"] = strings([prompt_logprobs_json])
    return out


def logprobs_entries(token_ids: Sequence[int], logprobs: Sequence[float], tokenizer,
                     detokenize: bool = True) -> list:
    """vLLM's per-token logprobs: ``{token id: {"logprob", "rank", "decoded_token"}}`` with
    the sampled token first, then its top-N alternatives (ranks 1..N). Each token is decoded
    on its own, as vLLM does, so the sampled tokens' pieces concatenate to the text."""
    entries = []
    for token, lp in zip(token_ids, logprobs):
        position = {token: (float(lp), getattr(lp, "rank", None))}
        for i, (alt, value) in enumerate(getattr(lp, "top", ())):
            position.setdefault(alt, (value, i + 1))
        entries.append({str(t): {"logprob": v, "rank": rank,
                                 "decoded_token": decode_token(tokenizer, t) if detokenize else None}
                        for t, (v, rank) in position.items()})
    return entries


def prompt_logprobs_entries(prompt_logprobs: Sequence, tokenizer, detokenize: bool = True) -> list:
    """vLLM's ``prompt_logprobs``: ``null`` for the first prompt token, then per token
    ``{token id: {"logprob", "rank", "decoded_token"}}``, the prompt token first."""
    return [None if position is None else
            {str(t): {"logprob": float(lp), "rank": getattr(lp, "rank", None),
                      "decoded_token": decode_token(tokenizer, t) if detokenize else None}
             for t, lp in position.items()}
            for position in prompt_logprobs]


def decode_token(tokenizer, token_id: int) -> str:
    """One token's text alone; a SentencePiece word-start marker that ``decode`` strips is put
    back as the space it stands for (vLLM does the same)."""
    text = tokenizer.decode([token_id])
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str) and piece.startswith("\u2581") and not text.startswith(" "):
        text = " " + text
    return text


@dataclass
class _SequenceState:
    """What a response builder keeps of one of the request's sequences."""

    texts: list = field(default_factory=list)
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: Optional[str] = None
    cumulative_logprob: float = 0.0


class ResponseBuilder:
    """One request's responses: what to send for each engine output (streaming) or once at
    the end (everything accumulated), with vLLM's prompt-prepending rule. With ``n`` > 1 each
    output tensor holds one element per sequence, in index order; a streamed response carries
    the sequence that moved (its ``index``) and empty deltas for the others."""

    def __init__(self, parsed: ParsedRequest, tokenizer=None) -> None:
        self.options, self.params, self.prompt = parsed.options, parsed.params, parsed.prompt
        self.tokenizer = tokenizer
        self.sequences = [_SequenceState() for _ in range(parsed.params.n)]
        self.prompt_logprobs: Optional[list] = None

    def streamed(self, out) -> dict:
        """The response for one engine output of a streaming request."""
        self._note(out)
        deltas = [_SequenceState() for _ in self.sequences]
        deltas[out.index] = _SequenceState([out.text], list(out.token_ids), list(out.logprobs or []))
        return self._outputs(out, ["".join(d.texts) for d in deltas], deltas, out.prompt_logprobs)

    def absorb(self, out) -> None:
        """Non-streaming: keep an output for the final response."""
        seq = self._note(out)
        seq.texts.append(out.text)
        seq.token_ids.extend(out.token_ids)
        seq.logprobs.extend(out.logprobs or [])

    def final(self, out) -> dict:
        """Non-streaming: the one response, after the finished output."""
        self.absorb(out)
        prefix = "" if self.options.exclude_input_in_output else self.prompt
        texts = [prefix + "".join(s.texts) for s in self.sequences]
        return self._outputs(out, texts, self.sequences, self.prompt_logprobs)

    def _note(self, out) -> _SequenceState:
        seq = self.sequences[out.index]
        if out.finish_reason is not None:
            seq.finish_reason = out.finish_reason
        seq.cumulative_logprob = out.cumulative_logprob
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        return seq

    def _outputs(self, out, texts: list, parts: list, prompt_lps: Optional[list]) -> dict:
        logprobs_json = ["null"] * len(parts)
        if self.options.return_logprobs and self.params.logprobs is not None:
            logprobs_json = [json.dumps(logprobs_entries(p.token_ids, p.logprobs, self.tokenizer,
                                                         self.params.detokenize)) for p in parts]
        prompt_json = "null"
        if self.options.return_prompt_logprobs and prompt_lps is not None:
            prompt_json = json.dumps(prompt_logprobs_entries(prompt_lps, self.tokenizer,
                                                             self.params.detokenize))
        if len(self.sequences) == 1:  # the finished output carries the sequence's own state
            finish_reasons = [out.finish_reason]
        else:
            finish_reasons = [s.finish_reason for s in self.sequences]
        return build_sequence_outputs(
            self.options, texts, finish_reasons=finish_reasons,
            num_input_tokens=out.num_prompt_tokens,
            num_output_tokens=[len(p.token_ids) for p in parts],
            cumulative_logprobs=[s.cumulative_logprob for s in self.sequences],
            logprobs_json=logprobs_json, prompt_logprobs_json=prompt_json)


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
    "engine_failure_threshold": "5",  # failed engine steps in a row that make it dead
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
