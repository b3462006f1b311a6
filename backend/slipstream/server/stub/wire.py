"""Triton's response objects as the stub sends them: an error response with its code, a
response of output tensors, the FINAL flag. The one place beside the adapter that imports
``triton_python_backend_utils`` (it exists only inside the Python-backend stub)."""

from __future__ import annotations

import enum
from typing import Mapping, Optional

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
ERROR_PREFIX = "Error generating stream: "  # Triton vLLM backend's, which its clients match


class ErrorCode(enum.Enum):
    """The ``TritonError`` codes the stub answers with (the client sees their status)."""

    INVALID_ARG = "INVALID_ARG"  # the request is wrong
    UNAVAILABLE = "UNAVAILABLE"  # the server cannot take it now (overloaded, restarting, ...)


def error_response(message: str, code: Optional[ErrorCode] = None):
    """An error response; without a code, Triton's INTERNAL."""
    found = getattr(getattr(pb_utils, "TritonError", None), code.value, None) if code else None
    if found is None:
        error = pb_utils.TritonError(message)
    else:
        error = pb_utils.TritonError(message, found)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


def response(outputs: Mapping[str, np.ndarray]):
    return pb_utils.InferenceResponse(
        output_tensors=[pb_utils.Tensor(name, value) for name, value in outputs.items()]
    )


def send_final(sender, answer, logger) -> None:
    """The one final response of a request that ends here; a client already gone is
    logged, not raised."""
    try:
        sender.send(answer, flags=FINAL)
    except Exception as e:  # the client is gone: nothing to tell it
        logger.log_warn(f"slipstream: could not send an error response: {e}")
