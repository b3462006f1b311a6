"""One request never harms another, through a real tritonserver (tiny random llama, one
server for the module): each class of value that used to fail a whole engine step, or to
slow every other request down, runs beside a greedy stream that must come out
byte-identical to its solo run, and gets a clear error of its own (or is served safely)."""

import json
import os
import socket
import threading
import time

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")

from slipstream.server.launch.launcher import TritonServer  # noqa: E402
from slipstream.server.launch.repository import render_model_repository  # noqa: E402
from server_support import (  # noqa: E402
    MAX_MODEL_LEN,
    MODEL,
    OVERRIDES,
    REPO,
    StreamClient,
    http_post,
    run_stream,
    text_inputs,
    texts,
    wait_metric,
)

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(
        os.environ.get("SLIPSTREAM_SKIP_SERVER_TESTS") == "1",
        reason="SLIPSTREAM_SKIP_SERVER_TESTS=1",
    ),
]

GOOD_PROMPT = "Paged attention stores keys and values in blocks"
GOOD = {"temperature": 0, "max_tokens": 60, "ignore_eos": True}
VOCAB = 49152  # the tiny model uses SmolLM2's tokenizer


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    repo = render_model_repository(
        REPO,
        tmp_path_factory.mktemp("repo") / "model_repository",
        {"model": str(tiny_model), **OVERRIDES},
    )
    with TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0, startup_timeout=300) as srv:
        yield srv


@pytest.fixture(scope="module")
def solo(server):
    """The greedy stream's text when it runs alone on this server."""
    results, error = run_stream(server, text_inputs(GOOD_PROMPT, sampling=GOOD))
    assert error is None
    return "".join(texts(results))


def nested(depth):
    return "[" * depth + "]" * depth


