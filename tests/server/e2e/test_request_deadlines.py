"""A request cannot run for ever: Triton's per-request ``timeout`` and the server-wide
``max_request_seconds`` end it with a clear error and free its KV blocks. This is also what
bounds a dropped non-streaming HTTP ``generate``, which Triton 2.51 never tells the model
about (docs/robustness.md)."""

import json
import os
import queue
import socket
import time

import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")

from slipstream.server.launch.launcher import TritonServer  # noqa: E402
from slipstream.server.launch.repository import render_model_repository  # noqa: E402
from slipstream.server.stub.deadlines import request_deadline  # noqa: E402
from server_support import OVERRIDES, REPO, http_post, metrics, text_inputs, wait_metric  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("SLIPSTREAM_SKIP_SERVER_TESTS") == "1", reason="SLIPSTREAM_SKIP_SERVER_TESTS=1"
)
ENDLESS = {"temperature": 0, "max_tokens": 1000, "ignore_eos": True}


def test_the_earliest_limit_wins():
    assert request_deadline(10.0, 0, {}, 0) is None
    assert request_deadline(10.0, 0, {"timeout": "abc"}, 0) is None
    own = request_deadline(10.0, 500_000, {}, 3)
    assert (own.at, own.source) == (10.5, "the request's timeout")
    assert request_deadline(10.0, 0, '{"timeout": 5000000}', 3).source == "max_request_seconds"
    assert request_deadline(10.0, 0, {"timeout": 250_000}, 0).at == 10.25
    assert "past max_request_seconds (3 s)" in request_deadline(0, 0, {}, 3).message(3.2)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    repo = render_model_repository(
        REPO,
        tmp_path_factory.mktemp("deadline") / "repo",
        # well under what ENDLESS takes (1,000 tokens of the tiny model: ~1 s, and falling as
        # the engine gets faster: at 1 s the limit stopped being reached)
        {"model": str(tiny_model), **OVERRIDES, "max_request_seconds": 0.4},
    )
    with TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0, startup_timeout=300) as srv:
        yield srv


@pytest.mark.server
@pytest.mark.slow
def test_max_request_seconds_ends_a_long_generate_with_a_clear_error(server):
    """Before: a 1000-token request ran to its end however long that took."""
    started = time.monotonic()
    status, body = http_post(
        server, "/v2/models/slipstream/generate", {"text_input": "x", "parameters": ENDLESS}
    )
    took = time.monotonic() - started
    assert status == 400 and "request timed out" in body and "max_request_seconds (0.4 s)" in body
    assert took < 5, took
    wait_metric(server, "slipstream_kv_blocks_used", lambda v: v == 0)


@pytest.mark.server
@pytest.mark.slow
def test_the_requests_own_timeout_is_honoured_over_http_and_grpc(server):
    status, body = http_post(
        server,
        "/v2/models/slipstream/generate",
        {"text_input": "x", "parameters": {**ENDLESS, "timeout": 200_000}},
    )
    assert status == 400 and "past the request's timeout (0.2 s)" in body, body
    results = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put(error))
    client.async_stream_infer(
        "slipstream",
        text_inputs("y", sampling=ENDLESS),
        enable_empty_final_response=True,
        timeout=300_000,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            error = results.get(timeout=30)
            if error is not None:
                break
        assert error is not None and "past the request's timeout (0.3 s)" in str(error)
    finally:
        client.stop_stream()
        client.close()


@pytest.mark.server
@pytest.mark.slow
def test_a_dropped_non_streaming_generate_stops_at_max_request_seconds(server):
    """The drop itself is invisible to the model (Triton 2.51); the limit bounds the waste.
    Before: 5,000 tokens were generated for 50 dropped requests."""
    body = json.dumps({"text_input": "x", "parameters": ENDLESS}).encode()
    host, port = server.http_url.split(":")
    for _ in range(3):
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(
                b"POST /v2/models/slipstream/generate HTTP/1.1\r\nHost: t\r\n"
                b"Content-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            time.sleep(0.05)
    wait_metric(server, "slipstream_requests_running", lambda v: v == 3, timeout=5)
    dropped = time.monotonic()
    wait_metric(server, "slipstream_requests_running", lambda v: v == 0, timeout=10)
    assert time.monotonic() - dropped < 3
    assert metrics(server)["slipstream_kv_blocks_used"] == 0
