"""``--tool-call-parser``: how a model writes tool calls, by vLLM's parser names, both ways:
reading the calls out of a model's output (``tool_choice: "auto"``), and writing a format the
model is told to use (the system prompt of a chat template that has no tool format of its
own, ``tool_prompt``, and the earlier calls of a conversation).

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per
  call; text around the blocks is content.
* ``llama3_json``: the output is ``{"name": ..., "parameters": {...}}`` (``; ``-separated for
  several, after an optional ``<|python_tag|>``).
* ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` (or
  ``name{...}`` per call, the v11 tokenizers' form).
* ``pythonic``: the output is a Python list of calls, ``[get_weather(city="Paris"), ...]``,
  literal arguments only.

An output that does not parse as calls is content, as in vLLM.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text
    id: str = field(default_factory=new_call_id)


@dataclass
class ParsedOutput:
    content: str
    calls: list[ToolCall]


def _arguments(value: Any) -> Optional[str]:
    """A call's arguments as JSON text; None when they are not an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def _call(obj: Any, arguments_key: str) -> Optional[ToolCall]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = _arguments(obj.get(arguments_key, obj.get("arguments", {})))
    return None if args is None else ToolCall(obj["name"], args)


class ToolCallParser(ABC):
    """One format of tool calls."""

    name: ClassVar[str]

    @abstractmethod
    def calls_begin(self, text: str) -> Optional[int]:
        """Where the calls begin in a (partial) output, or None while none has; a format
        whose calls are the whole output answers 0 or None from its first characters."""

    def undecided(self, text: str) -> int:
        """How many trailing characters of an output without calls must be held back: they
        may be the start of the calls' marker."""
        return 0

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """The content and calls of a whole output (content only if the calls are bad)."""

    @abstractmethod
    def write(self, calls: list[dict]) -> str:
        """Earlier calls (OpenAI ``tool_calls`` entries) as this model writes them."""

    @abstractmethod
    def instructions(self) -> str:
        """How the model is asked to write its calls."""


def _function(call: dict) -> tuple[str, Any]:
    function = call.get("function") or {}
    args = function.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        pass
    return str(function.get("name", "")), args


class MarkedParser(ToolCallParser):
    """A format whose calls begin at a fixed marker, anywhere in the output."""

    MARKER: ClassVar[str]

    def calls_begin(self, text: str) -> Optional[int]:
        at = text.find(self.MARKER)
        return at if at >= 0 else None

    def undecided(self, text: str) -> int:
        """The longest tail of ``text`` that begins the marker."""
        for size in range(min(len(self.MARKER) - 1, len(text)), 0, -1):
            if self.MARKER.startswith(text[-size:]):
                return size
        return 0


class HermesParser(MarkedParser):
    name = "hermes"
    MARKER, CLOSE = "<tool_call>", "</tool_call>"
    BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> ParsedOutput:
        if self.MARKER not in text:
            return ParsedOutput(text, [])
        calls = []
        for block in self.BLOCK.findall(text):
            try:
                call = _call(json.loads(block), "arguments")
            except ValueError:
                call = None
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
        content = self.BLOCK.sub("", text).strip()
        return ParsedOutput(content, calls)

    def write(self, calls: list[dict]) -> str:
        blocks = []
        for call in calls:
            name, args = _function(call)
            body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
            blocks.append(f"{self.MARKER}\n{body}\n{self.CLOSE}")
        return "\n".join(blocks)

    def instructions(self) -> str:
        return (
            "To call a function, write one JSON object with its name and arguments "
            "between <tool_call></tool_call> tags for each call:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <arguments-object>}\n'
            "</tool_call>"
        )


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def calls_begin(self, text: str) -> Optional[int]:
        body = text.lstrip()
        if body.startswith(self.TAG) or body.startswith("{"):
            return len(text) - len(body)
        return None

    def undecided(self, text: str) -> int:
        body = text.lstrip()
        return len(text) if self.TAG.startswith(body) else 0

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip().removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return ParsedOutput(text, [])
        calls, decoder, at = [], json.JSONDecoder(), 0
        while at < len(body):
            try:
                obj, end = decoder.raw_decode(body, at)
            except ValueError:
                return ParsedOutput(text, [])
            call = _call(obj, "parameters")
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
            at = end
            while at < len(body) and body[at] in " \n\t;":
                at += 1
        return ParsedOutput("", calls)

    def write(self, calls: list[dict]) -> str:
        parts = []
        for call in calls:
            name, args = _function(call)
            parts.append(json.dumps({"name": name, "parameters": args}, ensure_ascii=False))
        return "; ".join(parts)

    def instructions(self) -> str:
        return (
            "To call a function, answer with only a JSON object of its name and "
            'parameters: {"name": <function-name>, "parameters": <arguments-object>} '
            "(several calls separated by '; ')."
        )


class MistralParser(MarkedParser):
    name = "mistral"
    MARKER = "[TOOL_CALLS]"
    NAMED = re.compile(r"\s*([A-Za-z_][\w.\-]*)\s*(?=\{)")

    def parse(self, text: str) -> ParsedOutput:
        at = text.find(self.MARKER)
        if at < 0:
            return ParsedOutput(text, [])
        content, body = text[:at].strip(), text[at + len(self.MARKER) :].strip()
        calls = self._json_list(body)
        if calls is None:
            calls = self._named(body)
        return ParsedOutput(content, calls) if calls else ParsedOutput(text, [])

    @staticmethod
    def _json_list(body: str) -> Optional[list[ToolCall]]:
        try:
            items = json.loads(body)
        except ValueError:
            return None
        items = items if isinstance(items, list) else [items]
        calls = [_call(item, "arguments") for item in items]
        return None if any(c is None for c in calls) else [c for c in calls if c is not None]

    def _named(self, body: str) -> list[ToolCall]:
        """``name{...}[TOOL_CALLS]name{...}``: the v11 tokenizers' form."""
        calls, decoder = [], json.JSONDecoder()
        for chunk in body.split(self.MARKER):
            at = 0
            while at < len(chunk):
                match = self.NAMED.match(chunk, at)
                if match is None:
                    return []
                try:
                    args, at = decoder.raw_decode(chunk, match.end())
                except ValueError:
                    return []
                encoded = _arguments(args)
                if encoded is None:
                    return []
                calls.append(ToolCall(match.group(1), encoded))
                while at < len(chunk) and chunk[at] in " \n\t,":
                    at += 1
        return calls

    def write(self, calls: list[dict]) -> str:
        items = []
        for call in calls:
            name, args = _function(call)
            items.append({"name": name, "arguments": args})
        return self.MARKER + json.dumps(items, ensure_ascii=False)

    def instructions(self) -> str:
        return (
            "To call functions, answer with [TOOL_CALLS] followed by a JSON list of calls: "
            '[TOOL_CALLS][{"name": <function-name>, "arguments": <arguments-object>}]'
        )


class PythonicParser(ToolCallParser):
    name = "pythonic"

    def calls_begin(self, text: str) -> Optional[int]:
        body = text.lstrip()
        return len(text) - len(body) if body.startswith("[") else None

    def undecided(self, text: str) -> int:
        return len(text) if not text.strip() else 0

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip()
        if not body.startswith("["):
            return ParsedOutput(text, [])
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:
            return ParsedOutput(text, [])
        if not isinstance(tree, ast.List):
            return ParsedOutput(text, [])
        calls = []
        for item in tree.elts:
            call = self._call(item)
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
        return ParsedOutput("", calls)

    @staticmethod
    def _call(node: ast.expr) -> Optional[ToolCall]:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = ast.unparse(node.func)
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
        except ValueError:
            return None
        return ToolCall(name, json.dumps(args, ensure_ascii=False))

    def write(self, calls: list[dict]) -> str:
        rendered = []
        for call in calls:
            name, args = _function(call)
            items = args.items() if isinstance(args, dict) else []
            rendered.append(f"{name}({', '.join(f'{k}={v!r}' for k, v in items)})")
        return f"[{', '.join(rendered)}]"

    def instructions(self) -> str:
        return (
            "To call functions, answer with only a Python list of calls with keyword "
            "arguments: [func_name1(param=value), func_name2(param=value)]"
        )


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    cls.name: cls for cls in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)
}


def tool_call_parser(name: Optional[str]) -> Optional[ToolCallParser]:
    if name is None:
        return None
    try:
        return TOOL_CALL_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {name!r}; choose one of {sorted(TOOL_CALL_PARSERS)}"
        ) from None
