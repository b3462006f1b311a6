"""A hung or persistently failing engine is seen: its requests end with a clear error, the
model stops reporting READY and the engine is restarted as after a crash (the server goes
away for its supervisor to replace), or, with vllm_backend's ENABLE_VLLM_HEALTH_CHECK, the
model is unloaded. Real tritonserver, tiny model, a forward made to block or raise."""

import os
import threading
import time
import urllib.request

import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")

from slipstream import SamplingParams  # noqa: E402
from slipstream.engine.loop import EngineLoop, HealthState  # noqa: E402
from engine_support import GREEDY, config  # noqa: E402
from fault_support import faulty_server  # noqa: E402
from server_support import OVERRIDES, REPO, run_stream, text_inputs, wait_gone  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("SLIPSTREAM_SKIP_SERVER_TESTS") == "1", reason="SLIPSTREAM_SKIP_SERVER_TESTS=1"
)
SHORT = {"temperature": 0, "max_tokens": 4}


def test_the_step_watchdog_ends_every_request_of_a_hung_step():
    deaths = []
    loop = EngineLoop(config(), on_dead=deaths.append, step_timeout_s=0.5).start()
    try:
        loop.generate([5, 6, 7], SamplingParams(max_tokens=4, **GREEDY))  # past the first steps
        hang = threading.Event()
        loop.engine.runner.execute = lambda sched: hang.wait()
        streams = [
            loop.submit([8 + i, 9], SamplingParams(max_tokens=50, **GREEDY)) for i in range(3)
        ]
        started = time.monotonic()
        outs = [list(stream)[-1] for stream in streams]
        assert time.monotonic() - started < 5
        assert all(o.error and "hung" in o.error and "step_timeout_s" in o.error for o in outs)
        assert loop.health().state is HealthState.DEAD and deaths
        hang.set()  # the stuck step returns at last: nothing more reaches the streams
    finally:
        loop.shutdown(timeout=5)


def wait_exit(server, timeout):
    try:
        return server.process.wait(timeout)
    except Exception:  # noqa: BLE001 - still running: the caller's assertion says so
        return None


@pytest.mark.server
@pytest.mark.slow
def test_a_hung_step_fails_its_requests_and_the_server_goes_away(tiny_model, tmp_path):
    """Before: every client waited for ever and the model stayed READY."""
    server, fault = faulty_server(
        REPO, tiny_model, tmp_path, {**OVERRIDES, "step_timeout_s": 2}, exit_timeout=5
    )
    try:
        assert run_stream(server, text_inputs("warm", sampling=SHORT))[1] is None
        fault.write_text("block")
        results = {}
        clients = [
            threading.Thread(
                target=lambda i=i: results.__setitem__(
                    i, run_stream(server, text_inputs(f"stuck {i}", sampling=SHORT), timeout=60)
                )
            )
            for i in range(3)
        ]
        started = time.monotonic()
        for client in clients:
            client.start()
        for client in clients:
            client.join(90)
        answered = time.monotonic() - started
        code = wait_exit(server, 30)
    finally:
        server.kill()
    assert len(results) == 3 and answered < 30, (results, answered)
    for _, error in results.values():
        assert error is not None and (
            "hung" in str(error)
            or "Stream removed" in str(error)
            or "unavailable" in str(error).lower()
        ), str(error)
    assert any("hung" in str(error) for _, error in results.values())
    assert code is not None and not server.is_ready()
    log = server.log_path.read_text()
    assert "step_timeout_s" in log and "cannot be recovered" in log
    assert wait_gone(server.shm_prefix) == ([], [])


@pytest.mark.server
@pytest.mark.slow
def test_an_engine_failing_every_step_goes_not_ready_after_the_threshold(tiny_model, tmp_path):
    """Default restarts. Before: the engine was restarted inside the stub and the model
    stayed READY, accepting work it could not do."""
    server, fault = faulty_server(
        REPO, tiny_model, tmp_path, {**OVERRIDES, "engine_failure_threshold": 3}, exit_timeout=5
    )
    errors = []
    try:
        fault.write_text("raise")
        for i in range(3):
            errors.append(str(run_stream(server, text_inputs(f"r{i}", sampling=SHORT))[1]))
        code = wait_exit(server, 30)
    finally:
        server.kill()
    assert all("injected fault" in e or "engine failed" in e for e in errors), errors
    assert code is not None and not server.is_ready()
    assert "cannot be recovered" in server.log_path.read_text()
    assert wait_gone(server.shm_prefix) == ([], [])


