"""Structured outputs through a real tritonserver (tiny random model: only the grammar makes
its output valid): vLLM's and TensorRT-LLM's request shapes in one batch with free streams,
which must answer as if alone; an invalid schema is INVALID_ARG for that request only."""

import json
import os
import re

import jsonschema
import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")
pytest.importorskip("llguidance")

from slipstream import EngineConfig, SamplingParams  # noqa: E402
from slipstream.engine.loop import EngineLoop  # noqa: E402
from slipstream.server.launch.config_pbtxt import read_parameters  # noqa: E402
from slipstream.server.stub.model_config import split_parameters  # noqa: E402
from server_support import MODEL, PROMPTS, StreamClient, http_post, run_stream, text_inputs, texts  # noqa: E402

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(
        os.environ.get("SLIPSTREAM_SKIP_SERVER_TESTS") == "1",
        reason="SLIPSTREAM_SKIP_SERVER_TESTS=1",
    ),
]

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{1,8} [0-9]{2}"
CHOICES = ["Positive", "Negative", "Neutral"]
BASE = {"temperature": 0, "max_tokens": 100}
FINISH = {"return_finish_reason": np.array([True])}
FREE = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def reference(repo):
    """prompt -> the engine's greedy text for it alone (only the prompts asked for)."""
    engine_settings, _ = split_parameters(
        read_parameters((repo / MODEL / "config.pbtxt").read_text())
    )
    loop = EngineLoop(EngineConfig.from_dict(engine_settings)).start()
    cache = {}

    def get(prompt, **params):
        key = (prompt, tuple(sorted(params.items())))
        if key not in cache:
            cache[key] = loop.generate(prompt, SamplingParams.from_dict(params)).text
        return cache[key]

    try:
        yield get
    finally:
        loop.shutdown()


def s(text):
    return np.array([text.encode()], dtype=object)


# request id -> (inputs, check of the whole text)
def constrained_requests():
    def valid_json(text):
        jsonschema.validate(json.loads(text), SCHEMA)

    return {
        "vllm-json": (
            text_inputs(
                PROMPTS[0],
                sampling={
                    **BASE,
                    "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True},
                },
                **FINISH,
            ),
            valid_json,
        ),
        "vllm-legacy-regex": (
            text_inputs(PROMPTS[1], sampling={**BASE, "guided_regex": REGEX}, **FINISH),
            lambda t: re.fullmatch(REGEX, t) or pytest.fail(t),
        ),
        "vllm-choice-json-string": (
            text_inputs(
                PROMPTS[2],
                sampling={**BASE, "structured_outputs": json.dumps({"choice": CHOICES})},
                **FINISH,
            ),
            lambda t: t in CHOICES or pytest.fail(t),
        ),
        "trtllm-json-schema": (
            text_inputs(
                PROMPTS[3],
                sampling=BASE,
                guided_decoding_guide_type=s("json_schema"),
                guided_decoding_guide=s(json.dumps(SCHEMA)),
            ),
            valid_json_prefix_or_whole,
        ),
        "trtllm-ebnf": (
            text_inputs(
                PROMPTS[4],
                sampling=BASE,
                guided_decoding_guide_type=s("ebnf_grammar"),
                guided_decoding_guide=s('root ::= "[" [0-9]+ "]"'),
                **FINISH,
            ),
            lambda t: re.fullmatch(r"\[[0-9]+\]", t) or pytest.fail(t),
        ),
    }


def valid_json_prefix_or_whole(text):
    """Flexible whitespace (TensorRT-LLM's and vLLM's default): a random model may spend its
    tokens on whitespace, so the text is the schema's JSON or, if cut by max_tokens, the start
    of one (nothing the grammar forbids)."""
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except json.JSONDecodeError:
        assert text.lstrip().startswith("{"), text


def test_constrained_and_free_streams_share_batches_through_triton(server, reference):
    client = StreamClient(server.grpc_url)
    requests = constrained_requests()
    free = {f"free-{i}": PROMPTS[5 + i] for i in range(3)}
    try:
        for rid, (inputs, _) in requests.items():
            client.send(rid, inputs)
        for rid, prompt in free.items():
            client.send(rid, text_inputs(prompt, sampling=FREE))
        got = {rid: client.responses(rid) for rid in [*requests, *free]}
        assert client.errors.empty(), client.errors.get()
    finally:
        client.close()
    for rid, (_, check) in requests.items():
        check("".join(texts(got[rid])))
    for rid in ("vllm-json", "vllm-legacy-regex", "vllm-choice-json-string", "trtllm-ebnf"):
        reasons = [r.as_numpy("finish_reason") for r in got[rid]]
        assert [x.reshape(-1)[0] for x in reasons if x is not None][-1] == b"stop", rid
    for rid, prompt in free.items():  # free streams answer exactly as when alone
        assert "".join(texts(got[rid])) == reference(prompt, **FREE)


@pytest.mark.parametrize(
    "sampling, extra, message",
    [
        ({"structured_outputs": {"json": {"type": "bogus"}}}, {}, "invalid JSON schema"),
        ({"guided_regex": "a(b"}, {}, "invalid regex"),
        (
            {},
            {"guided_decoding_guide_type": "xml", "guided_decoding_guide": "<a/>"},
            "guided_decoding_guide_type must be one of",
        ),
        (
            {"guided_json": SCHEMA, "guided_choice": ["a"]},
            {},
            "You can only use one kind of structured outputs constraint",
        ),
    ],
)
def test_invalid_structured_request_is_invalid_arg_and_fails_alone(
    server, reference, sampling, extra, message
):
    prompt = PROMPTS[8]
    good = StreamClient(server.grpc_url)
    try:
        good.send("good", text_inputs(prompt, sampling=FREE))
        typed = {k: s(v) for k, v in extra.items()}
        results, error = run_stream(
            server, text_inputs("hi", sampling={**BASE, **sampling}, **typed)
        )
        assert error is not None and message in str(error), (texts(results), error)
        assert "".join(texts(good.responses("good"))) == reference(prompt, **FREE)
        assert good.errors.empty()
    finally:
        good.close()
    # Over HTTP the status shows Triton's code: INVALID_ARG is 400.
    status, body = http_post(
        server,
        f"/v2/models/{MODEL}/generate",
        {"text_input": "hi", **extra, "sampling_parameters": json.dumps({**BASE, **sampling})},
    )
    assert status == 400 and message in json.loads(body)["error"], body


def test_http_generate_with_response_format_and_guided_choice(server):
    # Triton's HTTP "parameters" hold scalars only: objects and lists go as JSON text.
    status, body = http_post(
        server,
        f"/v2/models/{MODEL}/generate",
        {"text_input": "Is it good?", "parameters": {**BASE, "guided_choice": json.dumps(CHOICES)}},
    )
    assert status == 200 and json.loads(body)["text_output"] in [f"Is it good?{c}" for c in CHOICES]
    status, body = http_post(
        server,
        f"/v2/models/{MODEL}/generate",
        {
            "text_input": "JSON:",
            "exclude_input_in_output": True,
            "parameters": {
                **BASE,
                "max_tokens": 60,
                "response_format": json.dumps(
                    {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
                ),
            },
        },
    )
    assert status == 200, body
    valid_json_prefix_or_whole(json.loads(body)["text_output"])
