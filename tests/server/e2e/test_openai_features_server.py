"""What applications built on vLLM's server use beyond completions, through a real tritonserver
(tiny model) and the official ``openai`` SDK: API keys and served names, /tokenize and
/detokenize, /health/ready, tool calls read by each tool call parser (the model's output held
to a parser's format by a regex, so the test controls it), tool results sent back, the
reasoning split, and /v1/embeddings (checked against the model's own hidden states)."""

from __future__ import annotations

import base64
import json
import re
import struct
import urllib.error
import urllib.request

import openai
import pytest
import torch

from slipstream.server.launch.launcher import TritonServer
from slipstream.server.openai.api_settings import ApiSettings
from slipstream.server.openai.frontend import OpenAIFrontend
from support import need_tritonserver, tiny_model_dir
from vllm_backend_support import tokenizer_of, write_model

pytestmark = [pytest.mark.slow, pytest.mark.server]

MODEL = "tiny"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# (parser, the output forced on the model, its calls)
FORCED_CALLS = {
    "hermes": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "pythonic": '[get_weather(city="Paris")]',
}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("openai_features")
    write_model(repo, MODEL)
    return repo


@pytest.fixture(scope="module")
def server(repo):
    need_tritonserver()
    with TritonServer(
        repo, http_port=0, grpc_port=0, metrics_port=0, models=[MODEL], startup_timeout=600
    ) as srv:
        yield srv


def frontend(repo, server, **kwargs) -> OpenAIFrontend:
    return OpenAIFrontend.for_repository(
        repo, server.grpc_url, metrics_url=server.metrics_url, **kwargs
    )


def sdk(front: OpenAIFrontend, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{front.url}/v1", api_key=key, max_retries=0)


def get(url: str, headers: dict | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {})) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def post(front: OpenAIFrontend, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        front.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def forced(text: str) -> dict:
    """Sampling fields that make the model write exactly ``text``."""
    return {"structured_outputs": {"regex": re.escape(text)}}


# ------------------------------------------------------------------------ keys and names
def test_api_key_guards_v1_and_leaves_health_metrics_and_tokenize_open(repo, server):
    settings = ApiSettings(api_keys=("key-one", "key-two"))
    with frontend(repo, server, settings=settings) as front:
        with pytest.raises(openai.AuthenticationError) as e:
            sdk(front, "wrong").models.list()
        assert e.value.status_code == 401 and e.value.body["type"] == "AuthenticationError"
        assert get(f"{front.url}/v1/models") == 401
        assert [m.id for m in sdk(front, "key-one").models.list().data] == [MODEL]
        assert sdk(front, "key-two").completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert get(f"{front.url}/health") == 200
        assert get(f"{front.url}/metrics") == 200
        assert post(front, "/tokenize", {"model": MODEL, "prompt": "Hi"})[0] == 200


def test_served_model_names_the_first_is_reported_every_one_is_accepted(repo, server):
    with frontend(repo, server, served_names=("smol", "smol-alias")) as front:
        client = sdk(front)
        assert [m.id for m in client.models.list().data] == ["smol"]
        answer = client.completions.create(model="smol-alias", prompt="Hi", max_tokens=2)
        assert answer.model == "smol" and answer.usage.completion_tokens == 2
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)


def test_tokenize_detokenize_and_health_ready(repo, server):
    tokenizer = tokenizer_of()
    with frontend(repo, server) as front:
        status, got = post(front, "/tokenize", {"model": MODEL, "prompt": "Hello world"})
        ids = tokenizer("Hello world")["input_ids"]
        assert status == 200 and got["tokens"] == ids and got["count"] == len(ids)
        assert got["max_model_len"] > 0
        _, chat = post(front, "/tokenize", {"model": MODEL, "messages": MESSAGES})
        _, render = post(
            front, "/v1/chat/completions/render", {"model": MODEL, "messages": MESSAGES}
        )
        assert chat["tokens"] == render["token_ids"]
        _, back = post(front, "/detokenize", {"model": MODEL, "tokens": ids})
        assert back == {"prompt": tokenizer.decode(ids)}
        status, bad = post(front, "/detokenize", {"model": MODEL, "tokens": [10**9]})
        assert status == 400 and "token ids must be in" in bad["error"]["message"]
        assert get(f"{front.url}/health/ready") == 200


