"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status
vLLM's OpenAI server gives, and the status of an error the model sent back through Triton.

Triton's gRPC stream carries a model's error as text only (no code), so the texts the
Slipstream adapter writes are matched here: a full queue is 429 (vLLM's clients and routers
retry it elsewhere), an engine that cannot serve (dead, restarting, shutting down, unloaded)
503, the adapter's internal errors 500, everything else the request's fault: 400.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from http import HTTPStatus
from typing import Optional

# (pattern, status), first match wins; patterns are the adapter's and Triton's own texts.
TRITON_ERROR_STATUS: list[tuple[re.Pattern, int]] = [
    (re.compile(r"overloaded|queue is full|exceeds maximum queue size|retry later", re.I), 429),
    (
        re.compile(
            r"unhealthy|not serving|shutting down|is not ready|unknown model|"
            r"unavailable|server is stopping|failed to connect",
            re.I,
        ),
        503,
    ),
    (re.compile(r"internal error", re.I), 500),
]
ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


@dataclass
class OpenAIError(Exception):
    status: int
    message: str
    param: Optional[str] = None

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: Optional[str] = None) -> dict:
    """vLLM's shape: the message, a type named for the status, the status as code."""
    kind = ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def status_of_triton_error(message: str) -> int:
    for pattern, status in TRITON_ERROR_STATUS:
        if pattern.search(message):
            return status
    return 400


def from_triton(message: str) -> OpenAIError:
    """A model's error through Triton, without the adapter's vLLM-compatible prefix."""
    text = message.removeprefix("Error generating stream: ")
    return OpenAIError(status_of_triton_error(message), text)


def bad_request(message: str, param: Optional[str] = None) -> OpenAIError:
    return OpenAIError(400, message, param)


def unknown_model(name: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{name}` does not exist.", "model")
