"""The OpenAI port probed as a hostile or careless client would, through a real tritonserver
(tiny model): every error in OpenAI's error object (bodies that do not parse included),
``max_tokens`` past the context refused naming the limit, body and header limits, slow
headers, slow bodies and streams nobody reads, disconnect storms, and a disconnected request
(streamed or not) freeing its KV blocks at once; bad requests harm no other request.

Each test says what happened before (the probe's "before")."""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from slipstream.server.launch.launcher import TritonServer
from slipstream.server.openai.api_settings import ApiSettings
from slipstream.server.openai.frontend import OpenAIFrontend
from support import need_tritonserver
from vllm_backend_support import write_model

pytestmark = [pytest.mark.slow, pytest.mark.server]

MODEL = "tiny"
PROMPT = "The capital of France is"
LIMITS = ApiSettings(
    max_body_bytes=64 * 1024,
    max_header_bytes=8 * 1024,
    body_timeout_s=2.0,
    header_timeout_s=2.0,
    send_timeout_s=2.0,
)


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("openai_probes")
    write_model(repo, MODEL, parameters={"metrics_interval_ms": "100"})
    return repo


@pytest.fixture(scope="module")
def server(repo):
    need_tritonserver()
    with TritonServer(
        repo,
        http_port=0,
        grpc_port=0,
        metrics_port=0,
        models=[MODEL],
        startup_timeout=600,
        log_verbose=1,  # Triton then logs each gRPC cancellation it receives
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def front(repo, server):
    with OpenAIFrontend.for_repository(repo, server.grpc_url, settings=LIMITS) as f:
        yield f


@pytest.fixture(scope="module")
def client(front):
    return openai.OpenAI(base_url=f"{front.url}/v1", api_key="none", max_retries=0)


def metric(server, name: str) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and s.labels.get("model_name") == MODEL
    )


def settles(server, timeout: float = 20.0) -> bool:
    """Whether, within ``timeout``, nothing runs and no KV block is used."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not metric(server, "vllm:num_requests_running") and not metric(
            server, "vllm:kv_cache_usage_perc"
        ):
            return True
        time.sleep(0.2)
    return False


def raw(front, data: bytes, timeout: float = 30.0) -> tuple[int, dict]:
    """Send bytes as they are; (status, JSON body)."""
    with socket.create_connection((front.host, front.port), timeout=timeout) as sock:
        sock.sendall(data)
        received = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
            head, _, body = received.partition(b"\r\n\r\n")
            length = [
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ]
            if length and len(body) >= length[0]:
                break
    head, _, body = received.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


def request_bytes(path: str, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n".encode()
        + b"Content-Type: "
        + content_type
        + b"\r\nConnection: close\r\n\r\n"
        + body
    )


def request_threads() -> int:
    """Threads but the event loop's executor pool (its few workers stay, by design)."""
    return len([t for t in threading.enumerate() if not t.name.startswith("asyncio_")])


def frontend_tasks(front) -> int:
    loop = front.api.loop
    return len([t for t in asyncio.all_tasks(loop) if not t.done()])


# ------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "body, status, words",
    [
        (b"[" * 10_000 + b"]" * 10_000, 400, "parsing the body"),  # before: {"detail": ...}
        (b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, "parsing the body"),  # invalid UTF-8
        (b"{not json", 400, "JSON decode error"),
        (b'{"model": "tiny", "prompt": "x", "max_tokens": "many"}', 400, "max_tokens"),
        (b'{"model": 7, "prompt": "x"}', 400, "model"),
        (b'{"model": "tiny", "prompt": {"a": 1}}', 400, "prompt"),
        (b'{"model": "tiny", "prompt": "x", "n": 0}', 400, "n must be at least 1"),
    ],
)
def test_every_bad_body_is_an_openai_error_object(front, body, status, words):
    got, answer = raw(front, request_bytes("/v1/completions", body))
    assert got == status, answer
    assert set(answer) == {"error"} and answer["error"]["code"] == status
    assert words in answer["error"]["message"]


@pytest.mark.parametrize(
    "method, path, status",
    [("GET", "/v1/nothing", 404), ("DELETE", "/v1/completions", 405)],
)
def test_unknown_routes_and_methods_are_openai_error_objects(front, method, path, status):
    conn = http.client.HTTPConnection(front.host, front.port, timeout=10)
    conn.request(method, path)
    response = conn.getresponse()
    answer = json.loads(response.read())
    assert response.status == status and answer["error"]["code"] == status


def test_max_tokens_past_the_context_is_a_400_naming_the_limit(front, client):
    """Before: max_tokens 10**12 was served, silently capped at the context."""
    limit = client.models.list().data[0].model_extra["max_model_len"]
    for call in (
        lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10**12),
        lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=limit
        ),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert f"maximum context length is {limit} tokens" in e.value.message
        assert "'max_tokens' or 'max_completion_tokens' is too large" in e.value.message
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=limit - 10)
    assert answer.choices[0].finish_reason in ("length", "stop")


