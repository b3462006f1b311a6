"""A chat request's tools: what ``tools`` and ``tool_choice`` ask for, checked as vLLM checks
them, and how they change the request.

* ``none``: the tools are shown to the model (as vLLM does), its answer is plain content.
* ``auto``: the model may call tools; its calls are read from its output by the server's
  ``--tool-call-parser`` (``tool_parsers``), which ``--enable-auto-tool-choice`` turns on.
* ``required`` and a named function: the grammar engine constrains the output (structured
  outputs, llguidance) to a JSON list of calls, or to the named function's arguments, so
  the arguments are always valid JSON for their schema.

Tools reach the model through its chat template when the template has a tool format (it
reads ``tools``); otherwise they are written into the system prompt, with the parser's
format for calls (``tool_prompt``).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any, Optional

from slipstream.server.openai.errors import bad_request
from slipstream.server.openai.tool_parsers import HermesParser, ToolCallParser

ANY_OBJECT: dict[str, Any] = {"type": "object"}


class ToolChoice(str, enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: Optional[str]
    parameters: dict[str, Any]

    def as_tool(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[FunctionTool, ...]
    choice: ToolChoice
    named: Optional[str] = None  # the function tool_choice names
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        return self.choice in (ToolChoice.REQUIRED, ToolChoice.NAMED)

    def named_tool(self) -> FunctionTool:
        return next(t for t in self.tools if t.name == self.named)

    def schema(self) -> dict[str, Any]:
        """The JSON schema the output must match (``required`` and named choices)."""
        if self.choice is ToolChoice.NAMED:
            return self.named_tool().parameters
        one_of = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.name]},
                    "parameters": tool.parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for tool in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def template_tools(self) -> list[dict[str, Any]]:
        return [tool.as_tool() for tool in self.tools]


def _function_tool(i: int, tool: Any) -> FunctionTool:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise bad_request(f"tools[{i}]: only tools of type 'function' are supported", "tools")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f"tools[{i}].function must be an object with a name", "tools")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = ANY_OBJECT
    if not isinstance(parameters, dict):
        raise bad_request(f"tools[{i}].function.parameters must be a JSON schema", "tools")
    description = function.get("description")
    return FunctionTool(
        function["name"], description if isinstance(description, str) else None, parameters
    )


def tool_request(
    tools: Optional[list[Any]],
    tool_choice: Any,
    parallel_tool_calls: Optional[bool],
    auto_enabled: bool,
) -> Optional[ToolRequest]:
    """The request's tools, or None when it has none; refusals are vLLM's."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
        return None
    functions = tuple(_function_tool(i, t) for i, t in enumerate(tools))
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        choice = ToolChoice.AUTO if auto_enabled else ToolChoice.NONE
        return ToolRequest(functions, choice, parallel=parallel)
    if isinstance(tool_choice, str):
        known = {c.value for c in ToolChoice} - {ToolChoice.NAMED.value}
        if tool_choice not in known:
            raise bad_request(
                f"tool_choice must be 'none', 'auto', 'required' or a named function, "
                f"got {tool_choice!r}",
                "tool_choice",
            )
        choice = ToolChoice(tool_choice)
        if choice is ToolChoice.AUTO and not auto_enabled:
            raise bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and '
                "--tool-call-parser to be set",
                "tool_choice",
            )
        return ToolRequest(functions, choice, parallel=parallel)
    name = _named(tool_choice)
    if name not in {t.name for t in functions}:
        raise bad_request(f"Tool '{name}' has not been passed in `tools`.", "tool_choice")
    return ToolRequest(functions, ToolChoice.NAMED, name, parallel)


def _named(tool_choice: Any) -> str:
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (
        not isinstance(function, dict)
        or tool_choice.get("type", "function") != "function"
        or not isinstance(function.get("name"), str)
    ):
        raise bad_request(
            'a named tool_choice is {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    return function["name"]


def template_has_tools(chat_template: Optional[str]) -> bool:
    """Whether a chat template renders ``tools`` itself (it reads the variable)."""
    return bool(chat_template) and "tools" in str(chat_template)


def tool_prompt(tools: ToolRequest, parser: Optional[ToolCallParser]) -> str:
    """The system prompt's tool section for a template without a tool format."""
    fmt = parser or HermesParser()
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools.template_tools())
    return (
        "# Tools\n\nYou may call one or more functions to answer the user. The functions "
        f"are described in JSON schema within <tools></tools> tags:\n<tools>\n{listed}\n"
        f"</tools>\n\n{fmt.instructions()}"
    )


def plain_history(
    messages: list[dict[str, Any]], parser: Optional[ToolCallParser]
) -> list[dict[str, Any]]:
    """A conversation for a template without a tool format: earlier calls written in the
    parser's format (hermes' without one), tool results as user turns."""
    fmt = parser or HermesParser()
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if message["role"] == "assistant" and calls:
            text = message.get("content") or ""
            written = fmt.write(calls)
            out.append({"role": "assistant", "content": f"{text}\n{written}" if text else written})
        elif message["role"] == "tool":
            result = message.get("content") or ""
            out.append({"role": "user", "content": f"<tool_response>\n{result}\n</tool_response>"})
        else:
            out.append({k: v for k, v in message.items() if k in ("role", "content", "name")})
    return out


def with_tool_prompt(
    messages: list[dict[str, Any]], tools: ToolRequest, parser: Optional[ToolCallParser]
) -> list[dict[str, Any]]:
    """``plain_history`` with the tool section appended to the system message (one is added
    first if there is none)."""
    out = plain_history(messages, parser)
    section = tool_prompt(tools, parser)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{section}"}
    else:
        out.insert(0, {"role": "system", "content": section})
    return out
