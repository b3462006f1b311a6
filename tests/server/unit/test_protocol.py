"""The Triton request parser and repository rendering, without a server."""

import json

import numpy as np
import pytest

from slipstream import EngineConfig
from slipstream.server.launch.config_pbtxt import read_parameters, set_parameters
from slipstream.server.launch.repository import render_model_repository
from slipstream.server.stub.model_config import split_parameters
from slipstream.server.stub.request_parser import (
    BadRequestError,
    RequestOptions,
    lora_error,
    parse_request,
)
from slipstream.server.stub.responses import build_outputs, logprobs_entries, output_names
from support import ROOT

REPO = ROOT / "model_repository"


def s(text):
    return np.array([text.encode() if isinstance(text, str) else text], dtype=object)


def b(value):
    return np.array([value], dtype=bool)


def test_minimal_request_defaults():
    r = parse_request({"text_input": s("hello")})
    assert r.prompt == "hello"
    assert r.params.max_tokens == 16
    assert r.options == RequestOptions()
    assert output_names(r.options) == ["text_output"]


def test_sampling_parameters_json_with_string_values():
    sp = json.dumps(
        {
            "temperature": "0",
            "max_tokens": "5",
            "top_k": 3,
            "stop": "x",
            "stop_token_ids": [7],
            "seed": "42",
            "n": 1,
        }
    )
    r = parse_request({"text_input": s("hi"), "sampling_parameters": s(sp)})
    p = r.params
    assert (p.temperature, p.max_tokens, p.top_k, p.stop, p.stop_token_ids, p.seed) == (
        0.0,
        5,
        3,
        ["x"],
        [7],
        42,
    )


def test_precedence_tensor_then_json_then_parameters():
    inputs = {
        "text_input": s("hi"),
        "sampling_parameters": s('{"max_tokens": 7, "top_p": 0.5}'),
        "max_tokens": np.array([3], dtype=np.int32),
    }
    r = parse_request(inputs, {"max_tokens": 9, "top_p": 0.9, "temperature": 0.25})
    assert r.params.max_tokens == 3  # typed tensor
    assert r.params.top_p == 0.5  # JSON over request parameters
    assert r.params.temperature == 0.25  # request parameters when nothing else gives it


def test_request_parameters_as_json_string_and_unknown_keys_ignored():
    r = parse_request(
        {"text_input": s("hi")}, json.dumps({"temperature": 0, "stream": True, "triton_timeout": 5})
    )
    assert r.params.temperature == 0.0 and r.options.stream and r.options.exclude_input_in_output


def test_typed_inputs():
    inputs = {
        "text_input": s("hi"),
        "max_tokens": np.array([4], np.int32),
        "min_tokens": np.array([2], np.int32),
        "temperature": np.array([0.5], np.float32),
        "top_p": np.array([0.8], np.float32),
        "top_k": np.array([5], np.int32),
        "repetition_penalty": np.array([1.1], np.float32),
        "presence_penalty": np.array([0.1], np.float32),
        "frequency_penalty": np.array([0.2], np.float32),
        "seed": np.array([123], np.uint64),
        "end_id": np.array([2], np.int32),
        "stop_words": np.array([b"foo", b"bar"], dtype=object),
        "priority": np.array([3], np.int32),
    }
    r = parse_request(inputs)
    p = r.params
    assert (p.max_tokens, p.min_tokens, p.top_k, p.seed, p.stop_token_ids, p.stop) == (
        4,
        2,
        5,
        123,
        [2],
        ["foo", "bar"],
    )
    assert p.temperature == pytest.approx(0.5) and p.top_p == pytest.approx(0.8)
    assert p.repetition_penalty == pytest.approx(1.1)
    assert r.options.priority == 3
    r = parse_request({"text_input": s("hi"), "seed": np.array([5], np.int64)})
    assert r.params.seed == 5


def test_shape_1x1_accepted():
    r = parse_request(
        {"text_input": np.array([[b"hi"]], dtype=object), "max_tokens": np.array([[2]], np.int32)}
    )
    assert r.prompt == "hi" and r.params.max_tokens == 2


