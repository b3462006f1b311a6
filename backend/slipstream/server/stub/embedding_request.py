"""vllm_backend's pooling request: the ``embedding_request`` input, a JSON object
``{"input": text or token ids, "pooling_params": {...}}`` (what Triton's OpenAI frontend
sends for ``/v1/embeddings``), answered with one response whose ``text_output`` is the
vector as a JSON list, ``num_input_tokens`` the prompt's tokens and ``num_output_tokens`` 0
(each when its ``return_*`` flag asks). ``text_input``, which the model config requires,
is not read. Pure Python (no Triton import).

``pooling_params`` takes vLLM's ``pooling_type`` (``LAST``, the default for decoder models,
``MEAN``, ``CLS``) and ``normalize`` (default true); ``dimensions`` is refused. Beside it,
vLLM's ``truncate_prompt_tokens`` and ``add_special_tokens`` (default true).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import numpy as np

from slipstream.core.pooling_params import PoolingParams
from slipstream.server.stub.request_parser import MAX_JSON_BYTES, BadRequestError

INPUT = "embedding_request"
REQUEST_KEYS = {"input", "pooling_params", "truncate_prompt_tokens", "add_special_tokens"}


@dataclass(frozen=True)
class EmbeddingRequest:
    prompt: Union[str, list[int]]
    params: PoolingParams
    add_special_tokens: bool = True
    truncate_prompt_tokens: Optional[int] = None
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False


def _flag(inputs: Mapping[str, np.ndarray], name: str) -> bool:
    value = inputs.get(name)
    return bool(np.asarray(value).reshape(-1)[0]) if value is not None else False


def _body(inputs: Mapping[str, np.ndarray]) -> dict[str, Any]:
    raw = np.asarray(inputs[INPUT]).reshape(-1)
    if raw.size != 1:
        raise BadRequestError(f"input '{INPUT}' must hold one JSON object")
    value = raw[0]
    if isinstance(value, bytes):
        if len(value) > MAX_JSON_BYTES:
            raise BadRequestError(f"input '{INPUT}' is larger than {MAX_JSON_BYTES} bytes")
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise BadRequestError(f"input '{INPUT}' is not valid UTF-8") from None
    try:
        body = json.loads(value)
    except (ValueError, RecursionError):
        raise BadRequestError(f"input '{INPUT}' is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequestError(f"input '{INPUT}' must be a JSON object")
    unknown = set(body) - REQUEST_KEYS
    if unknown:
        raise BadRequestError(f"input '{INPUT}': unknown keys {sorted(unknown)}")
    return body


def _prompt(value: Any) -> Union[str, list[int]]:
    if isinstance(value, str):
        if not value:
            raise BadRequestError("the input is empty")
        return value
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        return list(value)
    raise BadRequestError("'input' must be a non-empty string or a list of token ids")


def parse_embedding_request(inputs: Mapping[str, np.ndarray], model_name: str) -> EmbeddingRequest:
    body = _body(inputs)
    if "input" not in body:
        raise BadRequestError(f"input '{INPUT}' has no 'input'")
    pooling = body.get("pooling_params") or {}
    if not isinstance(pooling, dict):
        raise BadRequestError("'pooling_params' must be a JSON object")
    try:
        params = PoolingParams.from_dict(pooling, model_name)
    except ValueError as e:
        raise BadRequestError(str(e)) from None
    truncate = body.get("truncate_prompt_tokens")
    if truncate is not None and (
        not isinstance(truncate, int)
        or isinstance(truncate, bool)
        or truncate < -1
        or truncate == 0
    ):
        raise BadRequestError(f"truncate_prompt_tokens must be -1 or >= 1, got {truncate!r}")
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise BadRequestError(f"add_special_tokens must be a boolean, got {special!r}")
    return EmbeddingRequest(
        _prompt(body["input"]),
        params,
        special,
        truncate,
        _flag(inputs, "return_num_input_tokens"),
        _flag(inputs, "return_num_output_tokens"),
    )


class EmbeddingResponses:
    """The one response of a pooling request (the stub's response-builder interface)."""

    def __init__(self, request: EmbeddingRequest) -> None:
        self.request = request

    def streamed(self, out) -> None:
        """Never asked: a pooling request is answered once, at its end (not streaming)."""
        return None

    def absorb(self, out) -> None:
        """Nothing comes before the finished output."""

    def finals(self, out) -> list[dict]:
        vector = json.dumps(out.embedding or [])
        outputs: dict[str, np.ndarray] = {
            "text_output": np.array([vector.encode()], dtype=np.object_)
        }
        if self.request.return_num_input_tokens:
            outputs["num_input_tokens"] = np.asarray(out.num_prompt_tokens, dtype=np.uint32)
        if self.request.return_num_output_tokens:
            outputs["num_output_tokens"] = np.asarray([0], dtype=np.uint32)
        return [outputs]
