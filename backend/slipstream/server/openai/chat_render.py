"""A chat request's prompt: its messages (and tools) through the model's chat template, as
vLLM renders them; tools go through the template where it has a tool format, else into the
system prompt (``tool_calls.with_tool_prompt``)."""

from __future__ import annotations

from typing import Any, Optional

from slipstream.server.openai.errors import OpenAIError
from slipstream.server.openai.requests import ChatCompletionRequest
from slipstream.server.openai.served_models import Target
from slipstream.server.openai.tool_calls import (
    ToolRequest,
    plain_history,
    template_has_tools,
    with_tool_prompt,
)
from slipstream.server.openai.tool_parsers import ToolCallParser


def render_chat(
    target: Target,
    body: ChatCompletionRequest,
    tools: Optional[ToolRequest],
    parser: Optional[ToolCallParser],
) -> str:
    tokenizer = target.model.tokenizer
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise OpenAIError(
            400, f"model {target.model.name} has no chat template; use /v1/completions"
        )
    messages = body.conversation()
    kwargs: dict[str, Any] = dict(body.chat_template_kwargs or {})
    if template_has_tools(template):
        if tools is not None:
            kwargs["tools"] = tools.template_tools()
    elif tools is not None:
        messages = with_tool_prompt(messages, tools, parser)
    else:
        messages = plain_history(messages, parser)
    try:
        return tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=bool(body.add_generation_prompt),
            continue_final_message=bool(body.continue_final_message),
            **kwargs,
        )
    except OpenAIError:
        raise
    except Exception as e:  # the template itself refused the conversation
        raise OpenAIError(
            400, f"the chat template cannot render these messages: {e}", "messages"
        ) from None
