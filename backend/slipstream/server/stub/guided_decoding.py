"""Every request shape for structured outputs, gathered into vLLM's ``structured_outputs``.

* vLLM today: ``structured_outputs`` = ``{"json" | "regex" | "choice" | "grammar" |
  "json_object": ..., options}`` in ``sampling_parameters``.
* vLLM before 0.11: ``guided_decoding`` (the same dict), or one of ``guided_json``,
  ``guided_regex``, ``guided_choice``, ``guided_grammar``, ``guided_json_object`` with
  ``guided_whitespace_pattern`` / ``guided_decoding_backend``; OpenAI's ``response_format``
  (``json_object`` / ``json_schema``) as vLLM's server maps it.
* TensorRT-LLM: the typed inputs ``guided_decoding_guide_type`` (``json``, ``json_schema``,
  ``regex``, ``ebnf_grammar``) and ``guided_decoding_guide``.

Pure Python: errors are ``ValueError`` with a client-facing text (request_parser.py turns them into
``BadRequestError``). The spec itself is checked by ``core.structured_outputs``.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Optional

import numpy as np

# vLLM's older per-constraint names -> the structured_outputs field each one sets.
LEGACY_KEYS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "guided_json_object": "json_object",
    "guided_whitespace_pattern": "whitespace_pattern",
}
# Names that choose vLLM's grammar library: accepted and ignored (there is one here).
IGNORED_KEYS = ("guided_decoding_backend",)
REQUEST_KEYS = (
    "structured_outputs",
    "guided_decoding",
    "response_format",
    *LEGACY_KEYS,
    *IGNORED_KEYS,
)
TRTLLM_INPUTS = ("guided_decoding_guide_type", "guided_decoding_guide")
# TensorRT-LLM's guide types -> (structured_outputs field, fixed value or None = the guide).
# Its "json" is any JSON object or array (xgrammar's built-in JSON grammar); the guide is unused.
TRTLLM_GUIDE_TYPES = {
    "json": ("json", {"type": ["object", "array"]}),
    "json_schema": ("json", None),
    "regex": ("regex", None),
    "ebnf_grammar": ("grammar", None),
}


def gather_structured_outputs(values: dict, inputs: Mapping[str, np.ndarray]) -> None:
    """Replace, in ``values``, every structured-output name by one ``structured_outputs``
    dict (absent when the request asks for none). Two different shapes in one request are
    refused rather than one silently winning."""
    for key in ("guided_decoding", "response_format", "guided_choice"):
        values[key] = _json_text(key, values.get(key))  # HTTP parameters carry scalars only
    found = []
    for key in ("structured_outputs", "guided_decoding"):
        value = values.pop(key, None)
        if value not in (None, "", {}):
            found.append((key, value))
    legacy = {
        field: values.pop(key) for key, field in LEGACY_KEYS.items() if values.get(key) is not None
    }
    for key in (*LEGACY_KEYS, *IGNORED_KEYS):
        values.pop(key, None)
    if set(legacy) - {"whitespace_pattern"}:
        found.append(("guided_*", legacy))
    response_format = _from_response_format(values.pop("response_format", None))
    if response_format is not None:
        found.append(("response_format", response_format))
    typed = _from_trtllm_inputs(inputs)
    if typed is not None:
        found.append(("guided_decoding_guide_type", typed))
    if len(found) > 1:
        raise ValueError(
            "structured outputs are given more than once ("
            f"{', '.join(k for k, _ in found)}); send one"
        )
    if found:
        spec = found[0][1]
        if isinstance(spec, dict) and "whitespace_pattern" in legacy:
            spec = {**spec, "whitespace_pattern": legacy["whitespace_pattern"]}
        values["structured_outputs"] = spec


def _json_text(key: str, value: Any) -> Any:
    """An object or list sent as JSON text (Triton's HTTP request parameters cannot hold
    objects); other strings are left as they are."""
    if isinstance(value, str) and value.lstrip()[:1] in ("{", "["):
        try:
            return json.loads(value)
        except ValueError:
            raise ValueError(f"{key} is not valid JSON") from None
    return value


def _from_response_format(value: Any) -> Optional[dict]:
    if value in (None, "", {}):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ValueError("response_format must be an object with a 'type'")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        schema = (value.get("json_schema") or {}).get("schema")
        if schema is None:
            raise ValueError("response_format json_schema needs 'json_schema': {'schema': ...}")
        return {"json": schema}
    raise ValueError(
        f"response_format type must be text, json_object or json_schema, got {kind[:40]!r}"
    )


def _from_trtllm_inputs(inputs: Mapping[str, np.ndarray]) -> Optional[dict]:
    guide_type = _string_input(inputs, "guided_decoding_guide_type")
    guide = _string_input(inputs, "guided_decoding_guide")
    if guide_type is None:
        if guide is not None:
            raise ValueError("input 'guided_decoding_guide' needs 'guided_decoding_guide_type'")
        return None
    if guide_type not in TRTLLM_GUIDE_TYPES:
        raise ValueError(
            f"guided_decoding_guide_type must be one of "
            f"{', '.join(TRTLLM_GUIDE_TYPES)}; got {guide_type[:40]!r}"
        )
    field, fixed = TRTLLM_GUIDE_TYPES[guide_type]
    if fixed is not None:
        return {field: fixed}
    if not guide:
        raise ValueError(
            f"guided_decoding_guide_type '{guide_type}' needs a 'guided_decoding_guide'"
        )
    return {field: guide}


def _string_input(inputs: Mapping[str, np.ndarray], name: str) -> Optional[str]:
    if name not in inputs:
        return None
    arr = np.asarray(inputs[name])
    if arr.dtype.kind not in "OSU" or arr.size != 1:
        raise ValueError(f"input '{name}' must be one string (BYTES)")
    value = arr.reshape(-1)[0]
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"input '{name}' is not valid UTF-8: {e}") from None
    return str(value)
