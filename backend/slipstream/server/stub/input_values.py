"""One input tensor's value, checked, with the error a client reads when it is wrong: the
readers the request parser and the interfaces built on the stub (``server/trtllm``) share.
Pure Python (no Triton)."""

from __future__ import annotations

from typing import Any

import numpy as np


class BadRequestError(ValueError):
    """The request is malformed; the message is meant for the client."""


def scalar(name: str, a: np.ndarray) -> Any:
    """The one element of an input tensor."""
    a = np.asarray(a)
    if a.size != 1:
        raise BadRequestError(
            f"input '{name}' must hold exactly one element, got shape {list(a.shape)}"
        )
    return a.reshape(-1)[0]


def int_value(name: str, arr: np.ndarray) -> int:
    if np.asarray(arr).dtype.kind not in "iu":
        raise BadRequestError(
            f"input '{name}' must be an integer tensor, got numpy dtype {np.asarray(arr).dtype}"
        )
    return int(scalar(name, arr))


def flag_value(name: str, arr: np.ndarray) -> bool:
    if np.asarray(arr).dtype.kind != "b":
        raise BadRequestError(
            f"input '{name}' must be BOOL, got numpy dtype {np.asarray(arr).dtype}"
        )
    return bool(scalar(name, arr))


def string_values(name: str, arr: np.ndarray) -> list[str]:
    """A STRING list; empty strings mean none (TensorRT-LLM's clients send ``[""]``)."""
    out = []
    for item in np.asarray(arr).reshape(-1):
        if isinstance(item, (bytes, np.bytes_)):
            try:
                item = bytes(item).decode("utf-8")
            except UnicodeDecodeError as e:
                raise BadRequestError(f"input '{name}' is not valid UTF-8: {e}") from None
        if not isinstance(item, str):
            raise BadRequestError(f"input '{name}' must be STRING")
        if item:
            out.append(item)
    return out