def test_bad_requests_of_every_kind_harm_no_other_request(front, client):
    reference = (
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=40,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    bad = [
        b"[" * 10_000,
        b"\xff" * 100,
        b'{"model": "tiny", "prompt": "x", "top_p": 7}',
        b'{"model": "tiny", "prompt": "x", "logit_bias": {"x": 1}}',
        b'{"model": "tiny", "prompt": "x", "max_tokens": 99999999999}',
    ]
    with ThreadPoolExecutor(6) as pool:
        good = pool.submit(
            lambda: "".join(
                c.choices[0].text
                for c in client.completions.create(
                    model=MODEL,
                    prompt=PROMPT,
                    max_tokens=40,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
            )
        )
        statuses = list(
            pool.map(lambda b: raw(front, request_bytes("/v1/completions", b))[0], bad * 4)
        )
        assert good.result(timeout=120) == reference
    assert all(400 <= s < 500 for s in statuses), statuses


# ------------------------------------------------------------------------ limits
def test_a_body_past_the_limit_is_a_413_before_it_is_read(front):
    """Before: no limit (any size was read into memory)."""
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {10**9}\r\n\r\n".encode()
    )
    status, answer = raw(front, head)  # no body sent at all: refused on the header
    assert status == 413 and "larger than the limit of 65536 bytes" in answer["error"]["message"]
    chunked = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"".join(b"%x\r\n%s\r\n" % (4096, b"a" * 4096) for _ in range(20))
    )
    status, answer = raw(front, chunked)
    assert status == 413


def test_headers_past_the_limit_are_refused_and_a_malformed_request_is_a_400(front):
    """Before: 20 KB of headers read in one piece passed h11's limit, which counts only
    what is incomplete after a read; a malformed request got uvicorn's plain text."""
    big = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n"
    status, answer = raw(front, big)
    assert status == 431 and answer["error"]["code"] == 431
    status, answer = raw(front, b"NOT HTTP AT ALL\r\n\r\n")
    assert status == 400 and answer["error"]["code"] == 400
    small = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 30000\r\n\r\n"
    status, answer = raw(front, small + b"{" * 30000)  # a large body with small headers
    assert status == 400 and answer["error"]["code"] == 400


def test_slow_headers_and_a_slow_body_hold_nothing(front, client):
    """Before: a client sending its headers or body slowly kept its connection for ever."""
    slow_headers = socket.create_connection((front.host, front.port), timeout=30)
    slow_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    slow_body = socket.create_connection((front.host, front.port), timeout=30)
    slow_body.sendall(request_bytes("/v1/completions", b"{" + b" " * 99)[:-90])
    started = time.monotonic()
    # the server answers others meanwhile
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices
    assert slow_headers.recv(1024) == b""  # closed by the server
    assert time.monotonic() - started < 15
    answer = slow_body.recv(65536)
    assert b" 408 " in answer.split(b"\r\n")[0] and b"not received within" in answer
    slow_headers.close()
    slow_body.close()


def test_a_stream_nobody_reads_is_dropped_and_its_request_cancelled(server, front):
    """Before: a client that stopped reading kept its generation and buffers for ever."""
    before = metric(server, "vllm:generation_tokens_total")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((front.host, front.port))
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": PROMPT,
            "max_tokens": 900,
            "stream": True,
            "ignore_eos": True,
            "logprobs": 20,  # fat events: the buffers fill in a few tokens
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
    ).encode()
    sock.sendall(request_bytes("/v1/completions", body))
    assert settles(server, timeout=60)
    generated = metric(server, "vllm:generation_tokens_total") - before
    assert generated < 900, generated
    sock.close()


# ------------------------------------------------------------------------ disconnects
CANCELLED = "Issuing cancellation"  # Triton's verbose log, for each gRPC call cancelled


def test_a_finished_request_is_never_cancelled_an_unfinished_one_is(server, front, client):
    """Before: every gRPC call was cancelled once read, finished or not (Triton 2.51 can then
    keep the model loaded at exit): 9 cancellation lines for 6 finished requests."""
    start = len(server.log_path.read_text())
    for stream in (False, True, False, True):
        answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, stream=stream)
        if stream:
            assert [c for c in answer]
    time.sleep(1)
    assert CANCELLED not in server.log_path.read_text()[start:]
    conn = open_request(
        front, {"model": MODEL, "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True}
    )
    wait_running(server)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    assert settles(server)
    assert CANCELLED in server.log_path.read_text()[start:]


def open_request(front, body: dict) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection(front.host, front.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn


def wait_running(server, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not metric(server, "vllm:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "vllm:num_requests_running") >= 1


@pytest.mark.parametrize("stream", [True, False])
def test_a_disconnect_frees_the_requests_kv_blocks(server, front, stream):
    """Before: the non-streaming disconnect had no test."""
    conn = open_request(
        front,
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": stream},
    )
    if stream:
        response = conn.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")
    wait_running(server)
    assert metric(server, "vllm:kv_cache_usage_perc") > 0
    before = metric(server, "vllm:generation_tokens_total")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    assert settles(server)
    time.sleep(0.5)
    stopped = metric(server, "vllm:generation_tokens_total")
    assert stopped - before < 900
    time.sleep(1)
    assert metric(server, "vllm:generation_tokens_total") == stopped


def test_a_storm_of_disconnects_leaves_no_request_block_task_or_thread(server, front):
    """Streamed and non-streamed requests cut at random moments (a few before their first
    token): afterwards nothing runs in the engine, no KV block is used, and the frontend has
    no more asyncio tasks or threads than before."""
    assert settles(server)
    tasks, threads = frontend_tasks(front), request_threads()
    rng = random.Random(7)

    def one(i: int) -> None:
        conn = open_request(
            front,
            {
                "model": MODEL,
                "prompt": f"{PROMPT} {i}",
                "max_tokens": 300,
                "ignore_eos": True,
                "stream": i % 2 == 0,
            },
        )
        time.sleep(rng.uniform(0.0, 0.6))
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(120)))
    assert settles(server, timeout=60)
    deadline = time.monotonic() + 20
    while frontend_tasks(front) > tasks and time.monotonic() < deadline:
        time.sleep(0.2)
    assert frontend_tasks(front) <= tasks
    assert request_threads() <= threads
