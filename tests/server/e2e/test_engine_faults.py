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
