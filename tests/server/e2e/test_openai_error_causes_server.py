"""Each server-side cause of a failed request, in flight through a real tritonserver (tiny
model, a forward made to raise or hang), reaches the OpenAI client with its status: an
internal error 500, the server's ``max_request_seconds`` 504, a hung engine 503 with a
Retry-After, a server shutting down 503 without one. A stream that already sent tokens ends
with an error event whose ``code`` is that status.

Before: all of these were HTTP 400 (only "the engine is not serving" was 503), so routers and
SDKs, which retry 5xx but never 400, lost them."""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from slipstream.server.openai.errors import ENGINE_RETRY_AFTER_S
from slipstream.server.openai.frontend import OpenAIFrontend
from fault_support import faulty_server
from support import need_tritonserver, tiny_model_dir

pytestmark = [pytest.mark.slow, pytest.mark.server]

REPO = Path(__file__).resolve().parents[3] / "model_repository"
MODEL = "slipstream"
PROMPT = "The capital of France is"
OVERRIDES = {
    "kv_cache_memory_bytes": 8 * 1024 * 1024,
    "max_model_len": 1024,
    "max_num_seqs": 8,
    "metrics_interval_ms": 100,
}
LONG = {"max_tokens": 900, "ignore_eos": True}


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """(the OpenAI frontend, the fault file): steps hang for 2 s at most, requests end after
    8 s."""
    need_tritonserver()
    server, fault = faulty_server(
        REPO,
        tiny_model_dir("llama"),
        tmp_path_factory.mktemp("causes"),
        {**OVERRIDES, "step_timeout_s": 2, "max_request_seconds": 8},
        exit_timeout=5,
    )
    try:
        with OpenAIFrontend.for_repository(server.model_repository, server.grpc_url) as front:
            yield front, fault
    finally:
        server.kill()


def client(front) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{front.url}/v1", api_key="none", max_retries=0)


def stream_until_error(front, body: dict, on_tokens=None) -> tuple[int, dict]:
    """Stream ``body``; call ``on_tokens`` once three events have come; (events with text
    before the error, the error event)."""
    conn = http.client.HTTPConnection(front.host, front.port, timeout=120)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps({"model": MODEL, "prompt": PROMPT, "stream": True, **body}),
        {"Content-Type": "application/json"},
    )
    response = conn.getresponse()
    assert response.status == 200
    texts = 0
    try:
        while True:
            line = response.readline()
            if not line:
                raise AssertionError("the stream ended without an error event")
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return texts, event["error"]
            texts += 1
            if texts == 3 and on_tokens is not None:
                on_tokens()
    finally:
        conn.close()


def test_an_internal_error_is_500_whole_and_in_a_stream(faulty):
    front, fault = faulty
    fault.write_text("raise")
    try:
        with pytest.raises(openai.InternalServerError) as e:
            client(front).completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
        assert "injected fault" in e.value.message and "retry-after" not in e.value.response.headers
    finally:
        fault.write_text("")
    texts, error = stream_until_error(front, LONG, on_tokens=lambda: fault.write_text("raise"))
    fault.write_text("")
    assert texts >= 3 and error["code"] == 500 and "injected fault" in error["message"]
    assert client(front).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices


def test_max_request_seconds_is_504_whole_and_in_a_stream(faulty):
    """Steps slowed to 0.1 s: the tiny model would write 900 tokens in about 2 s, and
    speculation can take five a step, so 180 steps at least: 18 s, past the 8 s limit."""
    front, fault = faulty
    fault.write_text("slow 0.1")
    try:
        with pytest.raises(openai.APIStatusError) as e:
            client(front).completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=900, extra_body={"ignore_eos": True}
            )
        assert e.value.status_code == 504 and "max_request_seconds" in e.value.message
        texts, error = stream_until_error(front, LONG)
    finally:
        fault.write_text("")
    assert texts >= 3 and error["code"] == 504 and "max_request_seconds" in error["message"]


def test_a_hung_engine_is_503_with_retry_after_whole_and_in_a_stream(faulty):
    """Last: a hung engine cannot be recovered (the server goes away)."""
    front, fault = faulty
    for _ in range(4):  # past the first steps, which get a longer timeout
        client(front).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    whole: dict = {}

    def send_whole() -> None:
        try:
            client(front).completions.create(model=MODEL, prompt=PROMPT, **{"max_tokens": 900})
        except openai.APIStatusError as e:
            whole.update(status=e.status_code, headers=e.response.headers, message=e.message)

    waiting = threading.Thread(target=send_whole)

    def hang() -> None:
        waiting.start()
        time.sleep(0.5)
        fault.write_text("block")

    texts, error = stream_until_error(front, LONG, on_tokens=hang)
    waiting.join(60)
    assert texts >= 3 and error["code"] == 503 and "hung" in error["message"]
    assert whole["status"] == 503 and "engine failed" in whole["message"]
    assert whole["headers"]["retry-after"] == str(ENGINE_RETRY_AFTER_S)


def test_a_server_shutting_down_is_503_without_retry_after(tmp_path):
    need_tritonserver()
    server, fault = faulty_server(
        REPO, tiny_model_dir("llama"), tmp_path, OVERRIDES, exit_timeout=6
    )
    try:
        with OpenAIFrontend.for_repository(server.model_repository, server.grpc_url) as front:
            sdk = client(front)
            sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
            fault.write_text("slow 0.1")  # the long request is still running at the stop

            def long_request():
                try:
                    sdk.completions.create(
                        model=MODEL, prompt=PROMPT, max_tokens=900, extra_body={"ignore_eos": True}
                    )
                except openai.APIStatusError as e:
                    return e
                return None

            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(long_request)
                time.sleep(1.0)
                server.stop()
                error = pending.result(timeout=60)
    finally:
        server.kill()
    assert error is not None and error.status_code == 503, error
    assert "shutting down" in error.message and "retry-after" not in error.response.headers
