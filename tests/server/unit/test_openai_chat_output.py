"""Tool calls and reasoning read from a chat answer's text, without a server: each tool call
parser on its format (and on text that is not calls), the reasoning split, and the streamed
split equal to the whole one however the text is cut into deltas."""

from __future__ import annotations

import json

import pytest

from slipstream.server.openai.chat_output import ChatMessageParts, ChatOutput
from slipstream.server.openai.errors import OpenAIError
from slipstream.server.openai.reasoning_parsers import REASONING_PARSERS
from slipstream.server.openai.tool_calls import (
    ToolChoice,
    plain_history,
    template_has_tools,
    tool_request,
    with_tool_prompt,
)
from slipstream.server.openai.tool_parsers import TOOL_CALL_PARSERS, tool_call_parser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
PARIS = {"city": "Paris", "days": 2}

# (parser, a model's output with two calls and some content, the content)
OUTPUTS = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
        "</tool_call>",
        "Let me check.",
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
        '{"name": "get_time", "parameters": {}}',
        "",
    ),
    (
        "mistral",
        'Sure [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},'
        ' {"name": "get_time", "arguments": {}}]',
        "Sure",
    ),
    ("pythonic", '[get_weather(city="Paris", days=2), get_time()]', ""),
]


def cuts(text: str) -> list[list[str]]:
    """The text as one delta, as single characters, and in chunks of 3 and 7."""
    return [[text], list(text)] + [
        [text[i : i + k] for i in range(0, len(text), k)] for k in (3, 7)
    ]


def streamed(output: ChatOutput, deltas: list[str]) -> ChatMessageParts:
    stream = output.stream()
    total = ChatMessageParts(content="", reasoning="")
    for part in [stream.feed(d) for d in deltas] + [stream.finish()]:
        total.content = (total.content or "") + (part.content or "")
        total.reasoning = (total.reasoning or "") + (part.reasoning or "")
        total.calls += part.calls
        if part.arguments is not None:
            call, text, _ = part.arguments
            if not total.calls or total.calls[-1] is not call:
                total.calls.append(call)
    return total


def auto(parser: str) -> ChatOutput:
    tools = tool_request([WEATHER, TIME], "auto", None, auto_enabled=True)
    return ChatOutput(tools=tools, parser=tool_call_parser(parser))


@pytest.mark.parametrize("parser, text, content", OUTPUTS)
def test_each_parser_reads_its_calls_whole_and_streamed(parser, text, content):
    output = auto(parser)
    whole = output.whole(text)
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [
        ("get_weather", PARIS),
        ("get_time", {}),
    ]
    assert (whole.content or "") == content
    for deltas in cuts(text):
        got = streamed(output, deltas)
        assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [
            ("get_weather", PARIS),
            ("get_time", {}),
        ], deltas
        assert got.content.strip() == content


@pytest.mark.parametrize("parser", sorted(TOOL_CALL_PARSERS))
@pytest.mark.parametrize(
    "text", ["The weather is fine.", "[not a call", "<tool_call>{bad json}</tool_call>"]
)
def test_text_that_is_not_calls_is_content(parser, text):
    output = auto(parser)
    assert output.whole(text).calls == [] and output.whole(text).content == text
    for deltas in cuts(text):
        got = streamed(output, deltas)
        assert got.calls == [] and got.content == text


@pytest.mark.parametrize("parser", sorted(TOOL_CALL_PARSERS))
def test_what_a_parser_writes_it_reads_back(parser):
    fmt = tool_call_parser(parser)
    calls = [
        {"id": "a", "function": {"name": "get_weather", "arguments": json.dumps(PARIS)}},
        {"id": "b", "function": {"name": "get_time", "arguments": {}}},
    ]
    parsed = fmt.parse(fmt.write(calls))
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", PARIS),
        ("get_time", {}),
    ]


def test_required_choice_is_a_json_list_of_calls_streamed_as_each_completes():
    tools = tool_request([WEATHER, TIME], "required", None, auto_enabled=False)
    schema = tools.schema()
    assert schema["type"] == "array" and schema["minItems"] == 1
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}, {"name": "get_time", "parameters": {}}]'  # noqa: E501
    output = ChatOutput(tools=tools)
    stream = output.stream()
    emitted = []
    for char in text[:-1]:
        emitted.append([c.name for c in stream.feed(char).calls])
    first_done = text.index("}},") + 1  # the brace that closes the first element
    assert [n for names in emitted[:first_done] for n in names] == []
    assert emitted[first_done] == ["get_weather"]
    assert emitted[len(text) - 2] == ["get_time"]  # its own closing brace
    assert sum(len(names) for names in emitted) == 2
    assert stream.feed("]").calls + stream.finish().calls == []
    assert output.finish_reason("stop", True) == "tool_calls"
    single = tool_request([WEATHER], "required", False, auto_enabled=False)
    assert single.schema()["maxItems"] == 1