@pytest.mark.server
@pytest.mark.slow
def test_with_the_vllm_health_check_a_failing_engine_unloads_the_model(tiny_model, tmp_path):
    server, fault = faulty_server(
        REPO,
        tiny_model,
        tmp_path,
        {**OVERRIDES, "engine_failure_threshold": 2, "ENABLE_VLLM_HEALTH_CHECK": "true"},
    )
    try:
        fault.write_text("raise")
        for i in range(2):
            assert run_stream(server, text_inputs(f"r{i}", sampling=SHORT))[1] is not None
        deadline = time.monotonic() + 30
        while server.model_states().get("slipstream") == "READY" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.model_states().get("slipstream") != "READY"
        with urllib.request.urlopen(f"http://{server.http_url}/v2/health/live", timeout=5) as r:
            assert r.status == 200  # the server stays up (vllm_backend's behaviour)
    finally:
        server.stop()
    assert wait_gone(server.shm_prefix) == ([], [])


# ---------------------------------------------------------------- a failing engine is seen
LONG = {"temperature": 0, "max_tokens": 900, "ignore_eos": True}
POISON_LEN = 40  # prompts of this many tokens or more break the forward ("poison" fault)
READY_WITHIN_S = 1.0


class Streaming:
    """One streaming request on its own gRPC stream, read on the client's thread."""

    def __init__(self, server, prompt, sampling):
        self.first, self.done = threading.Event(), threading.Event()
        self.error, self.ended_at, self.final = None, None, False
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.client.start_stream(callback=self._callback)
        self.client.async_stream_infer(
            "slipstream", text_inputs(prompt, sampling=sampling), enable_empty_final_response=True
        )

    def _callback(self, result, error):
        if self.done.is_set():  # e.g. the stream closing after the request's own end
            return
        if error is not None:
            self.error = error
        else:
            self.first.set()
            self.final = result.get_response().parameters["triton_final_response"].bool_param
        if error is not None or self.final:
            self.ended_at = time.monotonic()
            self.done.set()

    def close(self):
        try:
            self.client.stop_stream()
            self.client.close()
        except Exception:  # noqa: BLE001 - the server may be gone: nothing to close
            pass


def streams_decoding(server, count):
    """``count`` long requests, each past its first token."""
    streams = [Streaming(server, f"request {i} of the batch", LONG) for i in range(count)]
    for stream in streams:
        assert stream.first.wait(120), "a request never started"
    return streams


def not_ready_within(server, since, limit):
    """Seconds from ``since`` until the server (or the model) stops answering ready."""
    while time.monotonic() - since < limit:
        try:
            if not server.is_ready():
                return time.monotonic() - since
        except Exception:  # noqa: BLE001 - refused: it is gone
            return time.monotonic() - since
        time.sleep(0.02)
    return None


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.parametrize("kind", ["raise", "sampler"])
def test_a_fault_failing_every_request_in_flight_is_an_engine_failure(tiny_model, tmp_path, kind):  # noqa: F811
    """Five requests decoding, then the forward (or sampler) fails for all of them: each ends
    with a server error, the engine is declared failed at once (five requests failed in it,
    none served), readiness turns false within a second and the server goes away for its
    orchestrator to restart. Before: each request failed alone as "internal error", the
    engine counted one failed step of five and the server stayed READY."""
    server, fault = faulty_server(REPO, tiny_model, tmp_path, OVERRIDES, exit_timeout=5)
    streams = []
    try:
        assert run_stream(server, text_inputs("warm", sampling=SHORT))[1] is None
        streams = streams_decoding(server, 5)
        fault.write_text(kind)
        assert all(stream.done.wait(60) for stream in streams)
        last_error = max(stream.ended_at for stream in streams)
        took = not_ready_within(server, last_error, 10)
        code = wait_exit(server, 30)
    finally:
        for stream in streams:
            stream.close()
        server.kill()
    errors = [str(stream.error) for stream in streams]
    assert all(stream.error is not None and not stream.final for stream in streams), errors
    assert any("injected fault" in e for e in errors), errors
    assert took is not None and took <= READY_WITHIN_S, took
    assert code is not None and not server.is_ready()
    log = server.log_path.read_text()
    assert "requests in a row failed in the engine" in log and "cannot be recovered" in log
    assert wait_gone(server.shm_prefix) == ([], [])


