"""The embedded model (SmolLM2-135M-Instruct) through a real tritonserver and the ``openai``
SDK: a named tool call and a required one give arguments valid for the tool's JSON schema
every time (several seeds and temperatures, streamed and not: the grammar engine holds the
output to the schema), and ``use_beam_search`` returns Hugging Face's beams."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest

from slipstream.server.launch.launcher import TritonServer
from slipstream.server.launch.repository import render_model_repository
from slipstream.server.openai.frontend import OpenAIFrontend
from support import need_tritonserver

pytestmark = [pytest.mark.slow, pytest.mark.server]

REPO = Path(__file__).resolve().parents[3] / "model_repository"
MODEL = "slipstream"
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast for a city",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 24}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]
MESSAGES = [{"role": "user", "content": "What will the weather be in Paris this weekend?"}]
SAMPLES = [(0.0, None), (0.7, 1), (0.7, 2), (1.0, 3), (1.3, 4)]  # (temperature, seed)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    need_tritonserver()
    repo = render_model_repository(
        REPO,
        tmp_path_factory.mktemp("smollm") / "model_repository",
        {
            "model": "default",
            "kv_cache_memory_bytes": 64 * 1024 * 1024,
            "max_model_len": 1024,
            "max_num_seqs": 8,
        },
    )
    with TritonServer(
        repo, http_port=0, grpc_port=0, metrics_port=0, models=[MODEL], startup_timeout=600
    ) as server:
        with OpenAIFrontend.for_repository(repo, server.grpc_url) as front:
            yield openai.OpenAI(base_url=f"{front.url}/v1", api_key="none", max_retries=0)


def arguments_of_stream(stream) -> tuple[dict[int, dict], str]:
    calls: dict[int, dict] = {}
    reason = None
    for chunk in stream:
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": "", "id": None})
                entry["id"] = entry["id"] or call.id
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
    return calls, reason


@pytest.mark.parametrize("temperature, seed", SAMPLES)
def test_a_named_tool_call_always_has_schema_valid_arguments(client, temperature, seed):
    body = dict(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=temperature,
        seed=seed,
        max_tokens=200,
    )
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.finish_reason == "stop", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)
    calls, reason = arguments_of_stream(client.chat.completions.create(**body, stream=True))
    assert reason == "stop" and list(calls) == [0] and calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER_PARAMETERS)
    if seed is not None:  # the same seed: the same call, streamed or not
        assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)


@pytest.mark.parametrize("temperature, seed", SAMPLES[:3])
def test_a_required_tool_choice_always_calls_a_tool_with_valid_arguments(client, temperature, seed):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    body = dict(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        temperature=temperature,
        seed=seed,
        max_tokens=300,
    )
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    calls, reason = arguments_of_stream(client.chat.completions.create(**body, stream=True))
    assert reason == "tool_calls" and calls
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])


def test_use_beam_search_returns_hugging_faces_beams(client):
    """vLLM's ``use_beam_search`` with ``n`` beams (and ``length_penalty``) is the engine's
    beam search: the same beams as transformers' ``generate(num_beams=2)``."""
    from beam_support import MAX_TOKENS, PROMPT, hf_beams

    answer = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        n=2,
        max_tokens=MAX_TOKENS,
        extra_body={"use_beam_search": True, "length_penalty": 1.0},
    )
    assert [c.text for c in sorted(answer.choices, key=lambda c: c.index)] == hf_beams(2)
