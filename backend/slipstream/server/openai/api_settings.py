"""The OpenAI frontend's own settings (``slipstream serve`` flags, vLLM's names): who may
call it, how tool calls and reasoning are read from a model's output, and the limits that
keep one HTTP client from holding the server."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from slipstream.server.openai.reasoning_parsers import ReasoningFormat, reasoning_format
from slipstream.server.openai.tool_parsers import ToolCallParser, tool_call_parser

MAX_BODY_BYTES = 16 << 20  # a request body past this is refused (413) before it is read
MAX_HEADER_BYTES = 16 << 10  # request line and headers (h11's limit; past it: 400)
BODY_TIMEOUT_S = 30.0  # a body not received in full within this is refused (408)
HEADER_TIMEOUT_S = 30.0  # a request whose headers take longer has its connection closed
SEND_TIMEOUT_S = 30.0  # a streaming client that takes no data this long is dropped
MAX_CONNECTIONS = 1000  # open connections past this are answered 503


@dataclass(frozen=True)
class ApiSettings:
    api_keys: tuple[str, ...] = ()  # empty: no key asked for (--api-key, VLLM_API_KEY)
    tool_call_parser: Optional[str] = None  # vLLM's parser name (--tool-call-parser)
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (--enable-auto-tool-choice)
    reasoning_parser: Optional[str] = None  # vLLM's parser name (--reasoning-parser)
    max_body_bytes: int = MAX_BODY_BYTES
    max_header_bytes: int = MAX_HEADER_BYTES
    body_timeout_s: float = BODY_TIMEOUT_S
    header_timeout_s: float = HEADER_TIMEOUT_S
    send_timeout_s: float = SEND_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS

    def __post_init__(self) -> None:
        self.parser()  # unknown names fail at start, not per request
        self.reasoning()
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")

    def parser(self) -> Optional[ToolCallParser]:
        return tool_call_parser(self.tool_call_parser)

    def reasoning(self) -> Optional[ReasoningFormat]:
        return reasoning_format(self.reasoning_parser)
