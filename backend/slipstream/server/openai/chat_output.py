"""What a chat answer's text becomes: reasoning (``--reasoning-parser``), content and tool
calls (``tool_choice``), for a whole answer (``ChatOutput.whole``) and streamed delta by delta
(``ChatOutput.stream``: one ``ChoiceStream`` per choice).

The reasoning is split off first; the tool calls are read from what is left:

* ``required``: the output is a JSON list of ``{"name", "parameters"}`` (the grammar made it
  so): every element is a call.
* a named function: the output is that function's arguments.
* ``auto``: the server's tool call parser reads the calls; the rest is content.

Streamed, content goes out as it comes (less what may be the start of a call's marker) and
each call goes out whole once complete; a named function's arguments stream as they come.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

from slipstream.server.openai.reasoning_parsers import (
    ReasoningFormat,
    ReasoningSplitter,
    split_whole,
)
from slipstream.server.openai.tool_calls import ToolChoice, ToolRequest
from slipstream.server.openai.tool_parsers import ParsedOutput, ToolCall, ToolCallParser


@dataclass
class ChatMessageParts:
    """A whole answer, or one streamed delta of it."""

    content: Optional[str] = None
    reasoning: Optional[str] = None
    calls: list[ToolCall] = field(default_factory=list)
    # a named call's arguments streamed as they come: (its call, the arguments' new text)
    arguments: Optional[tuple[ToolCall, str, bool]] = None  # (call, text, first delta)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls or self.arguments)


def _required_calls(text: str) -> list[ToolCall]:
    try:
        items = json.loads(text)
    except ValueError:
        return []
    calls = []
    for item in items if isinstance(items, list) else []:
        if isinstance(item, dict) and isinstance(item.get("name"), str):
            args = item.get("parameters", item.get("arguments", {}))
            calls.append(ToolCall(item["name"], json.dumps(args, ensure_ascii=False)))
    return calls


def _element_ends(text: str) -> list[int]:
    """Where each complete top-level object of a (partial) JSON list ends."""
    ends: list[int] = []
    depth, in_string, escaped = 0, False, False
    for at, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
            if depth == 1 and char == "}":
                ends.append(at + 1)
    return ends


@dataclass(frozen=True)
class ChatOutput:
    reasoning: Optional[ReasoningFormat] = None
    tools: Optional[ToolRequest] = None
    parser: Optional[ToolCallParser] = None
    include_reasoning: bool = True  # vLLM's request field: false drops the reasoning

    def whole(self, text: str) -> ChatMessageParts:
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = split_whole(self.reasoning, text)
        parts = ChatMessageParts(reasoning=reasoning if self.include_reasoning else None)
        choice = self.tools.choice if self.tools is not None else ToolChoice.NONE
        if choice is ToolChoice.NAMED:
            assert self.tools is not None
            parts.calls = [ToolCall(self.tools.named_tool().name, text)]
        elif choice is ToolChoice.REQUIRED:
            parts.calls = _required_calls(text)
            if not parts.calls:
                parts.content = text
        elif choice is ToolChoice.AUTO and self.parser is not None:
            parsed = self.parser.parse(text)
            parts.content, parts.calls = parsed.content or None, parsed.calls
            if not parsed.calls:
                parts.content = text
        else:
            parts.content = text
        return parts

    def stream(self) -> "ChoiceStream":
        return ChoiceStream(self)

    def finish_reason(self, reason: Optional[str], parts_had_calls: bool) -> Optional[str]:
        """OpenAI's: ``tool_calls`` when the model called tools (a named choice stays
        ``stop``: the caller asked for that call)."""
        if reason is None or not parts_had_calls:
            return reason
        if self.tools is not None and self.tools.choice is ToolChoice.NAMED:
            return reason
        return "tool_calls" if reason == "stop" else reason


class ChoiceStream:
    """One choice's streamed text, delta by delta."""

    def __init__(self, output: ChatOutput) -> None:
        self.output = output
        self.splitter = ReasoningSplitter(output.reasoning) if output.reasoning else None
        self.text = ""  # the content side so far (reasoning split off)
        self.sent = 0  # characters of ``text`` sent as content
        self.calls_at: Optional[int] = None  # where the calls began in ``text``
        self.num_calls = 0  # calls sent
        self.named: Optional[ToolCall] = None
        tools = output.tools
        self.choice = tools.choice if tools is not None else ToolChoice.NONE
        if self.choice is ToolChoice.AUTO and output.parser is None:
            self.choice = ToolChoice.NONE

    @property
    def had_calls(self) -> bool:
        return self.num_calls > 0 or self.named is not None

    def feed(self, delta: str) -> ChatMessageParts:
        if self.splitter is None:
            return self._content(delta, final=False)
        split = self.splitter.feed(delta)
        parts = self._content(split.content, final=False)
        parts.reasoning = (split.reasoning or None) if self.output.include_reasoning else None
        return parts

    def finish(self) -> ChatMessageParts:
        reasoning = None
        text = ""
        if self.splitter is not None:
            rest = self.splitter.finish()
            reasoning, text = rest.reasoning or None, rest.content
        parts = self._content(text, final=True)
        parts.reasoning = reasoning if self.output.include_reasoning else None
        return parts

    # -- the content side ------------------------------------------------------------------
    def _content(self, delta: str, final: bool) -> ChatMessageParts:
        self.text += delta
        if self.choice is ToolChoice.NAMED:
            return self._named(delta)
        if self.choice is ToolChoice.REQUIRED:
            return self._required(final)
        if self.choice is ToolChoice.AUTO:
            return self._auto(final)
        return ChatMessageParts(content=delta or None)

    def _named(self, delta: str) -> ChatMessageParts:
        first = self.named is None
        if first:
            tools = self.output.tools
            assert tools is not None
            self.named = ToolCall(tools.named_tool().name, "")
        assert self.named is not None
        if not delta and not first:
            return ChatMessageParts()
        self.named.arguments += delta
        return ChatMessageParts(arguments=(self.named, delta, first))

    def _required(self, final: bool) -> ChatMessageParts:
        if final:
            calls = _required_calls(self.text)
            if not calls and self.num_calls == 0:
                return ChatMessageParts(content=self.text or None)
            return self._new_calls(calls)
        ends = _element_ends(self.text)
        if len(ends) <= self.num_calls:
            return ChatMessageParts()
        # the complete elements are a list once closed: parse that prefix
        return self._new_calls(_required_calls(self.text[: ends[-1]] + "]"))

    def _auto(self, final: bool) -> ChatMessageParts:
        parser = self.output.parser
        assert parser is not None
        parts = ChatMessageParts()
        if self.calls_at is None:
            begin = parser.calls_begin(self.text)
            if begin is None:
                end = (
                    len(self.text)
                    if final
                    else len(self.text) - parser.undecided(self.text[self.sent :])
                )
                if end > self.sent:
                    parts.content = self.text[self.sent : end]
                    self.sent = end
                return parts
            if begin > self.sent:
                parts.content = self.text[self.sent : begin]
            self.sent = begin
            self.calls_at = begin
        body = self.text[self.calls_at :]
        parsed = parser.parse(body)
        if final and not parsed.calls and self.num_calls == 0:
            parts.content = (parts.content or "") + body  # not calls after all
            return parts
        if final or self._settled(parsed, body):
            parts.calls = self._take(parsed.calls)
            if final and parsed.content and parsed.calls:
                parts.content = (parts.content or "") + parsed.content
        return parts

    def _settled(self, parsed: ParsedOutput, body: str) -> bool:
        """Whether the calls parsed so far are complete: hermes blocks closed, or the whole
        body read as calls."""
        if not parsed.calls:
            return False
        close = getattr(self.output.parser, "CLOSE", None)
        if close is not None:
            return body.count(close) >= len(parsed.calls)
        return not parsed.content

    def _take(self, calls: list[ToolCall]) -> list[ToolCall]:
        new = calls[self.num_calls :]
        self.num_calls += len(new)
        return new

    def _new_calls(self, calls: list[ToolCall]) -> ChatMessageParts:
        return ChatMessageParts(calls=self._take(calls))
