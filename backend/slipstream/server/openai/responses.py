"""OpenAI response objects (the ``openai`` package's own types) from the steps a generation
streams: whole completions, streamed chunks, usage and logprobs in the shapes OpenAI's (and
vLLM's) clients parse."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    chat_completion as chat,
    chat_completion_chunk as chunk,
)
from openai.types.chat.chat_completion_chunk import (
    ChoiceDeltaToolCall,
    ChoiceDeltaToolCallFunction,
)
from openai.types.chat.chat_completion_message_tool_call import (
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionMessageToolCallUnion,
    Function,
)
from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob, TopLogprob
from openai.types.completion_choice import Logprobs

from slipstream.server.openai.chat_output import ChatMessageParts, ChatOutput
from slipstream.server.openai.triton_client import SequenceDelta, TokenLogprob

# The finish reasons OpenAI's completion and chat choices share; the engine's others
# ("abort", "error") are reported as "stop".
FinishReason = Literal["stop", "length"]
FINISH_REASONS: tuple[FinishReason, ...] = ("stop", "length")


def finish_reason(reason: Optional[str]) -> Optional[FinishReason]:
    if reason is None:
        return None
    return "length" if reason == "length" else "stop"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def dump(obj) -> str:
    """JSON of an openai object with the fields that were set (None ones included)."""
    return obj.model_dump_json(exclude_unset=True)


@dataclass
class Choice:
    """One choice accumulated for a non-streaming answer."""

    text: str = ""
    finish_reason: Optional[FinishReason] = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Answer:
    """What a whole request accumulates: choices by index and token counts."""

    choices: dict[int, Choice] = field(default_factory=dict)
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, index: int, delta: SequenceDelta) -> None:
        choice = self.choices.setdefault(index, Choice())
        choice.text += delta.text
        choice.logprobs.extend(delta.logprobs or [])
        if delta.finish_reason is not None:
            choice.finish_reason = finish_reason(delta.finish_reason)
        self.completion_tokens += delta.num_tokens

    def usage(self) -> CompletionUsage:
        return CompletionUsage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
        )


# ------------------------------------------------------------------------ logprobs
def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(tokens: list[TokenLogprob]) -> list[ChatCompletionTokenLogprob]:
    return [
        ChatCompletionTokenLogprob(
            token=t.token,
            logprob=t.logprob,
            bytes=_bytes(t.token),
            top_logprobs=[
                TopLogprob(token=tok, logprob=lp, bytes=_bytes(tok)) for tok, lp in t.top
            ],
        )
        for t in tokens
    ]


def completion_logprobs(tokens: list[TokenLogprob], offset: int = 0) -> Logprobs:
    """OpenAI's legacy shape; ``offset``: characters of text before these tokens."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.token)
    return Logprobs(
        tokens=[t.token for t in tokens],
        token_logprobs=[t.logprob for t in tokens],
        top_logprobs=[{**{tok: lp for tok, lp in t.top}, t.token: t.logprob} for t in tokens],
        text_offset=offsets,
    )


def _envelope(rid: str, kind: str, model: str) -> dict[str, Any]:
    """The fields every completion object and chunk opens with: id, kind, time, model."""
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model}


# ------------------------------------------------------------------------ completions
def completion(rid: str, model: str, answer: Answer, with_logprobs: bool) -> Completion:
    choices = [
        CompletionChoice(
            index=i,
            text=c.text,
            finish_reason=c.finish_reason or "stop",
            logprobs=completion_logprobs(c.logprobs) if with_logprobs else None,
        )
        for i, c in sorted(answer.choices.items())
    ]
    return Completion(
        **_envelope(rid, "text_completion", model),
        choices=choices,
        usage=answer.usage(),
    )


def completion_chunk(
    rid: str,
    model: str,
    index: int,
    text: str,
    reason: Optional[str],
    logprobs: Optional[Logprobs],
    usage: Optional[CompletionUsage] = None,
) -> Completion:
    choice = CompletionChoice.model_construct(
        index=index, text=text, finish_reason=finish_reason(reason), logprobs=logprobs
    )
    out = Completion.model_construct(**_envelope(rid, "text_completion", model), choices=[choice])
    if usage is not None:
        out.usage = usage
    return out


