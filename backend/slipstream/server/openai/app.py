"""The OpenAI-compatible HTTP API (FastAPI), behaving as vLLM's OpenAI server does towards
clients and routers: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (SSE
streaming, tool calls, reasoning), ``/v1/embeddings``, vLLM's render, ``/tokenize`` and
``/detokenize`` routes, ``/health``, ``/health/ready`` and ``/metrics``. Every generation and
pooling request goes through Triton (``triton_client``); a client that disconnects cancels
its request there (``relay``). ``api_keys`` and ``http_limits`` wrap the application.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import urllib.request
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from openai.types import Model
from starlette.exceptions import HTTPException as StarletteHTTPException

from slipstream.server.openai import responses as out
from slipstream.server.openai.api_keys import ApiKeyGuard
from slipstream.server.openai.api_settings import ApiSettings
from slipstream.server.openai.chat_output import ChatOutput
from slipstream.server.openai.chat_render import render_chat
from slipstream.server.openai.embeddings import EmbeddingRequest, create_embeddings
from slipstream.server.openai.errors import OpenAIError, bad_request, error_body, unknown_model
from slipstream.server.openai.http_limits import BodyLimits
from slipstream.server.openai.relay import ClientGone, merged, sse_response, unless_disconnected
from slipstream.server.openai.requests import (
    STRUCTURED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
)
from slipstream.server.openai.served_models import ModelTable, Target
from slipstream.server.openai.tokenization import (
    CHAT_FIELDS,
    DetokenizeRequest,
    TokenizeRequest,
    detokenize,
    tokenize,
)
from slipstream.server.openai.tool_calls import ToolRequest, tool_request
from slipstream.server.openai.triton_client import GenerateRequest, Step, TritonGenerator

OWNER = "slipstream"
log = logging.getLogger("slipstream.openai")


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


def _check_context(target: Target, prompts: list[str], sampling: dict) -> None:
    """vLLM's refusal of a ``max_tokens`` that cannot fit beside the prompt in the model's
    context (the engine would stop at the context silently). Prompts are tokenized only
    when they could be long enough to matter (a token is at least one byte)."""
    max_tokens, limit = sampling["max_tokens"], target.model.max_model_len
    special = bool(sampling.get("add_special_tokens", True))
    keep = sampling.get("truncate_prompt_tokens")
    for prompt in _may_overflow(target, prompts, sampling):
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


def _may_overflow(target: Target, prompts: list[str], sampling: dict) -> list[str]:
    """The prompts that could leave too little room for ``max_tokens`` (a token is at least
    one byte): the others need no tokenizing."""
    max_tokens = sampling.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        return []  # the engine names a bad value
    room = target.model.max_model_len - max_tokens - 8  # 8: special tokens the tokenizer adds
    return [p for p in prompts if len(p.encode()) > room]


def _constrain_to_tools(sampling: dict, tools: Optional[ToolRequest]) -> None:
    """A required or named tool choice: the output is held to its JSON schema."""
    if tools is None or not tools.constrained:
        return
    taken = [name for name in STRUCTURED_FIELDS if sampling.get(name)]
    if taken:
        raise bad_request(
            f"tool_choice {tools.choice.value!r} constrains the output to tool calls; it "
            f"cannot be combined with {taken[0]}",
            "tool_choice",
        )
    sampling["structured_outputs"] = {"json": tools.schema()}


class OpenAIApp:
    """Owns the model table and the Triton connection; ``asgi`` is what uvicorn serves (the
    FastAPI ``app`` inside the API-key guard and the body limits)."""

    def __init__(
        self,
        table: ModelTable,
        grpc_url: str,
        metrics_url: Optional[str] = None,
        settings: Optional[ApiSettings] = None,
        pooling: Optional[dict[str, Any]] = None,
    ) -> None:
        self.table = table
        self.generator = TritonGenerator(grpc_url)
        self.metrics_url = metrics_url
        self.settings = settings or ApiSettings()
        self.pooling = dict(pooling or {})  # --pooler-config: embedding_request's defaults
        self.parser = self.settings.parser()
        self.reasoning = self.settings.reasoning()
        self.loop: Optional[asyncio.AbstractEventLoop] = None  # once serving (for tests)
        self.app = self._build()
        limited = BodyLimits(self.app, self.settings.max_body_bytes, self.settings.body_timeout_s)
        self.asgi = ApiKeyGuard(limited, self.settings.api_keys)

    # ------------------------------------------------------------------ routes
    def _build(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            self.loop = asyncio.get_running_loop()
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

        for method, path, handler in self._routes():
            app.add_api_route(path, handler, methods=[method])
        return app

    def _routes(self) -> list[tuple[str, str, Callable[..., Any]]]:
        """(method, path, handler) of every route, as vLLM serves them."""
        gets: dict[str, Callable[..., Any]] = {
            "/health": self.health,
            "/health/ready": self.health,
            "/v1/models": self.list_models,
            "/v1/models/{model_id:path}": self.get_model,
            "/metrics": self.metrics,
        }
        routes = [("GET", path, handler) for path, handler in gets.items()]
        for path, generate, render in (
            ("/v1/completions", self.completions, self.render_completion),
            ("/v1/chat/completions", self.chat_completions, self.render_chat),
        ):
            routes += [("POST", path, generate), ("POST", f"{path}/render", render)]
        for path, handler in (
            ("/v1/embeddings", self.embeddings),
            ("/tokenize", self.tokenize),
            ("/detokenize", self.detokenize),
        ):
            routes.append(("POST", path, handler))
        return routes

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
            parent=target.model.openai_id if target.lora_name else None,
            max_model_len=target.model.max_model_len,
        )
        return body

    async def list_models(self) -> dict:
        return {"object": "list", "data": [self._model_card(t) for t in self.table.targets()]}

    async def get_model(self, model_id: str) -> dict:
        return self._model_card(self._target(model_id))

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
    def _target(self, name: Optional[str]) -> Target:
        if name is None and len(self.table.models) == 1:  # vLLM: one model, name optional
            return self.table.resolve(self.table.models[0].openai_id)  # type: ignore[return-value]
        target = self.table.resolve(name) if name is not None else None
        if target is None:
            raise unknown_model(str(name))
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
        if _may_overflow(target, prompts, sampling):
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

        def completion(answer: out.Answer) -> Any:
            if body.echo:
                for index, choice in answer.choices.items():
                    choice.text = prompts[index // n] + choice.text
            return out.completion(rid, target.id, answer, body.logprobs is not None)

        events = self._completion_events(rid, target.id, body, prompts, n) if body.stream else None
        return await self._reply(request, reqs, n, events, completion)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        target, tools = self._chat_target(body)
        sampling = body.sampling_parameters()
        _constrain_to_tools(sampling, tools)
        prompt = await asyncio.to_thread(render_chat, target, body, tools, self.parser)
        n = body.n or 1
        top = (body.top_logprobs or 0) if body.logprobs else None
        reqs = await self._requests(target, [prompt], sampling, n, top)
        output = ChatOutput(self.reasoning, tools, self.parser, body.include_reasoning is not False)
        rid = out.new_id("chatcmpl")
        events = self._chat_events(rid, target.id, body, n, output) if body.stream else None
        return await self._reply(
            request,
            reqs,
            n,
            events,
            lambda answer: out.chat_completion(rid, target.id, answer, bool(body.logprobs), output),
        )

    def _chat_target(self, body: ChatCompletionRequest) -> tuple[Target, Optional[ToolRequest]]:
        """A chat request checked: the model it names and the tools it offers (a chat
        completion and its rendering read both alike)."""
        body.check()
        target = self._target(body.model)
        tools = tool_request(
            body.tools,
            body.tool_choice,
            body.parallel_tool_calls,
            self.settings.enable_auto_tool_choice,
        )
        return target, tools

    async def _reply(
        self,
        request: Request,
        reqs: list[GenerateRequest],
        n: int,
        events: Optional[Callable[[AsyncIterator], AsyncIterator[str]]],
        document: Callable[[out.Answer], Any],
    ) -> Response:
        """A completion's reply, either kind: the stream of ``events`` where given (the
        request streams), else ``document(answer)`` as JSON once every choice is in (499
        where the client left first)."""
        if events is not None:
            return await sse_response(
                request, merged(self.generator, reqs), events, self.settings.send_timeout_s
            )
        answer = await self._answer(request, reqs, n)
        if answer is None:
            return Response(status_code=499)
        return JSONResponse(json.loads(out.dump(document(answer))))

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
            await unless_disconnected(request, collect())
        except ClientGone:
            return None
        return answer

    async def embeddings(self, body: EmbeddingRequest, request: Request) -> Response:
        target = self._target(body.model)
        try:
            answer = await unless_disconnected(
                request, create_embeddings(self.generator, target, body, self.pooling)
            )
        except ClientGone:
            return Response(status_code=499)
        return JSONResponse(answer)

    # ------------------------------------------------------------------ render (vLLM's)
    # KV-aware routers (vllm-router's kv_aware) ask a worker for a request's prompt tokens
    # here and match them against the blocks its KV events announced: the ids are the ones
    # the engine will see for the same request.
    async def render_chat(self, body: ChatCompletionRequest) -> dict[str, Any]:
        target, tools = self._chat_target(body)
        prompt = await asyncio.to_thread(render_chat, target, body, tools, self.parser)
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

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        body.check()
        target = self._target(body.model)
        if body.messages is None:
            text = body.prompt or ""
        else:
            chat = ChatCompletionRequest(model=target.id, **body.model_dump(include=CHAT_FIELDS))
            chat.check()
            tools = tool_request(chat.tools, "none" if chat.tools else None, None, False)
            text = await asyncio.to_thread(render_chat, target, chat, tools, self.parser)
        return await asyncio.to_thread(tokenize, target, body, text)

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        target = self._target(body.model)
        return await asyncio.to_thread(detokenize, target, body)

    @staticmethod
    def _absorb(answer: out.Answer, i: int, n: int, step: Step) -> None:
        if step.sequences and not any(c // n == i for c in answer.choices):
            answer.prompt_tokens += step.num_input_tokens
        for delta in step.sequences:
            answer.add(i * n + delta.index, delta)

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

    def _chat_events(
        self, rid: str, model: str, body: ChatCompletionRequest, n: int, output: ChatOutput
    ):
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)

        async def events(steps) -> AsyncIterator[str]:
            answer = out.Answer()
            choices = [output.stream() for _ in range(n)]
            for index in range(n):  # vLLM's first chunk per choice: the role
                yield out.dump(
                    out.chat_chunk(rid, model, index, role="assistant", content="", logprobs=None)
                )
            async for i, step in steps:
                self._absorb(answer, i, n, step)
                for delta in step.sequences:
                    choice = choices[delta.index]
                    calls_before = choice.num_calls
                    parts = choice.feed(delta.text)
                    reason = delta.finish_reason
                    if reason is not None:
                        last = choice.finish()
                        parts.content = (parts.content or "") + (last.content or "") or None
                        parts.reasoning = (parts.reasoning or "") + (last.reasoning or "") or None
                        parts.calls += last.calls
                        if last.arguments is not None:
                            parts.arguments = last.arguments
                        reason = output.finish_reason(out.finish_reason(reason), choice.had_calls)
                    if not parts and reason is None and not body.logprobs and not continuous:
                        continue  # held back (a tag or a call in progress): nothing to say
                    yield out.dump(
                        out.chat_chunk(
                            rid,
                            model,
                            delta.index,
                            reason=reason,
                            logprobs=(delta.logprobs or []) if body.logprobs else None,
                            usage=answer.usage() if continuous else None,
                            parts=parts,
                            first_call_index=calls_before,
                        )
                    )
            if include_usage:
                yield out.dump(out.chat_usage_chunk(rid, model, answer.usage()))

        return events
