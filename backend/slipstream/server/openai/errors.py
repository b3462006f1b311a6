"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status
by cause, so that routers and SDKs (which retry 5xx, 408 and 429, never 400) act on it.

Triton's gRPC stream carries a model's error as text only (its status code stays behind), so
the cause of an error from Triton is read from the text: every text the engine, the stub and
Triton itself write for a failure that is not the client's is in ``TRITON_ERROR_CAUSES``,
taken from the constants that produce it where the engine owns them. Anything else is the
request's fault (the adapter's INVALID_ARG texts): 400.

| cause | status | ``Retry-After`` |
| --- | --- | --- |
| the client's request | 400 | |
| a full queue (the engine's ``max_queue_size`` or Triton's) | 429 | ``RETRY_AFTER_S`` |
| the engine failed, hung or restarts | 503 | ``ENGINE_RETRY_AFTER_S``: the supervisor restarts it |
| the server or model is going away (shutting down, unloaded) | 503 | (retry elsewhere) |
| the server's ``max_request_seconds`` ended it | 504 | |
| the request's own timeout ended it | 408 | |
| an internal error | 500 | |
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from typing import Optional

from slipstream.engine.admission import OVERLOADED, RETRY_AFTER_S
from slipstream.engine.health import ENGINE_FAILED, ENGINE_NOT_SERVING, SHUTTING_DOWN
from slipstream.server.stub.health import UNHEALTHY_MESSAGE

# A restarted engine serves again after a model load (seconds on CPU for the embedded
# model): what a client is told to wait before it retries a failed or restarting engine.
ENGINE_RETRY_AFTER_S = 5


@dataclass(frozen=True)
class Cause:
    """Why a request failed, as a client can act on it."""

    status: int
    retry_after_s: Optional[int] = None  # a Retry-After header where a retry here can succeed


CLIENT = Cause(400)
OVERLOADED_QUEUE = Cause(429, RETRY_AFTER_S)
ENGINE_DOWN = Cause(503, ENGINE_RETRY_AFTER_S)
GOING_AWAY = Cause(503)
SERVER_DEADLINE = Cause(504)
REQUEST_DEADLINE = Cause(408)
INTERNAL = Cause(500)

# (text the message contains, case-insensitive; its cause), first match wins. The texts are
# the engine's constants and the stub's and Triton's own words.
TRITON_ERROR_CAUSES: tuple[tuple[str, Cause], ...] = (
    (OVERLOADED, OVERLOADED_QUEUE),  # engine admission: "server overloaded: ..."
    ("exceeds maximum queue size", OVERLOADED_QUEUE),  # Triton's queue; the TRT-LLM text
    (ENGINE_FAILED, ENGINE_DOWN),  # crash, hung step (watchdog), failing steps
    (ENGINE_NOT_SERVING, ENGINE_DOWN),  # dead or restarting: refused at once
    (SHUTTING_DOWN, GOING_AWAY),  # the engine loop closing
    ("shutting down", GOING_AWAY),  # the stub's drain: "request aborted: ... shutting down"
    (UNHEALTHY_MESSAGE, GOING_AWAY),  # ENABLE_VLLM_HEALTH_CHECK: the model is unloaded
    ("unknown model", GOING_AWAY),  # Triton: the model was unloaded (the frontend knew it)
    ("is not ready", GOING_AWAY),  # Triton: the model or server is not ready
    ("server is stopping", GOING_AWAY),
    ("past max_request_seconds", SERVER_DEADLINE),  # stub/deadlines.py's Deadline.message
    ("request timed out", REQUEST_DEADLINE),  # the request's own timeout
    ("internal error", INTERNAL),  # a step or a request's own rows raised
    ("detokenization failed", INTERNAL),
)
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


@dataclass
class OpenAIError(Exception):
    status: int
    message: str
    param: Optional[str] = None
    retry_after_s: Optional[int] = None

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}


def error_body(status: int, message: str, param: Optional[str] = None) -> dict:
    """vLLM's shape: the message, a type named for the status, the status as code."""
    kind = ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def cause_of_triton_error(message: str) -> Cause:
    text = message.casefold()
    for needle, cause in TRITON_ERROR_CAUSES:
        if needle.casefold() in text:
            return cause
    return CLIENT


def status_of_triton_error(message: str) -> int:
    return cause_of_triton_error(message).status


def from_triton(message: str) -> OpenAIError:
    """A model's error through Triton, without the adapter's vLLM-compatible prefix."""
    cause = cause_of_triton_error(message)
    text = message.removeprefix("Error generating stream: ")
    return OpenAIError(cause.status, text, retry_after_s=cause.retry_after_s)


def bad_request(message: str, param: Optional[str] = None) -> OpenAIError:
    return OpenAIError(400, message, param)


def unknown_model(name: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{name}` does not exist.", "model")