def completion_usage_chunk(rid: str, model: str, usage: CompletionUsage) -> Completion:
    return Completion.model_construct(
        **_envelope(rid, "text_completion", model),
        choices=[],
        usage=usage,
    )


# ------------------------------------------------------------------------ chat
def _message_tool_calls(
    parts: ChatMessageParts,
) -> Optional[list[ChatCompletionMessageToolCallUnion]]:
    if not parts.calls:
        return None
    return [
        ChatCompletionMessageFunctionToolCall(
            id=call.id,
            type="function",
            function=Function(name=call.name, arguments=call.arguments),
        )
        for call in parts.calls
    ]


def chat_message(parts: ChatMessageParts) -> ChatCompletionMessage:
    message = ChatCompletionMessage(
        role="assistant",
        content=parts.content if parts.content or not parts.calls else None,
        tool_calls=_message_tool_calls(parts),
    )
    if parts.reasoning is not None:
        message.reasoning_content = parts.reasoning  # type: ignore[attr-defined] # vLLM's field
    return message


def chat_completion(
    rid: str,
    model: str,
    answer: Answer,
    with_logprobs: bool,
    output: Optional[ChatOutput] = None,
) -> ChatCompletion:
    output = output or ChatOutput()
    choices = []
    for i, c in sorted(answer.choices.items()):
        parts = output.whole(c.text)
        reason = output.finish_reason(c.finish_reason or "stop", bool(parts.calls))
        choices.append(
            chat.Choice(
                index=i,
                finish_reason=reason,  # type: ignore[arg-type] # stop, length or tool_calls
                message=chat_message(parts),
                logprobs=chat.ChoiceLogprobs(content=chat_logprobs(c.logprobs))
                if with_logprobs
                else None,
            )
        )
    return ChatCompletion(
        **_envelope(rid, "chat.completion", model),
        choices=choices,
        usage=answer.usage(),
    )


def _delta_tool_calls(parts: ChatMessageParts, first_index: int) -> list[ChoiceDeltaToolCall]:
    """A delta's calls: whole ones, or a named call's arguments as they come (its id, type
    and name on its first delta only, as OpenAI streams them)."""
    out = [
        ChoiceDeltaToolCall(
            index=first_index + k,
            id=call.id,
            type="function",
            function=ChoiceDeltaToolCallFunction(name=call.name, arguments=call.arguments),
        )
        for k, call in enumerate(parts.calls)
    ]
    if parts.arguments is not None:
        call, text, first = parts.arguments
        delta = ChoiceDeltaToolCall(index=0, function=ChoiceDeltaToolCallFunction(arguments=text))
        if first:
            delta.id, delta.type = call.id, "function"
            assert delta.function is not None
            delta.function.name = call.name
        out.append(delta)
    return out


def chat_chunk(
    rid: str,
    model: str,
    index: int,
    *,
    role: Optional[Literal["assistant"]] = None,
    content: Optional[str] = None,
    reason: Optional[str] = None,
    logprobs: Optional[list[TokenLogprob]] = None,
    usage: Optional[CompletionUsage] = None,
    parts: Optional[ChatMessageParts] = None,
    first_call_index: int = 0,
) -> ChatCompletionChunk:
    delta = chunk.ChoiceDelta()
    if role is not None:
        delta.role = role
    if content is not None:
        delta.content = content
    if parts is not None:
        if parts.content:
            delta.content = parts.content
        if parts.reasoning:
            delta.reasoning_content = parts.reasoning  # type: ignore[attr-defined] # vLLM's
        if parts.calls or parts.arguments is not None:
            delta.tool_calls = _delta_tool_calls(parts, first_call_index)
    choice = chunk.Choice(
        index=index,
        delta=delta,
        finish_reason=reason,  # type: ignore[arg-type] # stop, length or tool_calls
        logprobs=chunk.ChoiceLogprobs(content=chat_logprobs(logprobs))
        if logprobs is not None
        else None,
    )
    out = ChatCompletionChunk(
        **_envelope(rid, "chat.completion.chunk", model),
        choices=[choice],
    )
    if usage is not None:
        out.usage = usage
    return out


def chat_usage_chunk(rid: str, model: str, usage: CompletionUsage) -> ChatCompletionChunk:
    return ChatCompletionChunk(
        **_envelope(rid, "chat.completion.chunk", model),
        choices=[],
        usage=usage,
    )