@pytest.mark.slow
@pytest.mark.server
def test_with_restarts_a_failed_engine_is_replaced_and_serves_again(tiny_model, tmp_path):  # noqa: F811
    """max_engine_restarts 1: the supervisor builds a fresh engine in the stub; meanwhile
    requests are refused as unavailable, then served again. Before: the engine never died."""
    server, fault = faulty_server(
        REPO, tiny_model, tmp_path, {**OVERRIDES, "max_engine_restarts": 1}, exit_timeout=5
    )
    streams = []
    try:
        streams = streams_decoding(server, 5)
        fault.write_text("raise")
        assert all(stream.done.wait(60) for stream in streams)
        fault.write_text("")
        deadline = time.monotonic() + 120
        while True:  # refused while the engine restarts, then served
            _, error = run_stream(server, text_inputs("after", sampling=SHORT))
            if error is None or time.monotonic() > deadline:
                break
            # refused while restarting, or swept with the dying engine if it came just before
            assert any(
                why in str(error) for why in ("restarting", "not serving", "engine failed")
            ), str(error)
            time.sleep(0.5)
        assert error is None
        assert server.is_ready()
    finally:
        for stream in streams:
            stream.close()
        server.stop()
    assert all(stream.error is not None for stream in streams)
    assert "slipstream engine restarted" in server.log_path.read_text()
    assert wait_gone(server.shm_prefix) == ([], [])


@pytest.mark.slow
@pytest.mark.server
def test_with_the_vllm_health_check_a_batch_failing_in_the_engine_unloads_the_model(
    tiny_model,  # noqa: F811
    tmp_path,
):
    """ENABLE_VLLM_HEALTH_CHECK: the model is unloaded within a second of the engine's
    failure; the server stays up. Before: the model stayed READY."""
    server, fault = faulty_server(
        REPO, tiny_model, tmp_path, {**OVERRIDES, "ENABLE_VLLM_HEALTH_CHECK": "true"}
    )
    streams = []
    try:
        streams = streams_decoding(server, 5)
        fault.write_text("raise")
        assert all(stream.done.wait(60) for stream in streams)
        last_error = max(stream.ended_at for stream in streams)
        took = not_ready_within(server, last_error, 10)
        with urllib.request.urlopen(f"http://{server.http_url}/v2/health/live", timeout=5) as r:
            assert r.status == 200  # the server stays up (vllm_backend's behaviour)
    finally:
        for stream in streams:
            stream.close()
        server.stop()
    assert took is not None and took <= READY_WITHIN_S, took
    assert wait_gone(server.shm_prefix) == ([], [])


@pytest.mark.slow
@pytest.mark.server
def test_one_request_that_alone_breaks_the_forward_fails_alone_and_the_server_serves_on(
    tiny_model,  # noqa: F811
    tmp_path,
):
    """A request whose prompt breaks the forward, sent again and again (past the threshold),
    alone and beside requests that decode: it fails alone each time, the others finish and
    the server stays READY."""
    server, fault = faulty_server(REPO, tiny_model, tmp_path, OVERRIDES, exit_timeout=5)
    poison = "word " * (2 * POISON_LEN)
    try:
        fault.write_text(f"poison {POISON_LEN}")
        for round_ in range(7):
            beside = [
                Streaming(server, f"good {round_} {i}", {**SHORT, "max_tokens": 40})
                for i in range(round_ % 3)
            ]
            _, error = run_stream(server, text_inputs(poison, sampling=SHORT))
            assert error is not None and "breaks the forward" in str(error), str(error)
            for stream in beside:
                assert stream.done.wait(120) and stream.error is None and stream.final
                stream.close()
            assert run_stream(server, text_inputs(f"fine {round_}", sampling=SHORT))[1] is None
        assert server.is_ready()
        assert server.model_states().get("slipstream") == "READY"
    finally:
        server.stop()
    assert "slipstream engine is dead" not in server.log_path.read_text()
    assert wait_gone(server.shm_prefix) == ([], [])