def test_a_named_choice_streams_its_arguments_as_they_come():
    tools = tool_request(
        [WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None, False
    )
    assert tools.choice is ToolChoice.NAMED and tools.schema() == WEATHER["function"]["parameters"]
    output = ChatOutput(tools=tools)
    stream = output.stream()
    first = stream.feed('{"city": ')
    call, text, is_first = first.arguments
    assert call.name == "get_weather" and text == '{"city": ' and is_first
    assert stream.feed('"Paris"}').arguments[1:] == ('"Paris"}', False)
    assert output.whole('{"city": "Paris"}').calls[0].arguments == '{"city": "Paris"}'
    assert output.finish_reason("stop", True) == "stop"  # OpenAI: a forced call stops


@pytest.mark.parametrize(
    "tools, choice, message",
    [
        (None, "auto", "When using `tool_choice`, `tools` must be set."),
        ([WEATHER], "sometimes", "tool_choice must be 'none', 'auto', 'required'"),
        ([WEATHER], {"type": "function", "function": {"name": "f"}}, "Tool 'f' has not been"),
        ([WEATHER], "auto", '"auto" tool choice requires --enable-auto-tool-choice'),
        ([{"type": "function", "function": {"name": "f", "parameters": 3}}], None, "schema"),
    ],
)
def test_tool_requests_are_refused_as_vllm_refuses_them(tools, choice, message):
    with pytest.raises(OpenAIError) as e:
        tool_request(tools, choice, None, auto_enabled=False)
    assert e.value.status == 400 and message in e.value.message


def test_tools_default_to_auto_only_when_it_is_enabled():
    assert tool_request([WEATHER], None, None, True).choice is ToolChoice.AUTO
    assert tool_request([WEATHER], None, None, False).choice is ToolChoice.NONE


def test_a_template_without_a_tool_format_gets_tools_and_history_in_its_prompt():
    assert not template_has_tools("{% for message in messages %}{{ message['content'] }}")
    assert template_has_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    tools = tool_request([WEATHER], "none", None, False)
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "function": {"name": "get_weather", "arguments": PARIS}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    rendered = with_tool_prompt(messages, tools, tool_call_parser("hermes"))
    assert rendered[0]["role"] == "system" and '"name": "get_weather"' in rendered[0]["content"]
    assert "<tool_call>" in rendered[2]["content"] and "Paris" in rendered[2]["content"]
    assert rendered[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    assert plain_history(messages, None)[1]["content"].startswith("<tool_call>")


# ------------------------------------------------------------------------ reasoning
@pytest.mark.parametrize(
    "parser, text, reasoning, content",
    [
        (
            "deepseek_r1",
            "<think>step 1, step 2</think>The answer is 4.",
            "step 1, step 2",
            "The answer is 4.",
        ),  # noqa: E501
        ("deepseek_r1", "step 1</think>4", "step 1", "4"),  # the template opened the tag
        ("deepseek_r1", "still thinking", "still thinking", ""),
        ("qwen3", "<think>hmm</think>\n\nParis.", "hmm", "\n\nParis."),
        ("qwen3", "Paris.", None, "Paris."),  # no tags: all content
        ("qwen3", "<think></think>Paris.", "", "Paris."),
    ],
)
def test_reasoning_is_split_whole_and_streamed_alike(parser, text, reasoning, content):
    output = ChatOutput(reasoning=REASONING_PARSERS[parser])
    whole = output.whole(text)
    assert whole.reasoning == reasoning and whole.content == content
    for deltas in cuts(text):
        got = streamed(output, deltas)
        assert got.content == content, deltas
        assert got.reasoning == (reasoning or ""), deltas
        assert "<think>" not in got.content + got.reasoning and "</think>" not in got.content


def test_reasoning_then_tool_calls_and_include_reasoning_false():
    tools = tool_request([WEATHER], "auto", None, auto_enabled=True)
    text = '<think>need the weather</think><tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'  # noqa: E501
    output = ChatOutput(REASONING_PARSERS["deepseek_r1"], tools, tool_call_parser("hermes"))
    whole = output.whole(text)
    assert whole.reasoning == "need the weather" and whole.calls[0].name == "get_weather"
    hidden = ChatOutput(REASONING_PARSERS["deepseek_r1"], tools, tool_call_parser("hermes"), False)
    assert hidden.whole(text).reasoning is None
    assert streamed(hidden, list(text)).reasoning == ""
