"""Relaying generations from Triton to an HTTP client: several generations as one stream of
steps (``merged``), a whole answer raced against the client's disconnect
(``unless_disconnected``), and an SSE response (``sse_response``) that cancels its generations
when the client leaves or stops reading.

Whatever way a request ends (finished, failed, client gone, client too slow), its Triton
calls are closed: unfinished ones cancelled (the engine aborts them and frees their blocks),
finished ones left to end (``triton_client.generate``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import Request
from fastapi.responses import StreamingResponse

from slipstream.server.openai.errors import OpenAIError
from slipstream.server.openai.triton_client import GenerateRequest, Step, TritonGenerator

log = logging.getLogger("slipstream.openai")

# A stream whose client has not taken a chunk for this long is abandoned (its request is
# cancelled): a client that never reads would otherwise hold its generation and buffers.
SEND_TIMEOUT_S = 30.0


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


async def merged(
    generator: TritonGenerator, requests: list[GenerateRequest]
) -> AsyncIterator[tuple[int, Step]]:
    """The steps of several generations (a completions request with a list of prompts) as
    they come, tagged with the request's position; the first error ends them all."""
    if len(requests) == 1:
        steps = generator.generate(requests[0])
        try:
            async for step in steps:
                yield 0, step
        finally:
            await steps.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, req: GenerateRequest) -> None:
        try:
            async for step in generator.generate(req):
                await queue.put((i, step))
        except BaseException as e:  # handed to the reader
            await queue.put((i, e))
            return
        await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(requests)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def peeked(stream: AsyncIterator) -> tuple[Any, AsyncIterator]:
    """The first item (errors raise here, before any response is sent) and the rest."""
    first = await stream.__anext__()

    async def rest():
        try:
            yield first
            async for item in stream:
                yield item
        finally:
            await stream.aclose()

    return first, rest()


_CLOSING: set = set()  # tasks closing abandoned generators (kept until done)


def close_later(pending: Optional[asyncio.Future], *gens) -> None:
    """Close async generators in a task of its own, once ``pending`` (a step of theirs) has
    ended: the caller may be a cancelled task, where an await would be cancelled again before
    the generators (and their Triton requests) are closed."""

    async def close() -> None:
        if pending is not None:
            await asyncio.gather(pending, return_exceptions=True)
        for gen in gens:
            with contextlib.suppress(Exception):
                await gen.aclose()

    task = asyncio.ensure_future(close())
    _CLOSING.add(task)
    task.add_done_callback(_CLOSING.discard)


async def wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work) -> Any:
    """Run ``work`` (a coroutine); if the client disconnects first, cancel it (which cancels
    its Triton requests) and raise ``ClientGone``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        finished, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in finished:
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise ClientGone()
    finally:
        watcher.cancel()
        if not task.done():  # this handler itself was cancelled: the work goes with it
            task.cancel()


def sse(payload: str) -> bytes:
    return f"data: {payload}\n\n".encode()


class SSEResponse(StreamingResponse):
    """A ``StreamingResponse`` that gives up on a client that stops reading: a chunk the
    connection has not taken within ``SEND_TIMEOUT_S`` ends the stream (the body's
    generations are cancelled as on a disconnect) instead of waiting for ever."""

    def __init__(self, content, send_timeout_s: float = SEND_TIMEOUT_S) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.send_timeout_s = send_timeout_s

    async def stream_response(self, send) -> None:
        async def timed(message) -> None:
            await asyncio.wait_for(send(message), self.send_timeout_s)

        try:
            await super().stream_response(timed)
        except asyncio.TimeoutError:
            log.warning(
                "OpenAI API: a streaming client took no data for %.0f s; its request is cancelled",
                self.send_timeout_s,
            )
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def sse_response(
    request: Request,
    steps: AsyncIterator,
    events: Callable[[AsyncIterator], AsyncIterator[str]],
    send_timeout_s: float = SEND_TIMEOUT_S,
) -> SSEResponse:
    """Start the generations (``steps``); an error before the first output is an HTTP error,
    later ones an SSE error event (its ``code`` the status a whole answer would have had).
    ``events`` maps the steps to SSE payloads."""
    try:
        _, steps = await peeked(steps)
    except StopAsyncIteration:
        raise OpenAIError(500, "the model returned nothing") from None

    async def body() -> AsyncIterator[bytes]:
        # Each payload is awaited in a task raced against the client's disconnect, so a
        # client that leaves while its request waits or decodes cancels it at once.
        gone = asyncio.ensure_future(wait_disconnect(request))
        payloads = events(steps).__aiter__()
        pending = None
        try:
            while True:
                pending = asyncio.ensure_future(payloads.__anext__())
                await asyncio.wait({pending, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not pending.done():
                    return  # the client is gone
                try:
                    payload = pending.result()
                except StopAsyncIteration:
                    break
                except OpenAIError as e:
                    yield sse(json.dumps(e.body()))
                    break
                yield sse(payload)
            yield b"data: [DONE]\n\n"
        finally:
            gone.cancel()
            if pending is not None and not pending.done():
                pending.cancel()  # cancels the Triton requests (triton_client.generate)
            close_later(pending, payloads, steps)

    return SSEResponse(body(), send_timeout_s)