# ------------------------------------------------------------------------ tool calls
@pytest.mark.parametrize("parser", sorted(FORCED_CALLS))
def test_auto_tool_calls_are_read_by_each_parser_whole_and_streamed(repo, server, parser):
    settings = ApiSettings(tool_call_parser=parser, enable_auto_tool_choice=True)
    body = dict(
        model=MODEL,
        messages=MESSAGES,
        tools=[WEATHER],
        max_tokens=80,
        extra_body=forced(FORCED_CALLS[parser]),
    )
    with frontend(repo, server, settings=settings) as front:
        client = sdk(front)
        answer = client.chat.completions.create(**body)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert [
            (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls
        ] == [("get_weather", {"city": "Paris"})]
        assert not choice.message.content
        calls: dict[int, dict] = {}
        reasons = []
        for chunk in client.chat.completions.create(**body, stream=True):
            for c in chunk.choices:
                reasons.append(c.finish_reason)
                for call in c.delta.tool_calls or []:
                    entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
                assert not c.delta.content
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
            ("get_weather", {"city": "Paris"})
        ]
        assert reasons[-1] == "tool_calls"


def test_tool_results_sent_back_as_role_tool_reach_the_prompt(repo, server):
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call-1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call-1", "content": "sunny, 24 C"},
    ]
    with frontend(repo, server) as front:
        answer = sdk(front).chat.completions.create(
            model=MODEL, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=4
        )
        assert answer.choices[0].message.content is not None
        _, render = post(
            front,
            "/v1/chat/completions/render",
            {"model": MODEL, "messages": history, "tools": [WEATHER], "tool_choice": "none"},
        )
        prompt = tokenizer_of().decode(render["token_ids"])
        assert "<tool_response>\nsunny, 24 C\n</tool_response>" in prompt
        assert '"name": "get_weather"' in prompt and "<tools>" in prompt


# ------------------------------------------------------------------------ reasoning
@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_reasoning_goes_to_reasoning_content_whole_and_streamed(repo, server, parser):
    text = "<think>Paris is in France</think>It is sunny."
    with frontend(repo, server, settings=ApiSettings(reasoning_parser=parser)) as front:
        client = sdk(front)
        body = dict(model=MODEL, messages=MESSAGES, max_tokens=60, extra_body=forced(text))
        message = client.chat.completions.create(**body).choices[0].message
        assert message.reasoning_content == "Paris is in France"
        assert message.content == "It is sunny."
        reasoning = content = ""
        for chunk in client.chat.completions.create(**body, stream=True):
            for c in chunk.choices:
                reasoning += getattr(c.delta, "reasoning_content", None) or ""
                content += c.delta.content or ""
        assert (reasoning, content) == ("Paris is in France", "It is sunny.")
        body["extra_body"] = {**forced(text), "include_reasoning": False}
        hidden = client.chat.completions.create(**body)
        assert getattr(hidden.choices[0].message, "reasoning_content", None) is None


# ------------------------------------------------------------------------ embeddings
def hidden_states(ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir("llama")), dtype=torch.float32)
    with torch.no_grad():
        return model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]


def test_embeddings_batched_text_and_token_ids_match_the_models_hidden_states(repo, server):
    tokenizer = tokenizer_of()
    texts = ["The capital of France is", "Hello world", "A third, longer input sentence."]
    with frontend(repo, server) as front:
        client = sdk(front)
        answer = client.embeddings.create(model=MODEL, input=texts)
        assert [d.index for d in answer.data] == [0, 1, 2]
        ids = [tokenizer(t)["input_ids"] for t in texts]
        assert answer.usage.prompt_tokens == sum(len(i) for i in ids)
        for item, token_ids in zip(answer.data, ids):
            expected = torch.nn.functional.normalize(hidden_states(token_ids)[-1], dim=0)
            torch.testing.assert_close(torch.tensor(item.embedding), expected, atol=1e-4, rtol=1e-4)
        by_ids = client.embeddings.create(model=MODEL, input=ids[0])
        assert by_ids.data[0].embedding == pytest.approx(answer.data[0].embedding, abs=1e-6)
        raw = post(
            front,
            "/v1/embeddings",
            {"model": MODEL, "input": texts[0], "encoding_format": "base64"},
        )[1]
        packed = base64.b64decode(raw["data"][0]["embedding"])
        decoded = struct.unpack(f"<{len(packed) // 4}f", packed)
        assert decoded == pytest.approx(answer.data[0].embedding, abs=1e-6)
        with pytest.raises(openai.BadRequestError, match="matryoshka"):
            client.embeddings.create(model=MODEL, input="x", dimensions=8)
        status, error = post(front, "/v1/embeddings", {"model": MODEL, "input": [10**9]})
        assert status == 400 and "token ids must be in" in error["error"]["message"]


def test_the_pooler_config_chooses_mean_pooling_and_a_request_can_skip_normalizing(repo, server):
    tokenizer = tokenizer_of()
    text = "The capital of France is"
    hidden = hidden_states(tokenizer(text)["input_ids"])
    with frontend(repo, server, pooling={"pooling_type": "MEAN"}) as front:
        status, raw = post(
            front, "/v1/embeddings", {"model": MODEL, "input": text, "normalize": False}
        )
        assert status == 200
        torch.testing.assert_close(
            torch.tensor(raw["data"][0]["embedding"]), hidden.mean(0), atol=1e-4, rtol=1e-4
        )
