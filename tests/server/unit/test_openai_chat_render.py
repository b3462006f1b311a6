"""A chat request's prompt: a template with a tool format renders the tools and the earlier
calls itself; one without (SmolLM2's) gets them in the system prompt."""

from __future__ import annotations

import copy

from slipstream.server.openai.chat_render import render_chat
from slipstream.server.openai.requests import ChatCompletionRequest
from slipstream.server.openai.served_models import ServedModel, Target
from slipstream.server.openai.tool_calls import tool_request
from slipstream.server.openai.tool_parsers import tool_call_parser
from vllm_backend_support import tokenizer_of

# A template that reads `tools` and an assistant's `tool_calls` (the shape of Qwen's and
# Hermes' templates, reduced).
TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<call {{ c.function.name }} {{ c.function.arguments.city }}>"
    "{% endfor %}{% endfor %}[assistant]"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
]


def target(template: str) -> Target:
    tokenizer = copy.copy(tokenizer_of())
    tokenizer.chat_template = template
    model = ServedModel("tiny", "unused", 512)
    model._tokenizer = tokenizer
    return Target(model)


def test_a_template_with_a_tool_format_renders_tools_and_calls_itself():
    body = ChatCompletionRequest(model="tiny", messages=HISTORY, tools=[WEATHER])
    tools = tool_request(body.tools, None, None, auto_enabled=False)
    prompt = render_chat(target(TOOL_TEMPLATE), body, tools, None)
    assert prompt == (
        "<tools>get_weather;</tools>[user]Weather in Paris?[assistant]"
        "<call get_weather Paris>[tool]sunny[assistant]"
    )


def test_a_template_without_one_gets_the_tools_in_its_system_prompt():
    body = ChatCompletionRequest(model="tiny", messages=HISTORY, tools=[WEATHER])
    tools = tool_request(body.tools, None, None, auto_enabled=False)
    plain = tokenizer_of().chat_template
    prompt = render_chat(target(plain), body, tools, tool_call_parser("pythonic"))
    assert prompt.startswith("<|im_start|>system\n# Tools")
    assert '"name": "get_weather"' in prompt and "Python list of calls" in prompt
    assert "[get_weather(city='Paris')]" in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt
