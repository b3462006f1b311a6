"""What one HTTP client may take from the OpenAI frontend (``ApiSettings`` holds the values,
docs/openai_api.md lists them), so that a slow or hostile client holds neither a worker nor
the engine:

* **Headers**: at most ``max_header_bytes`` (past it 431), received within
  ``header_timeout_s`` (else the connection is closed): ``BoundedH11Protocol``.
* **Body**: at most ``max_body_bytes`` (413, before a byte of it is read when
  Content-Length says so) and received in full within ``body_timeout_s`` (408):
  ``BodyLimits``, which reads the body before the route does.
* **Streams**: a client that takes no data for ``send_timeout_s`` loses its stream
  (``relay.SSEResponse``).
* **Connections**: past ``max_connections`` open connections a new one is answered 503 and
  closed.

Every refusal is OpenAI's error object.
"""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus
from typing import Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from slipstream.server.openai.errors import error_body


def _json_error(status: int, message: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
    body = json.dumps(error_body(status, message)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    return headers, body


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers, and its protocol
    errors (a malformed request, headers past the limit) in OpenAI's error object."""

    header_timeout_s = 30.0
    max_header_bytes = 16 << 10
    max_connections = 1000

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer: Optional[asyncio.TimerHandle] = None
        self._head_bytes = 0  # of the request line and headers being received
        self._head_tail = b""  # their last bytes (the blank line may be cut between reads)
        if len(self.connections) > self.max_connections:
            self._refuse(503, "too many open connections; retry later")
            return
        self._arm()

    def _refuse(self, status: int, message: str) -> None:
        """Answer before (or instead of) reading a request, and close."""
        headers, body = _json_error(status, message)
        reason = HTTPStatus(status).phrase.encode()
        head = b"HTTP/1.1 %d %s\r\n" % (status, reason) + b"".join(
            k + b": " + v + b"\r\n" for k, v in headers
        )
        self.transport.write(head + b"\r\n" + body)
        self.transport.close()

    def _headers_too_large(self, data: bytes) -> bool:
        """Count the bytes of the request line and headers (h11's own limit applies only to
        what is still incomplete after a read, so one large read would pass it)."""
        seen = self._head_tail + data
        end = seen.find(b"\r\n\r\n")
        if end >= 0:
            size = self._head_bytes + end + 4 - len(self._head_tail)
            self._head_bytes, self._head_tail = 0, b""
            return size > self.max_header_bytes
        self._head_bytes += len(data)
        self._head_tail = seen[-3:]
        return self._head_bytes > self.max_header_bytes

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._headers_too_large(data):
            self._refuse(431, f"request headers are larger than {self.max_header_bytes} bytes")
            return
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:
            self._arm()  # a request has begun (or may): its headers are on the clock
        else:
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is None and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _too_slow(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE:  # still no complete request line and headers
            self.logger.warning(
                "OpenAI API: request headers not received within %.0f s; connection closed",
                self.header_timeout_s,
            )
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        headers, body = _json_error(400, f"invalid HTTP request: {msg}")
        response = h11.Response(status_code=400, headers=headers, reason=b"Bad Request")
        self.transport.write(self.conn.send(response))
        self.transport.write(self.conn.send(h11.Data(data=body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.transport.close()


def bounded_h11(
    header_timeout_s: float, max_header_bytes: int, max_connections: int
) -> type[BoundedH11Protocol]:
    limits = {
        "header_timeout_s": header_timeout_s,
        "max_header_bytes": max_header_bytes,
        "max_connections": max_connections,
    }
    return type("BoundedH11", (BoundedH11Protocol,), limits)


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class BodyLimits:
    """ASGI middleware: the request body is read here, bounded in size and time, and handed
    to the application whole; later messages (the disconnect) pass through."""

    def __init__(self, app, max_body_bytes: int, body_timeout_s: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read(scope, receive)
        except _Refused as e:
            headers, payload = _json_error(e.status, e.message)
            await send({"type": "http.response.start", "status": e.status, "headers": headers})
            await send({"type": "http.response.body", "body": payload})
            return
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, scope, receive) -> bytes:
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _Refused(413, self._too_large())
        try:
            return await asyncio.wait_for(self._chunks(receive), self.body_timeout_s)
        except asyncio.TimeoutError:
            raise _Refused(
                408, f"the request body was not received within {self.body_timeout_s:g} s"
            ) from None

    async def _chunks(self, receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Refused(400, "the client disconnected while sending the body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _Refused(413, self._too_large())
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self) -> str:
        return f"the request body is larger than the limit of {self.max_body_bytes} bytes"
