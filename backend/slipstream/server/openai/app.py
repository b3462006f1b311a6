"""The OpenAI-compatible HTTP API (FastAPI): ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (SSE streaming), ``/health`` and ``/metrics``, behaving as vLLM's OpenAI
server does towards clients and routers. Every generation goes through Triton
(``triton_client``); a client that disconnects cancels its request there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import urllib.request
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from openai.types import Model
from starlette.exceptions import HTTPException as StarletteHTTPException

from slipstream.server.openai import responses as out
from slipstream.server.openai.errors import OpenAIError, bad_request, error_body, unknown_model
from slipstream.server.openai.requests import ChatCompletionRequest, CompletionRequest
from slipstream.server.openai.served_models import ModelTable, Target
from slipstream.server.openai.triton_client import GenerateRequest, Step, TritonGenerator

OWNER = "slipstream"
log = logging.getLogger("slipstream.openai")


class _ClientGone(Exception):
    pass


def _error(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers())


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if err.get("type") == "extra_forbidden":
            parts.append(f"unknown field '{where}' (not supported)")
        else:
            parts.append(f"{where}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request"


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


async def _peeked(stream: AsyncIterator) -> tuple[Any, AsyncIterator]:
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


def _close_later(pending: Optional[asyncio.Future], *gens) -> None:
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


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work) -> Any:
    """Run ``work`` (a coroutine); if the client disconnects first, cancel it (which cancels
    its Triton requests) and raise ``_ClientGone``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        finished, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in finished:
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise _ClientGone()
    finally:
        watcher.cancel()


def _check_context(target: Target, prompts: list[str], sampling: dict) -> None:
    """vLLM's refusal of a ``max_tokens`` that cannot fit beside the prompt in the model's
    context (the engine would stop at the context silently). Prompts are tokenized only
    when they could be long enough to matter (a token is at least one byte)."""
    max_tokens, limit = sampling["max_tokens"], target.model.max_model_len
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        return  # the engine names the bad value
    special = bool(sampling.get("add_special_tokens", True))
    keep = sampling.get("truncate_prompt_tokens")
    for prompt in prompts:
        if max_tokens + len(prompt.encode()) + 8 <= limit:
            continue
        num_input = len(target.model.tokenizer(prompt, add_special_tokens=special)["input_ids"])
        if isinstance(keep, int) and not isinstance(keep, bool) and keep > 0:
            num_input = min(num_input, keep)
        if max_tokens > limit - num_input:
            raise bad_request(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                f"model's maximum context length is {limit} tokens and your request has "
                f"{num_input} input tokens ({max_tokens} > {limit} - {num_input}).",
                "max_tokens",
            )


def _sse(payload: str) -> bytes:
    return f"data: {payload}\n\n".encode()