def test_options_and_outputs():
    inputs = {
        "text_input": s("hi"),
        "return_finish_reason": b(True),
        "return_num_input_tokens": b(True),
        "return_num_output_tokens": b(True),
        "return_cumulative_logprob": b(True),
        "return_logprobs": b(True),
        "exclude_input_in_output": b(True),
    }
    r = parse_request(inputs)
    assert r.options.exclude_input_in_output
    assert r.params.logprobs is None  # as in vLLM: the logprobs output is then "null"
    assert output_names(r.options) == [
        "text_output",
        "finish_reason",
        "num_input_tokens",
        "num_output_tokens",
        "cumulative_logprob",
        "logprobs",
    ]
    out = build_outputs(
        r.options,
        "é",
        finish_reason="stop",
        num_input_tokens=3,
        num_output_tokens=2,
        cumulative_logprob=-1.5,
    )
    assert out["text_output"][0] == "é".encode() and out["finish_reason"][0] == b"stop"
    assert out["logprobs"].tolist() == [b"null"]


def test_vllm_backend_wire_format_types_and_shapes():
    """As Triton's vLLM backend sends them: clients and its OpenAI frontend read these."""
    options = RequestOptions(
        return_finish_reason=True,
        return_num_input_tokens=True,
        return_num_output_tokens=True,
        return_cumulative_logprob=True,
        return_logprobs=True,
    )
    out = build_outputs(
        options,
        "x",
        finish_reason=None,
        num_input_tokens=7,
        num_output_tokens=1,
        cumulative_logprob=-0.25,
        logprobs_json="[]",
    )
    assert out["finish_reason"].tolist() == [b"None"]  # str(None) until the last response
    assert out["num_input_tokens"].dtype == np.uint32 and out["num_input_tokens"].shape == ()
    assert out["num_output_tokens"].dtype == np.uint32 and out["num_output_tokens"].shape == (1,)
    assert out["cumulative_logprob"].dtype == np.float32
    assert out["logprobs"].dtype == object and out["logprobs"].tolist() == [b"[]"]


def test_logprobs_entries_in_vllm_json_layout():
    from transformers import AutoTokenizer

    from slipstream.core.request import TokenLogprob
    from support import tiny_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir("llama")))
    hello, world = tokenizer(" hello world", add_special_tokens=False)["input_ids"]
    sampled = [TokenLogprob(-0.5, 1, ((hello, -0.5), (world, -1.5))), TokenLogprob(-2.0, 3, ())]
    entries = logprobs_entries([hello, world], sampled, tokenizer)
    assert json.loads(json.dumps(entries)) == [
        {
            str(hello): {"logprob": -0.5, "rank": 1, "decoded_token": " hello"},
            str(world): {"logprob": -1.5, "rank": 2, "decoded_token": " world"},
        },
        {str(world): {"logprob": -2.0, "rank": 3, "decoded_token": " world"}},
    ]
    assert (
        logprobs_entries([hello], sampled[:1], tokenizer, detokenize=False)[0][str(hello)][
            "decoded_token"
        ]
        is None
    )


@pytest.mark.parametrize(
    "sampling, message",
    [
        ({"n": 0}, "n must be at least 1, got 0."),
        (
            {"n": "3", "best_of": "2"},
            "best_of must be greater than or equal to n, got n=3 and best_of=2.",
        ),
        (
            {"logprobs": 21},
            "Requested sample logprobs of 21, which is greater than max allowed: 20",
        ),
        ({"prompt_logprobs": 30}, "Requested prompt logprobs of 30"),
    ],
)
def test_what_cannot_be_honoured_is_refused_with_vllm_texts(sampling, message):
    """Invalid values of what the engine honours (n, best_of, logprobs) and what it cannot
    honour at all get vLLM's texts."""
    with pytest.raises(BadRequestError) as err:
        parse_request({"text_input": s("hi"), "sampling_parameters": s(json.dumps(sampling))})
    assert message in str(err.value)
    assert parse_request({"text_input": s("hi"), "sampling_parameters": s('{"n": 1}')})
    with pytest.raises(BadRequestError, match="n must be at least 1"):  # HTTP "parameters" too
        parse_request({"text_input": s("hi")}, {"n": -1})


def test_lora_name_is_refused_from_json_and_from_request_parameters():
    hi = {"text_input": s("hi")}
    assert lora_error(hi) is None
    assert (
        lora_error({**hi, "sampling_parameters": s('{"lora_name": "doll"}')})
        == "LoRA feature is not enabled."
    )
    assert lora_error(hi, json.dumps({"lora_name": "sheep"})) == "LoRA feature is not enabled."
    assert lora_error(hi, {"lora_name": None, "temperature": 0}) is None
    assert lora_error({**hi, "sampling_parameters": s("{broken")}) is None  # parse says why


