"""The OpenAI request bodies and error statuses, without a server: what each field becomes
in ``sampling_parameters``, which fields are refused (and with what message), and the HTTP
status of each error text the Slipstream adapter sends back through Triton."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from slipstream.server.openai.errors import OpenAIError, error_body, status_of_triton_error
from slipstream.server.openai.requests import REFUSED, ChatCompletionRequest, CompletionRequest
from slipstream.server.stub.health import UNHEALTHY_MESSAGE

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_chat_maps_openai_fields_onto_vllm_sampling_parameters():
    body = ChatCompletionRequest(
        **CHAT,
        max_completion_tokens=7,
        logprobs=True,
        top_logprobs=3,
        temperature=0.5,
        stop="x",
        seed=1,
        logit_bias={"12": -5},
        top_k=4,
        min_tokens=2,
        ignore_eos=True,
        priority=3,
    )
    body.check()
    assert body.sampling_parameters() == {
        "max_tokens": 7,
        "logprobs": 3,
        "temperature": 0.5,
        "stop": "x",
        "seed": 1,
        "logit_bias": {12: -5},
        "top_k": 4,
        "min_tokens": 2,
        "ignore_eos": True,
        "n": 1,
        "priority": 3,
        "add_special_tokens": False,
    }  # the rendered template holds the BOS


def test_completion_keeps_the_tokenizers_special_tokens_and_passes_logprobs_and_best_of():
    body = CompletionRequest(model="m", prompt="p", max_tokens=3, logprobs=2, best_of=2, n=1)
    assert body.sampling_parameters() == {"max_tokens": 3, "logprobs": 2, "best_of": 2, "n": 1}
    assert body.prompts() == ["p"]
    assert CompletionRequest(model="m", prompt=["a", "b"]).prompts() == ["a", "b"]


@pytest.mark.parametrize(
    "field, value",
    [
        ("functions", [{}]),
        ("function_call", "auto"),
        ("audio", {"voice": "x"}),
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content"}),
        ("reasoning_effort", "low"),
        ("web_search_options", {"x": 1}),
        ("store", True),
        ("metadata", {"a": "b"}),
        ("service_tier", "flex"),
        ("verbosity", "low"),
        ("chat_template", "{{x}}"),
        ("documents", [{}]),
        ("prompt_logprobs", 1),
    ],
)
def test_chat_refuses_what_it_cannot_honour_with_its_message(field, value):
    with pytest.raises(OpenAIError) as e:
        ChatCompletionRequest(**CHAT, **{field: value}).check()
    assert e.value.status == 400 and e.value.message == REFUSED[field][1]
    assert e.value.param == field


@pytest.mark.parametrize(
    "field, value",
    [
        ("tool_choice", "none"),
        ("modalities", ["text"]),
        ("store", False),
        ("service_tier", "auto"),
        ("user", "u-1"),
    ],
)
def test_chat_accepts_the_no_op_values_of_those_fields(field, value):
    ChatCompletionRequest(**CHAT, **{field: value}).check()


def test_an_undeclared_field_is_refused_not_ignored():
    with pytest.raises(ValidationError, match="extra_forbidden|Extra inputs"):
        CompletionRequest(model="m", prompt="p", frobnicate=1)


def test_completion_refuses_suffix_token_prompts_and_echo_with_logprobs():
    with pytest.raises(OpenAIError, match="suffix is not supported"):
        CompletionRequest(model="m", prompt="p", suffix="s").check()
    with pytest.raises(OpenAIError, match="token ids are not supported"):
        CompletionRequest(model="m", prompt=[1, 2]).prompts()
    with pytest.raises(OpenAIError, match="echo with logprobs"):
        CompletionRequest(model="m", prompt="p", echo=True, logprobs=1).check()


def test_chat_messages_keep_text_parts_and_refuse_the_rest():
    body = ChatCompletionRequest(
        model="m",
        messages=[
            {"role": "system", "content": "s"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ],
    )
    assert body.conversation() == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a\nb"},
    ]
    with pytest.raises(OpenAIError, match="tool_call_id"):
        ChatCompletionRequest(
            model="m", messages=[{"role": "user", "content": "x", "tool_call_id": "c1"}]
        ).conversation()


@pytest.mark.parametrize(
    "text, status",
    [
        (
            "Error generating stream: server overloaded: 1 requests already waiting; retry later",
            429,
        ),
        (UNHEALTHY_MESSAGE, 503),
        ("Error generating stream: the engine is not serving: boom", 503),
        ("the server is shutting down", 503),
        ("Error generating stream: internal error: oops", 500),
        ("Error generating stream: invalid sampling parameters: temperature must be >= 0", 400),
    ],
)
def test_model_errors_through_triton_get_vllms_statuses(text, status):
    assert status_of_triton_error(text) == status


def test_error_body_is_openais_shape():
    assert error_body(429, "slow down") == {
        "error": {"message": "slow down", "type": "RateLimitError", "param": None, "code": 429}
    }


def test_add_special_tokens_is_a_request_option_of_the_backend():
    """The chat frontend sends add_special_tokens=false (vLLM's request field): the adapter
    passes it to the engine's tokenizer, it is no sampling parameter."""
    import json

    import numpy as np

    from slipstream.server.stub.request_parser import parse_request

    def parsed(sampling: dict):
        return parse_request(
            {
                "text_input": np.array([b"hi"], dtype=np.object_),
                "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=np.object_),
            }
        )

    assert parsed({}).options.add_special_tokens is True
    assert parsed({"add_special_tokens": False}).options.add_special_tokens is False


ROUTER_FIELDS = {
    "no_stop_trim": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
    "include_reasoning": True,
}


def test_the_fields_routers_add_are_accepted_and_change_no_sampling_parameter():
    # vllm-router and sglang-router add these to every request they forward
    plain = ChatCompletionRequest(**CHAT, max_tokens=4)
    routed = ChatCompletionRequest(**CHAT, max_tokens=4, **ROUTER_FIELDS)
    routed.check()
    assert routed.sampling_parameters() == plain.sampling_parameters()
    completion = CompletionRequest(model="m", prompt="p", **ROUTER_FIELDS)
    assert (
        completion.sampling_parameters()
        == CompletionRequest(model="m", prompt="p").sampling_parameters()
    )


def test_cache_salt_reaches_the_engine_as_a_sampling_parameter():
    body = ChatCompletionRequest(**CHAT, cache_salt="tenant-a")
    assert body.sampling_parameters()["cache_salt"] == "tenant-a"