# name -> (inputs of the other request, text its error must contain; None = it must succeed)
CLASSES = {
    "temperature 1e-300 (greedy)": (dict(sampling={"temperature": 1e-300, "max_tokens": 8}), None),
    "repetition_penalty 1e-300": (
        dict(sampling={"temperature": 1, "repetition_penalty": 1e-300, "max_tokens": 8}),
        "repetition_penalty",
    ),
    "seed 2**64": (dict(sampling={"seed": 2**64, "temperature": 1}), "seed must be"),
    "seed -2**63-1": (dict(sampling={"seed": -(2**63) - 1, "temperature": 1}), "seed must be"),
    "stop_token_ids 10**12": (
        dict(sampling={"stop_token_ids": [10**12], "min_tokens": 2}),
        "vocabulary size",
    ),
    "stop_token_ids = vocab size": (
        dict(sampling={"stop_token_ids": [VOCAB], "min_tokens": 2}),
        "vocabulary size",
    ),
    "typed end_id 2**31-1": (
        dict(sampling={"min_tokens": 2}, end_id=np.array([2**31 - 1], np.int32)),
        "vocabulary size",
    ),
    "sampling_parameters nested 100,000 deep": (
        dict(sampling=nested(100_000)),
        "nested too deeply",
    ),
    "100,000 stop strings (1.4 MB)": (
        dict(sampling={"stop": [f"stop{i}" for i in range(100_000)]}),
        "at most",
    ),
    "65 stop strings": (dict(sampling={"stop": [f"s{i}" for i in range(65)]}), "at most 64"),
    "a 1,000-character stop string": (dict(sampling={"stop": ["x" * 1000]}), "at most 256"),
    "100,000 typed stop_words": (
        dict(stop_words=np.array([b"w%d" % i for i in range(100_000)], dtype=object)),
        "at most 64",
    ),
    "8 MB prompt": (dict(prompt="word " * (8 * 1024 * 1024 // 5)), "bytes"),
    "prompt over max_model_len": (dict(prompt="word " * (MAX_MODEL_LEN + 50)), "max_model_len"),
}


@pytest.mark.parametrize("kind", list(CLASSES))
def test_bad_value_fails_alone_beside_a_byte_identical_greedy_stream(server, solo, kind):
    extra, expected_error = CLASSES[kind]
    extra = dict(extra)
    prompt = extra.pop("prompt", "hello there")
    good = StreamClient(server.grpc_url)
    try:
        good.send("good", text_inputs(GOOD_PROMPT, sampling=GOOD))
        first = good.queues["good"].get(timeout=60)  # the stream is running
        started = time.monotonic()
        results, error = run_stream(server, text_inputs(prompt, **extra))
        answered_in = time.monotonic() - started
        if expected_error is None:
            assert error is None, str(error)
            assert texts(results)
        else:
            assert error is not None, f"{kind}: no error, got {texts(results)}"
            assert expected_error in str(error), str(error)
            assert len(str(error)) < 500
        rest = good.responses("good")
        assert good.errors.empty()
        assert "".join(texts([first] + rest)) == solo
        assert answered_in < 10, f"{kind} took {answered_in:.1f} s to answer"
    finally:
        good.close()
    wait_metric(server, "slipstream_kv_blocks_used", lambda v: v == 0)


def test_hostile_request_does_not_slow_a_greedy_stream(server, solo):
    """The stream's time with a hostile request beside it stays within 3x of its solo time
    (it was 18-97x with 100,000 stop strings, and 7-25 s of stall behind an 8 MB prompt)."""

    def timed(hostile):
        good = StreamClient(server.grpc_url)
        try:
            started = time.monotonic()
            good.send("good", text_inputs(GOOD_PROMPT, sampling=GOOD))
            good.queues["good"].get(timeout=60)
            if hostile:
                for body in (
                    {"stop": [f"stop{i}" for i in range(100_000)]},
                    {"stop": ["ab"] * 64, "max_tokens": 60},
                ):
                    run_stream(server, text_inputs("hello", sampling=body))
                run_stream(server, text_inputs("word " * (8 * 1024 * 1024 // 5)))
            text = "".join(texts(good.responses("good")))
            return time.monotonic() - started, text
        finally:
            good.close()

    alone, _ = timed(False)
    beside, text = timed(True)
    assert beside < 3 * alone + 2, (alone, beside)


def test_a_failed_start_names_the_model_load_error(tmp_path):
    """What a refused setting (here max_model_len above the model's positions, refused by the
    engine at load: tests/engine/test_request_validation.py) looks like to whoever started Triton:
    the model's own error, read from Triton's log, not only the log's tail."""
    log = tmp_path / "triton.log"
    log.write_text(
        "E1123 19:56:07.078239 2385 model_lifecycle.cc:642] \"failed to load 'slipstream' "
        "version 1: Internal: ValueError: max_model_len 512 is larger than the model's position "
        "limit 64 (max_position_embeddings in its config.json): set max_model_len <= 64\\n\\nAt:"
        '\\n  model_loader.py(141): fit_max_model_len"\n'
    )
    server = TritonServer(REPO, http_port=1, grpc_port=1, metrics_port=1, log_path=log)
    assert server.log.load_errors() == [
        (
            "slipstream",
            "ValueError: max_model_len 512 is larger than "
            "the model's position limit 64 (max_position_embeddings in "
            "its config.json): set max_model_len <= 64",
        )
    ]


def test_http_typed_input_names_with_string_values_are_triton_conversion_errors(server):
    """Documents Triton 2.51: a ``parameters`` key that names a typed input (max_tokens,
    temperature, seed, ...) is converted by Triton's HTTP frontend to that input's type
    before the model sees the request, and a value of another JSON type is answered 500
    there. The same values are accepted in ``sampling_parameters``."""
    path = f"/v2/models/{MODEL}/generate"
    status, body = http_post(server, path, {"text_input": "hi", "parameters": {"max_tokens": "3"}})
    assert status == 500 and "Converting keyword: 'parameters'" in body
    status, body = http_post(
        server,
        path,
        {
            "text_input": "hi",
            "exclude_input_in_output": True,
            "sampling_parameters": json.dumps(
                {"max_tokens": "3", "temperature": "0", "seed": str(2**64 - 1)}
            ),
        },
    )
    assert status == 200, body
    status, body = http_post(
        server, path, {"text_input": "hi", "sampling_parameters": json.dumps({"seed": str(2**64)})}
    )
    assert status == 400 and "seed must be" in json.loads(body)["error"]


def test_dropped_generate_stream_connection_is_cancelled(server):
    """An HTTP generate_stream client that goes away is cancelled (Triton resets the request
    once a chunk cannot be written) and its KV blocks are freed; a dropped non-streaming
    generate cannot be seen (see docs/robustness.md)."""
    wait_metric(server, "slipstream_kv_blocks_used", lambda v: v == 0)
    host, port = server.http_url.split(":")
    body = json.dumps(
        {
            "text_input": "tell me a long story",
            "stream": True,
            "parameters": {"temperature": 0, "max_tokens": 400, "ignore_eos": True},
        }
    ).encode()
    socks = []
    for _ in range(3):
        s = socket.create_connection((host, int(port)))
        s.sendall(
            b"POST /v2/models/%s/generate_stream HTTP/1.1\r\nHost: t\r\nContent-Type: "
            b"application/json\r\nContent-Length: %d\r\n\r\n" % (MODEL.encode(), len(body)) + body
        )
        assert s.recv(64).startswith(b"HTTP/1.1 200")
        socks.append(s)
    wait_metric(server, "slipstream_requests_running", lambda v: v >= 3)
    for s in socks:
        s.close()
    wait_metric(server, "slipstream_requests_running", lambda v: v == 0, timeout=30)
    wait_metric(server, "slipstream_kv_blocks_used", lambda v: v == 0)


def test_concurrent_bad_requests_leave_no_blocks_and_good_ones_finish(server, solo):
    """A burst of every bad class at once beside three greedy streams."""
    good = StreamClient(server.grpc_url)
    errors = []

    def bad(kind):
        extra = dict(CLASSES[kind][0])
        prompt = extra.pop("prompt", "hello there")
        _, error = run_stream(server, text_inputs(prompt, **extra))
        errors.append((kind, error))

    try:
        for i in range(3):
            good.send(f"g{i}", text_inputs(GOOD_PROMPT, sampling=GOOD))
        threads = [threading.Thread(target=bad, args=(k,)) for k in CLASSES if CLASSES[k][1]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(errors) == len(threads)
        assert [kind for kind, e in errors if e is None] == []
        for i in range(3):
            assert "".join(texts(good.responses(f"g{i}"))) == solo
        assert good.errors.empty()
    finally:
        good.close()
    wait_metric(server, "slipstream_kv_blocks_used", lambda v: v == 0)