def test_lora_name_with_lora_on_is_checked_against_the_adapters_and_reaches_sampling_params():
    hi = {"text_input": s("hi")}
    loras = ["doll", "sheep"]
    doll = {**hi, "sampling_parameters": s('{"lora_name": "doll", "temperature": "0"}')}
    assert lora_error(doll, None, loras) is None
    assert parse_request(doll).params.lora_name == "doll"
    assert (
        lora_error(hi, {"lora_name": "bactrian"}, loras)
        == "LoRA bactrian is not supported, we currently support ['doll', 'sheep']"
    )
    assert parse_request(hi, {"lora_name": "sheep"}).params.lora_name == "sheep"


def test_stream_defaults_to_excluding_the_prompt():
    r = parse_request({"text_input": s("hi"), "stream": b(True)})
    assert r.options.stream and r.options.exclude_input_in_output


def test_priority_from_every_source_and_kept_out_of_sampling_params():
    hi = {"text_input": s("hi")}
    assert parse_request(hi).options.priority == 0
    assert parse_request(hi, {"priority": 4}).options.priority == 4  # HTTP generate parameters
    json_inputs = {**hi, "sampling_parameters": s('{"priority": "-2", "max_tokens": 3}')}
    r = parse_request(json_inputs, {"priority": 4})
    assert r.options.priority == -2 and r.params.max_tokens == 3
    tensor = {**json_inputs, "priority": np.array([[7]], np.int64)}
    assert parse_request(tensor).options.priority == 7  # the typed input wins
    for bad in ('{"priority": 1.5}', '{"priority": "high"}', '{"priority": true}'):
        with pytest.raises(BadRequestError, match="priority"):
            parse_request({**hi, "sampling_parameters": s(bad)})
    with pytest.raises(BadRequestError, match="priority"):
        parse_request({**hi, "priority": np.array([1.0], np.float32)})


def test_parsed_priority_orders_the_engine_queue():
    """What model.py does with a parsed request: the priority reaches the scheduler."""
    from slipstream.engine import LLMEngine
    from support import tiny_model_dir

    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir("llama")),
            policy="priority",
            max_num_seqs=1,
            num_gpu_blocks_override=64,
            block_size=4,
        )
    )
    order = []
    for i, priority in enumerate((5, 0)):
        parsed = parse_request(
            {"text_input": s(f"request {i}"), "priority": np.array([priority], np.int32)}
        )
        req = engine.add_request(
            parsed.prompt, parsed.params, request_id=f"r{i}", priority=parsed.options.priority
        )
        assert req.priority == priority
    while engine.has_unfinished():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["r1", "r0"]


@pytest.mark.parametrize(
    "inputs,params,message",
    [
        ({}, None, "missing required input 'text_input'"),
        ({"text_input": s("")}, None, "empty"),
        ({"text_input": np.array([1], np.int32)}, None, "must be BYTES"),
        ({"text_input": s(b"\xff\xfe")}, None, "not valid UTF-8"),
        ({"text_input": s("hi"), "sampling_parameters": s("{bad json")}, None, "not valid JSON"),
        ({"text_input": s("hi"), "sampling_parameters": s("[1]")}, None, "JSON object"),
        (
            {"text_input": s("hi"), "sampling_parameters": s('{"temperature": -1}')},
            None,
            "temperature must be >= 0",
        ),
        (
            {"text_input": s("hi"), "sampling_parameters": s('{"max_tokens": "lots"}')},
            None,
            "max_tokens",
        ),
        ({"text_input": s("hi"), "sampling_parameters": s('{"bogus": 1}')}, None, "bogus"),
        (
            {"text_input": s("hi"), "sampling_parameters": s('{"n": 0}')},
            None,
            "n must be at least 1",
        ),
        ({"text_input": s("hi"), "max_tokens": np.array([1.5], np.float32)}, None, "must be INT32"),
        ({"text_input": s("hi"), "temperature": np.array([1], np.int32)}, None, "must be FP32"),
        ({"text_input": s("hi"), "stream": np.array([1], np.int32)}, None, "must be BOOL"),
        ({"text_input": s("hi"), "top_p": np.array([np.nan], np.float32)}, None, "finite"),
        ({"text_input": s("hi"), "max_tokens": np.array([0], np.int32)}, None, "max_tokens"),
        (
            {"text_input": s("hi"), "stream": b(True), "exclude_input_in_output": b(False)},
            None,
            "When streaming, `exclude_input_in_output` = False is not allowed.",
        ),
        ({"text_input": s("hi"), "image": s("aGk=")}, None, "input 'image' is not supported"),
        ({"text_input": s("hi")}, "{not json", "request parameters are not valid JSON"),
        ({"text_input": s("hi")}, {"stream": "maybe"}, "'stream' must be a boolean"),
        ({"text_input": np.array([b"a", b"b"], dtype=object)}, None, "exactly one element"),
    ],
)
def test_bad_requests(inputs, params, message):
    with pytest.raises(BadRequestError) as err:
        parse_request(inputs, params)
    assert message in str(err.value)