class OpenAIApp:
    """Owns the model table and the Triton connection; ``app`` is the ASGI application."""

    def __init__(self, table: ModelTable, grpc_url: str, metrics_url: Optional[str] = None) -> None:
        self.table = table
        self.generator = TritonGenerator(grpc_url)
        self.metrics_url = metrics_url
        self.app = self._build()

    # ------------------------------------------------------------------ routes
    def _build(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            yield
            await self.generator.close()

        app = FastAPI(title="Slipstream OpenAI-compatible API", lifespan=lifespan)

        @app.exception_handler(OpenAIError)
        async def openai_error(request, exc: OpenAIError):
            return _error(exc)

        @app.exception_handler(RequestValidationError)
        async def invalid(request, exc: RequestValidationError):
            return JSONResponse(error_body(400, _validation_message(exc)), status_code=400)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request, exc: StarletteHTTPException):
            # FastAPI's own: a body that does not parse (too deep, not UTF-8), an unknown
            # route or method; in OpenAI's error object like every other error
            message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
            return JSONResponse(
                error_body(exc.status_code, message),
                status_code=exc.status_code,
                headers=getattr(exc, "headers", None),
            )

        @app.exception_handler(Exception)
        async def internal(request, exc: Exception):
            log.error("OpenAI API: %s %s failed", request.method, request.url.path, exc_info=exc)
            return JSONResponse(
                error_body(500, f"internal error: {type(exc).__name__}: {exc}"), status_code=500
            )

        app.get("/health")(self.health)
        app.get("/v1/models")(self.list_models)
        app.get("/v1/models/{model_id:path}")(self.get_model)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)
        app.post("/v1/completions/render")(self.render_completion)
        app.post("/v1/chat/completions/render")(self.render_chat)
        app.get("/metrics")(self.metrics)
        return app

    async def health(self) -> Response:
        problem = await self.generator.problem([m.name for m in self.table.models])
        if problem is not None:
            return JSONResponse(error_body(503, problem), status_code=503)
        return Response(status_code=200)

    def _model_card(self, target: Target) -> dict:
        card = Model(id=target.id, object="model", created=target.model.created, owned_by=OWNER)
        body = card.model_dump(exclude_unset=True)
        # vLLM's extra fields, read by routers and benchmark clients
        body.update(
            root=target.model.name,
            parent=target.model.name if target.lora_name else None,
            max_model_len=target.model.max_model_len,
        )
        return body

    async def list_models(self) -> dict:
        return {"object": "list", "data": [self._model_card(t) for t in self.table.targets()]}

    async def get_model(self, model_id: str) -> dict:
        target = self.table.resolve(model_id)
        if target is None:
            raise unknown_model(model_id)
        return self._model_card(target)

    async def metrics(self) -> Response:
        """Triton's metrics (the model's vllm:* series included) on this port too, where vLLM
        serves them."""
        if not self.metrics_url:
            return JSONResponse(error_body(404, "metrics are not enabled"), status_code=404)

        url = self.metrics_url

        def scrape() -> str:
            with urllib.request.urlopen(url, timeout=10) as r:
                return r.read().decode()

        try:
            text = await asyncio.to_thread(scrape)
        except OSError as e:
            return JSONResponse(
                error_body(503, f"Triton metrics unavailable: {e}"), status_code=503
            )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    # ------------------------------------------------------------------ generation
    def _target(self, name: str) -> Target:
        target = self.table.resolve(name)
        if target is None:
            raise unknown_model(name)
        return target

    async def _requests(
        self,
        target: Target,
        prompts: list[str],
        sampling: dict,
        n: int,
        top_logprobs: Optional[int],
    ) -> list[GenerateRequest]:
        sampling = dict(sampling)
        if "max_tokens" in sampling:
            await asyncio.to_thread(_check_context, target, prompts, sampling)
        # vLLM's default budget: up to max_model_len (the engine stops there with "length")
        sampling.setdefault("max_tokens", target.model.max_model_len)
        if target.lora_name is not None:
            sampling["lora_name"] = target.lora_name
        return [GenerateRequest(target.model.name, p, sampling, n, top_logprobs) for p in prompts]

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        body.check()
        target = self._target(body.model)
        prompts = body.prompts()
        n = body.n or 1
        reqs = await self._requests(target, prompts, body.sampling_parameters(), n, body.logprobs)
        rid = out.new_id("cmpl")
        if body.stream:
            return await self._stream(
                request, reqs, self._completion_events(rid, target.id, body, prompts, n)
            )
        answer = await self._answer(request, reqs, n)
        if answer is None:
            return Response(status_code=499)
        if body.echo:
            for index, choice in answer.choices.items():
                choice.text = prompts[index // n] + choice.text
        return JSONResponse(
            json.loads(out.dump(out.completion(rid, target.id, answer, body.logprobs is not None)))
        )

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        body.check()
        target = self._target(body.model)
        prompt = await asyncio.to_thread(self._render, target, body)
        n = body.n or 1
        top = (body.top_logprobs or 0) if body.logprobs else None
        reqs = await self._requests(target, [prompt], body.sampling_parameters(), n, top)
        rid = out.new_id("chatcmpl")
        if body.stream:
            return await self._stream(request, reqs, self._chat_events(rid, target.id, body, n))
        answer = await self._answer(request, reqs, n)
        if answer is None:
            return Response(status_code=499)
        return JSONResponse(
            json.loads(out.dump(out.chat_completion(rid, target.id, answer, bool(body.logprobs))))
        )

    async def _answer(
        self, request: Request, reqs: list[GenerateRequest], n: int
    ) -> Optional[out.Answer]:
        """Every choice of a non-streamed request, or None if the client left first (its
        generations are cancelled)."""
        answer = out.Answer()

        async def collect() -> None:
            async for i, step in merged(self.generator, reqs):
                self._absorb(answer, i, n, step)

        try:
            await _unless_disconnected(request, collect())
        except _ClientGone:
            return None
        return answer

    # ------------------------------------------------------------------ render (vLLM's)
    # KV-aware routers (vllm-router's kv_aware) ask a worker for a request's prompt tokens
    # here and match them against the blocks its KV events announced: the ids are the ones
    # the engine will see for the same request.
    async def render_chat(self, body: ChatCompletionRequest) -> dict[str, Any]:
        body.check()
        target = self._target(body.model)
        prompt = await asyncio.to_thread(self._render, target, body)
        # chat prompts carry their special tokens in the template (add_special_tokens off)
        ids = target.model.tokenizer(prompt, add_special_tokens=bool(body.add_special_tokens))
        return {"request_id": out.new_id("render"), "token_ids": ids["input_ids"]}

    async def render_completion(self, body: CompletionRequest) -> list[dict[str, Any]]:
        body.check()
        target = self._target(body.model)
        special = True if body.add_special_tokens is None else body.add_special_tokens
        return [
            {
                "request_id": out.new_id("render"),
                "token_ids": target.model.tokenizer(p, add_special_tokens=special)["input_ids"],
            }
            for p in body.prompts()
        ]

    @staticmethod
    def _render(target: Target, body: ChatCompletionRequest) -> str:
        tokenizer = target.model.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise OpenAIError(
                400, f"model {target.model.name} has no chat template; use /v1/completions"
            )
        try:
            return tokenizer.apply_chat_template(
                body.conversation(),
                tokenize=False,
                add_generation_prompt=bool(body.add_generation_prompt),
                continue_final_message=bool(body.continue_final_message),
                **(body.chat_template_kwargs or {}),
            )
        except OpenAIError:
            raise
        except Exception as e:  # the template itself refused the conversation
            raise OpenAIError(
                400, f"the chat template cannot render these messages: {e}", "messages"
            ) from None

    @staticmethod
    def _absorb(answer: out.Answer, i: int, n: int, step: Step) -> None:
        if step.sequences and not any(c // n == i for c in answer.choices):
            answer.prompt_tokens += step.num_input_tokens
        for delta in step.sequences:
            answer.add(i * n + delta.index, delta)

    async def _stream(self, request: Request, reqs: list[GenerateRequest], events) -> Response:
        """Start the generations; an error before the first output is an HTTP error, later
        ones an SSE error event. ``events`` maps the steps to SSE payloads."""
        steps = merged(self.generator, reqs)
        try:
            _, steps = await _peeked(steps)
        except StopAsyncIteration:
            raise OpenAIError(500, "the model returned nothing") from None

        async def body() -> AsyncIterator[bytes]:
            # Each payload is awaited in a task raced against the client's disconnect, so a
            # client that leaves while its request waits or decodes cancels it at once.
            gone = asyncio.ensure_future(_wait_disconnect(request))
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
                        yield _sse(json.dumps(e.body()))
                        break
                    yield _sse(payload)
                yield b"data: [DONE]\n\n"
            finally:
                gone.cancel()
                if pending is not None and not pending.done():
                    pending.cancel()  # cancels the Triton requests (triton_client.generate)
                _close_later(pending, payloads, steps)

        return StreamingResponse(body(), media_type="text/event-stream")

    def _completion_events(
        self, rid: str, model: str, body: CompletionRequest, prompts: list[str], n: int
    ):
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)

        async def events(steps) -> AsyncIterator[str]:
            answer = out.Answer()
            started: set[int] = set()
            for_offsets: dict[int, int] = {}
            async for i, step in steps:
                self._absorb(answer, i, n, step)
                for delta in step.sequences:
                    index = i * n + delta.index
                    text = delta.text
                    if body.echo and index not in started:
                        text = prompts[i] + text
                    started.add(index)
                    logprobs = None
                    if body.logprobs is not None:
                        logprobs = out.completion_logprobs(
                            delta.logprobs or [], for_offsets.get(index, 0)
                        )
                    for_offsets[index] = for_offsets.get(index, 0) + len(delta.text)
                    yield out.dump(
                        out.completion_chunk(
                            rid,
                            model,
                            index,
                            text,
                            delta.finish_reason,
                            logprobs,
                            answer.usage() if continuous else None,
                        )
                    )
            if include_usage:
                yield out.dump(out.completion_usage_chunk(rid, model, answer.usage()))

        return events

    def _chat_events(self, rid: str, model: str, body: ChatCompletionRequest, n: int):
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)

        async def events(steps) -> AsyncIterator[str]:
            answer = out.Answer()
            for index in range(n):  # vLLM's first chunk per choice: the role
                yield out.dump(
                    out.chat_chunk(rid, model, index, role="assistant", content="", logprobs=None)
                )
            async for i, step in steps:
                self._absorb(answer, i, n, step)
                for delta in step.sequences:
                    yield out.dump(
                        out.chat_chunk(
                            rid,
                            model,
                            delta.index,
                            content=delta.text,
                            reason=delta.finish_reason,
                            logprobs=(delta.logprobs or []) if body.logprobs else None,
                            usage=answer.usage() if continuous else None,
                        )
                    )
            if include_usage:
                yield out.dump(out.chat_usage_chunk(rid, model, answer.usage()))

        return events


def build_app(table: ModelTable, grpc_url: str, metrics_url: Optional[str] = None) -> FastAPI:
    return OpenAIApp(table, grpc_url, metrics_url).app
