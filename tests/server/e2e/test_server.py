"""The slipstream model behind a real tritonserver (no mock of Triton).

One server per module on a rendered copy of model_repository with a tiny random llama; the
expected texts come from an in-process EngineLoop on the same model directory and settings
(both fixtures in this folder's conftest.py, the request helpers in ``server_support``).
The last test runs ``slipstream serve --prompt ... --exit-after-prompt`` on the real default
model (SmolLM2-135M-Instruct).
"""

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")

import torch  # noqa: E402

from slipstream.server.launch.launcher import TritonServer, stub_pids  # noqa: E402
from slipstream.server.launch.repository import render_model_repository  # noqa: E402
from server_support import (  # noqa: E402
    GREEDY,
    MAX_MODEL_LEN,
    MODEL,
    OVERRIDES,
    PROMPTS,
    REPO,
    StreamClient,
    http_post,
    metrics,
    run_stream,
    tensor,
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


# ------------------------------------------------------------------------------- helpers
def sse_events(server, body, timeout=120):
    req = urllib.request.Request(
        f"http://{server.http_url}/v2/models/{MODEL}/generate_stream",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    events = []
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for line in r:
                line = line.decode().strip()
                if line.startswith("data:"):
                    events.append(json.loads(line[5:]))
    except urllib.error.HTTPError as e:  # the error comes as one SSE event too
        body = e.read().decode()
        return e.code, [
            json.loads(line[5:]) for line in body.splitlines() if line.startswith("data:")
        ] or [{"error": body}]
    return 200, events


# ------------------------------------------------------------------------------- tests
def test_grpc_streaming(server, reference):
    prompt = PROMPTS[1]
    results, error = run_stream(
        server,
        text_inputs(
            prompt,
            sampling={**GREEDY, "logprobs": 0},
            return_finish_reason=np.array([True]),
            return_num_input_tokens=np.array([True]),
            return_num_output_tokens=np.array([True]),
            return_logprobs=np.array([True]),
            return_cumulative_logprob=np.array([True]),
        ),
    )
    assert error is None
    pieces = texts(results)
    assert len(results) >= 2  # token by token, not one blob
    assert "".join(pieces) == reference(prompt)
    final = results[-1]
    assert final.as_numpy("finish_reason")[0].decode() in ("length", "stop")
    assert {r.as_numpy("finish_reason")[0] for r in results[:-1]} == {b"None"}
    n_out = sum(int(r.as_numpy("num_output_tokens")[0]) for r in results)
    per_token = [entry for r in results for entry in json.loads(r.as_numpy("logprobs")[0])]
    logprobs = np.array([next(iter(e.values()))["logprob"] for e in per_token])
    assert len(logprobs) == n_out and (logprobs <= 0).all()
    assert final.as_numpy("cumulative_logprob")[0] == pytest.approx(
        logprobs.sum(), rel=1e-4, abs=1e-3
    )
    assert int(final.as_numpy("num_input_tokens")) > 0  # a UINT32 scalar, as vLLM sends it
    if final.as_numpy("finish_reason")[0] == b"length":
        assert n_out == GREEDY["max_tokens"]


def test_grpc_only_requested_outputs(server):
    results, error = run_stream(server, text_inputs("Hello", sampling=GREEDY))
    assert error is None
    for r in results:
        names = {o.name for o in r.get_response().outputs}
        assert names <= {"text_output"}


def test_grpc_non_streaming(server, reference):
    prompt = PROMPTS[2]
    results, error = run_stream(server, text_inputs(prompt, stream=False, sampling=GREEDY))
    assert error is None
    assert len(results) == 1  # one response carrying the whole text, flagged final
    assert texts(results) == [prompt + reference(prompt)]
    results, error = run_stream(
        server,
        text_inputs(
            prompt,
            stream=False,
            sampling=GREEDY,
            exclude_input_in_output=np.array([True]),
            return_num_output_tokens=np.array([True]),
        ),
    )
    assert error is None and texts(results) == [reference(prompt)]
    assert 0 < int(results[0].as_numpy("num_output_tokens")[0]) <= GREEDY["max_tokens"]


def test_typed_inputs_over_grpc(server, reference):
    prompt = PROMPTS[3]
    results, error = run_stream(
        server,
        text_inputs(
            prompt,
            temperature=np.array([0.0], np.float32),
            max_tokens=np.array([12], np.int32),
            seed=np.array([7], np.uint64),
        ),
    )
    assert error is None
    assert "".join(texts(results)) == reference(prompt)


def test_http_generate(server, reference):
    prompt = PROMPTS[0]
    status, body = http_post(
        server, f"/v2/models/{MODEL}/generate", {"text_input": prompt, "parameters": GREEDY}
    )
    assert status == 200, body
    assert json.loads(body)["text_output"] == prompt + reference(prompt)
    status, body = http_post(
        server,
        f"/v2/models/{MODEL}/generate",
        {
            "text_input": prompt,
            "exclude_input_in_output": True,
            "return_finish_reason": True,
            "parameters": GREEDY,
        },
    )
    assert status == 200, body
    data = json.loads(body)
    assert data["text_output"] == reference(prompt)
    assert data["finish_reason"] in ("length", "stop")


def test_http_generate_stream(server, reference):
    prompt = PROMPTS[5]
    status, events = sse_events(
        server, {"text_input": prompt, "stream": True, "parameters": GREEDY}
    )
    assert status == 200, events
    assert not any("error" in e for e in events), events
    assert len(events) >= 2
    assert "".join(e.get("text_output", "") for e in events) == reference(prompt)


def test_concurrent_streams_match_single_request_output(server, reference):
    client = StreamClient(server.grpc_url)
    try:
        for i, prompt in enumerate(PROMPTS):
            client.send(f"req-{i}", text_inputs(prompt, sampling=GREEDY))
        got = {i: "".join(texts(client.responses(f"req-{i}"))) for i in range(len(PROMPTS))}
        assert client.errors.empty()
    finally:
        client.close()
    mismatches = {
        PROMPTS[i]: (text, reference(PROMPTS[i]))
        for i, text in got.items()
        if text != reference(PROMPTS[i])
    }
    assert not mismatches


def test_cancel_long_stream_frees_kv_blocks(server):
    wait_metric(server, "slipstream_kv_blocks_used", lambda v: v == 0)
    before = metrics(server)["slipstream_generation_tokens_total"]
    budget = MAX_MODEL_LEN - 16
    client = StreamClient(server.grpc_url)
    client.send(
        "long",
        text_inputs(
            "Tell me a very long story",
            sampling={"temperature": 0, "max_tokens": budget, "ignore_eos": True},
        ),
    )
    for _ in range(5):  # it is generating
        client.queues["long"].get(timeout=60)
    # the engine counts it as running (the gauge lags by up to one metrics interval)
    wait_metric(server, "slipstream_requests_running", lambda v: v == 1)
    client.close(cancel=True)
    error = client.errors.get(timeout=10)
    assert "CANCELLED" in str(error)
    wait_metric(server, "slipstream_kv_blocks_used", lambda v: v == 0)
    wait_metric(server, "slipstream_requests_running", lambda v: v == 0)
    generated = metrics(server)["slipstream_generation_tokens_total"] - before
    assert generated < budget, "the request ran to completion instead of being aborted"
    results, error = run_stream(server, text_inputs("still alive?", sampling=GREEDY))
    assert error is None and results


BAD_REQUESTS = {
    "missing text_input": ([tensor("stream", np.array([True]))], "text_input"),
    "wrong type": ([tensor("text_input", np.array([3], np.int32))], "expects 'BYTES'"),
    "wrong typed input": (None, "max_tokens"),
    "invalid JSON": (None, "not valid JSON"),
    "invalid value": (None, "temperature must be >= 0"),
    "non-UTF-8": (None, "not valid UTF-8"),
    "too long": (None, "max_model_len"),
    "empty prompt": (None, "empty"),
    "stream without exclude_input_in_output": (
        None,
        "Error generating stream: When streaming, `exclude_input_in_output` = False is not "
        "allowed.",
    ),
}


def bad_inputs(kind):
    inputs, _ = BAD_REQUESTS[kind]
    if inputs is not None:
        return inputs
    if kind == "wrong typed input":
        return text_inputs("hi", max_tokens=np.array([1.5], np.float32))
    if kind == "invalid JSON":
        return text_inputs("hi", sampling='{"temperature": 0,')
    if kind == "invalid value":
        return text_inputs("hi", sampling={"temperature": -1})
    if kind == "non-UTF-8":
        return text_inputs(b"caf\xe9 \xff", sampling=GREEDY)
    if kind == "too long":
        return text_inputs(" ".join(["word"] * (MAX_MODEL_LEN + 50)), sampling=GREEDY)
    if kind == "empty prompt":
        return text_inputs("", sampling=GREEDY)
    if kind == "stream without exclude_input_in_output":
        return text_inputs("hi", sampling=GREEDY, exclude_input_in_output=np.array([False]))
    raise KeyError(kind)


@pytest.mark.parametrize("kind", list(BAD_REQUESTS))
def test_bad_request_fails_alone(server, reference, kind):
    prompt = PROMPTS[7]
    good = StreamClient(server.grpc_url)
    try:
        good.send("good", text_inputs(prompt, sampling=GREEDY))
        results, error = run_stream(server, bad_inputs(kind))
        assert error is not None, f"{kind}: no error, got {texts(results)}"
        assert BAD_REQUESTS[kind][1] in str(error), str(error)
        assert "".join(texts(good.responses("good"))) == reference(prompt)
        assert good.errors.empty()
    finally:
        good.close()


def test_http_error_message(server):
    status, body = http_post(
        server, f"/v2/models/{MODEL}/generate", {"text_input": "hi", "parameters": {"top_p": 7}}
    )
    assert status == 400 and "top_p" in json.loads(body)["error"]
    status, events = sse_events(
        server, {"text_input": "hi", "stream": True, "parameters": {"top_p": 7}}
    )
    assert status == 400 and "top_p must be in (0, 1]" in events[0]["error"]


def test_metrics(server):
    preemptions_before = metrics(server)["slipstream_preemptions_total"]
    run_stream(server, text_inputs(PROMPTS[4], sampling=GREEDY))
    run_stream(server, text_inputs(PROMPTS[4], sampling=GREEDY))  # a prefix-cache hit
    m = wait_metric(server, "slipstream_prefix_cache_hit_rate", lambda v: v > 0) and metrics(server)
    assert m["slipstream_kv_blocks_capacity"] > 0
    assert m["slipstream_kv_blocks_used"] <= m["slipstream_kv_blocks_capacity"]
    assert 0 < m["slipstream_prefix_cache_hit_rate"] <= 1
    assert m["slipstream_prompt_tokens_total"] > 0
    assert m["slipstream_generation_tokens_total"] >= GREEDY["max_tokens"]
    assert m["slipstream_requests_finished_total"] >= 2
    # two short requests in a cache with room to spare: nothing preempted, and the counter
    # is served
    assert m["slipstream_preemptions_total"] == preemptions_before
    for name in (
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "e2e_request_latency_seconds",
    ):
        count = m[f"slipstream_{name}_count"]
        assert count >= 2
        assert 0 < m[f"slipstream_{name}_sum"] / count < 60
        assert m[f"slipstream_{name}_bucket" + '{le="+Inf"}'] == count
    ttft = m["slipstream_time_to_first_token_seconds_sum"]
    e2e = m["slipstream_e2e_request_latency_seconds_sum"]
    assert ttft <= e2e


def test_overloaded_queue_is_refused_with_unavailable(tiny_model, tmp_path):
    """max_queue_size: a request beyond the waiting limit gets UNAVAILABLE, the others finish."""
    repo = render_model_repository(
        REPO,
        tmp_path / "repo",
        {"model": str(tiny_model), **OVERRIDES, "max_num_seqs": 1, "max_queue_size": 1},
    )
    with TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0, startup_timeout=300) as srv:
        client = StreamClient(srv.grpc_url)
        try:
            long = {"temperature": 0, "max_tokens": 200, "ignore_eos": True}
            client.send("running", text_inputs("first", sampling=long))
            client.queues["running"].get(timeout=60)  # it is running: the queue is empty
            client.send("waiting", text_inputs("second", sampling=GREEDY))
            results, error = run_stream(srv, text_inputs("third", sampling=GREEDY))
            assert error is not None and "overloaded" in str(error), (texts(results), error)
            status, body = http_post(
                srv, f"/v2/models/{MODEL}/generate", {"text_input": "fourth", "parameters": GREEDY}
            )
            # the error carries code UNAVAILABLE; Triton 2.51 answers 400 for any model error
            assert status in (400, 503) and "overloaded" in body, (status, body)
            assert client.responses("running")[-1] is not None
            assert len("".join(texts(client.responses("waiting")))) > 0
            assert client.errors.empty()
        finally:
            client.close()


def test_a_request_cancelled_while_it_waits_is_noticed_and_ends_cancelled(tiny_model, tmp_path):
    """A request with nothing to send yet is asked about cancellation less often than a
    streaming one (CancelPolls.idle_s), but still asked: cancelled in the queue, it ends
    CANCELLED within a few seconds, and the running request goes on to its end."""
    repo = render_model_repository(
        REPO, tmp_path / "repo", {"model": str(tiny_model), **OVERRIDES, "max_num_seqs": 1}
    )
    with TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0, startup_timeout=300) as srv:
        runner, waiter = StreamClient(srv.grpc_url), StreamClient(srv.grpc_url)
        try:
            long = {"temperature": 0, "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True}
            runner.send("running", text_inputs("first", sampling=long))
            runner.queues["running"].get(timeout=60)  # it holds the only sequence slot
            waiter.send("waiting", text_inputs("second", sampling=long))
            time.sleep(0.3)
            assert waiter.queues["waiting"].empty()  # still queued: nothing streamed
            waiter.close(cancel=True)
            deadline = time.monotonic() + 10
            while "slipstream: cancelling request" not in srv.log_tail(10**6):
                assert time.monotonic() < deadline, "the waiting request's cancel went unseen"
                time.sleep(0.05)
            final = runner.responses("running")[-1]
            assert final.get_response().parameters["triton_final_response"].bool_param
            assert runner.errors.empty()
        finally:
            runner.close()


@pytest.mark.slow
def test_serve_cli_default_model_answers_paris():
    """The README demo: `slipstream serve --prompt ... --exit-after-prompt` on SmolLM2."""
    cmd = [
        sys.executable,
        "-m",
        "slipstream.server",
        "--http-port",
        "0",
        "--grpc-port",
        "0",
        "--metrics-port",
        "0",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "24",
        "--exit-after-prompt",
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    answer = proc.stdout.split(">>> What is the capital of France?", 1)[1]
    assert "Paris" in answer, proc.stdout
    assert "gRPC" in proc.stdout and "metrics" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine loads OpenAI Triton")
def test_the_cpu_stub_process_never_maps_openai_triton(server, reference):
    """The serving process on a CPU-only machine keeps OpenAI Triton's library out (66 MB
    resident otherwise): after it has loaded the model and answered, none of its mappings is
    libtriton."""
    responses, error = run_stream(
        server, text_inputs("Hello", sampling={**GREEDY, "max_tokens": 2})
    )
    assert error is None and texts(responses)
    stub = stub_pids(server.shm_prefix)
    assert len(stub) == 1
    maps = Path(f"/proc/{stub[0]}/maps").read_text()
    assert "libtorch_cpu" in maps  # the model's process, not a bystander
    assert "libtriton" not in maps