def test_config_parameters_are_valid_engine_settings():
    params = read_parameters((REPO / "slipstream" / "config.pbtxt").read_text())
    engine, server = split_parameters(params)
    assert {
        "model",
        "block_size",
        "kv_cache_memory_bytes",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "enable_chunked_prefill",
        "enable_prefix_caching",
        "batching",
        "max_batch_size",
        "max_queue_delay_ms",
        "policy",
    } <= set(engine)
    EngineConfig.from_dict(engine)  # every engine parameter is a known setting
    assert server["default_max_tokens"] == "16"


def test_set_parameters_replaces_and_appends():
    text = 'name: "m"\nparameters: {\n  key: "a"\n  value: { string_value: "1" }\n}\n'
    out = set_parameters(text, {"a": 2, "b": 'x"y', "c": True})
    assert read_parameters(out) == {"a": "2", "b": 'x"y', "c": "true"}


def test_render_model_repository(tmp_path):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    dst = render_model_repository(
        REPO, tmp_path / "repo", {"block_size": 32, "model": str(model_dir)}
    )
    params = read_parameters((dst / "slipstream" / "config.pbtxt").read_text())
    assert params["block_size"] == "32" and params["model"] == str(model_dir.resolve())
    assert (dst / "slipstream" / "1" / "model.py").exists()
    original = read_parameters((REPO / "slipstream" / "config.pbtxt").read_text())
    assert original["block_size"] == "16"  # the source is untouched


def test_n_and_best_of_parse_from_strings_and_parameters():
    parsed = parse_request(
        {"text_input": s("hi"), "sampling_parameters": s('{"n": "3", "best_of": "4"}')}
    )
    assert (parsed.params.n, parsed.params.best_of) == (3, 4)
    assert parse_request({"text_input": s("hi")}, {"n": 2}).params.n == 2


def _out(index, text, token_ids, finish_reason=None, finished=False, cum=0.0):
    from slipstream.core.request import RequestOutput, TokenLogprob

    return RequestOutput(
        "r",
        text,
        list(token_ids),
        [TokenLogprob(-1.0, 1, ())] * len(token_ids),
        finished,
        finish_reason,
        num_prompt_tokens=2,
        cumulative_logprob=cum,
        index=index,
    )


def test_n_sequences_are_returned_one_element_per_index():
    from slipstream.server.stub.responses import ResponseBuilder

    options = dict(
        return_finish_reason=True, return_num_output_tokens=True, return_cumulative_logprob=True
    )
    parsed = parse_request({"text_input": s("hi"), "sampling_parameters": s('{"n": 2}')}, options)
    builder = ResponseBuilder(parsed)
    builder.absorb(_out(1, " b", [5], cum=-1.0))
    builder.absorb(_out(0, " a", [4], "length", cum=-2.0))
    out = builder.final(_out(1, "!", [6], "stop", finished=True, cum=-3.0))
    assert out["text_output"].tolist() == [b"hi a", b"hi b!"]
    assert out["finish_reason"].tolist() == [b"length", b"stop"]
    assert out["num_output_tokens"].tolist() == [1, 2]
    assert out["cumulative_logprob"].tolist() == [-2.0, -3.0]
    stream = ResponseBuilder(
        parse_request(
            {
                "text_input": s("hi"),
                "stream": np.array([True]),
                "sampling_parameters": s('{"n": 2}'),
            },
            options,
        )
    )
    first = stream.streamed(_out(1, " b", [5], cum=-1.0))
    assert first["text_output"].tolist() == [b"", b" b"]
    assert first["finish_reason"].tolist() == [b"None", b"None"]
    assert first["num_output_tokens"].tolist() == [0, 1]
