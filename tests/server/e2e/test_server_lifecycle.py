"""Shutdown, a dead stub and a failing engine, through a real tritonserver (tiny model).

Each test owns its server, since each ends it. What every one checks at the end: no client
left hanging, no process of the server's group and no shared-memory region left behind."""

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")

from slipstream.server.launch.launcher import TritonServer, free_port, stub_pids  # noqa: E402
from slipstream.server.launch.repository import render_model_repository  # noqa: E402
from slipstream.server.launch.scrape import sample_value, scrape  # noqa: E402
from slipstream.server.launch.triton_install import TritonServerError  # noqa: E402
from server_support import OVERRIDES, REPO, leftovers, run_stream, text_inputs, texts, wait_gone  # noqa: E402

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(
        os.environ.get("SLIPSTREAM_SKIP_SERVER_TESTS") == "1",
        reason="SLIPSTREAM_SKIP_SERVER_TESTS=1",
    ),
]

# Streams that must outlast a 3 s exit timeout or a killed stub: near the tiny model's 1,024
# positions (at 480 tokens, ten of them finished inside 3 s once the engine got faster).
LONG = {"temperature": 0, "max_tokens": 1000, "ignore_eos": True}


def kill_leftovers(shm_prefix):
    """What a SIGKILLed ``slipstream serve`` leaves: its tritonserver (own session), stub and
    watchdog, and their shared memory."""
    procs, regions = leftovers(shm_prefix)
    for pid in procs:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    for region in regions:
        os.unlink(region)


class Clients:
    """Long gRPC streams and one HTTP generate_stream, each recording how it ended."""

    def __init__(self, server, num_grpc=3, http=True, sampling=LONG):
        self.server, self.sampling = server, sampling
        self.results = {}
        self.last_end = 0.0  # when the last client got its final response
        self.threads = [threading.Thread(target=self._grpc, args=(i,)) for i in range(num_grpc)]
        if http:
            self.threads.append(threading.Thread(target=self._http))
        for t in self.threads:
            t.start()

    def _grpc(self, i):
        results, error = run_stream(
            self.server, text_inputs(f"story {i}", sampling=self.sampling), timeout=120
        )
        self.results[f"grpc{i}"] = ("error", str(error)) if error else ("ok", len(results))
        self.last_end = max(self.last_end, time.monotonic())

    def _http(self):
        req = urllib.request.Request(
            f"http://{self.server.http_url}/v2/models/slipstream/generate_stream",
            data=json.dumps(
                {"text_input": "x", "stream": True, "parameters": self.sampling}
            ).encode(),
        )
        events = []
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                events = [json.loads(line[5:]) for line in r if line.startswith(b"data:")]
        except Exception as exc:  # noqa: BLE001 - recorded: the test says what it expects
            self.results["http"] = ("exception", repr(exc))
            return
        last = events[-1] if events else {}
        self.results["http"] = ("error", last["error"]) if "error" in last else ("ok", len(events))
        self.last_end = max(self.last_end, time.monotonic())

    def join(self, timeout=60):
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(deadline - time.monotonic(), 0.01))
        return [t for t in self.threads if t.is_alive()]


def wait_streaming(server, n, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        running = sample_value(scrape(server.metrics_url, timeout=5), "slipstream_requests_running")
        if running is not None and running >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"{n} requests never ran together")


def cancel_after_final(server, n=20):
    """Streams closed with stop_stream(cancel_requests=True) after their final response
    (before the fix a race in Triton's gRPC frontend could keep the model from unloading)."""
    for i in range(n):
        client = grpcclient.InferenceServerClient(server.grpc_url)
        done = threading.Event()
        client.start_stream(
            callback=lambda result, error: (
                (error or result.get_response().parameters["triton_final_response"].bool_param)
                and done.set()
            )
        )
        client.async_stream_infer(
            "slipstream",
            text_inputs(f"hi {i}", sampling={"temperature": 0, "max_tokens": 3}),
            enable_empty_final_response=True,
        )
        assert done.wait(60)
        client.stop_stream(cancel_requests=True)
        client.close()


def test_sigterm_past_the_exit_timeout_ends_every_stream_with_an_error(tiny_model, tmp_path):
    """Plain ``tritonserver`` (Triton's own model control) gets SIGTERM, as from a container
    runtime, with 10 gRPC and HTTP streams that would run past its 3 s exit timeout. Before:
    it segfaulted, gRPC clients got "Stream removed", the HTTP stream was cut off with status
    200 and no error, the stub was orphaned; then exit 1 "Exit timeout expired" with the
    stub outliving it. Now each client's stream ends with an error saying why, the model
    finalizes and tritonserver exits 0 within its timeout."""
    repo = render_model_repository(REPO, tmp_path / "repo", {"model": str(tiny_model), **OVERRIDES})
    server = TritonServer(
        repo,
        http_port=0,
        grpc_port=0,
        metrics_port=0,
        startup_timeout=300,
        exit_timeout=3,
        model_control="none",
    ).start()
    try:  # (no stream cancelled before: Triton's race below would keep the model loaded)
        clients = [
            Clients(server, num_grpc=7),
            Clients(server, num_grpc=0),
            Clients(server, num_grpc=0),
        ]
        wait_streaming(server, 10)
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(60)
        took = time.monotonic() - signalled
        assert not any(group.join() for group in clients), "a client was left hanging"
    finally:
        server.kill()
    assert code == 0, f"tritonserver ended with {code}:\n{server.log_tail()}"
    assert took < 3 + 2, took
    assert "slipstream: finalized in" in server.log_path.read_text()
    results = {
        f"{i}:{name}": result
        for i, group in enumerate(clients)
        for name, result in group.results.items()
    }
    assert len(results) == 10
    for name, (how, detail) in results.items():
        assert how == "error" and "shutting down" in detail, (name, how, detail)
    assert wait_gone(server.shm_prefix) == ([], [])


def test_stop_unloads_first_so_an_idle_keepalive_connection_costs_nothing(tiny_model, tmp_path):
    """``TritonServer.stop`` (what ``slipstream serve`` does on SIGTERM): requests in flight
    finish, an idle HTTP keep-alive connection does not hold the exit for the 30 s timeout,
    the model finalizes, nothing is left behind. Before: 30 s, exit 1, no finalize."""
    repo = render_model_repository(REPO, tmp_path / "repo", {"model": str(tiny_model), **OVERRIDES})
    server = TritonServer(
        repo, http_port=0, grpc_port=0, metrics_port=0, startup_timeout=300, exit_timeout=30
    ).start()
    idle = http.client.HTTPConnection(*server.http_url.split(":"))
    try:
        idle.request("GET", "/v2/health/ready")
        assert idle.getresponse().read() == b""
        # Long enough to be seen running: at 40 tokens the tiny model could finish all four
        # between two metrics updates on a loaded machine, and the wait below never saw them.
        clients = Clients(server, sampling={**LONG, "max_tokens": 200})
        wait_streaming(server, 1)
        server.stop()
        stopped = time.monotonic()
        assert not clients.join(), "a client was left hanging"
    finally:
        idle.close()
        server.kill()
    # Once the last request is answered, stopping takes seconds, not the 30 s timeout.
    assert stopped - clients.last_end < 10, f"stop ended {stopped - clients.last_end:.1f} s late"
    assert server.last_stop.models_unloaded
    assert all(how == "ok" for how, _ in clients.results.values()), clients.results
    assert wait_gone(server.shm_prefix) == ([], [])
    assert "slipstream: finalize" in server.log_path.read_text()


def test_killed_stub_errors_clients_at_once_and_serve_brings_the_server_back(tiny_model, tmp_path):
    """kill -9 of the backend stub with 5 requests in flight. Before: all 5 hung for the 90 s
    they waited, the model stayed READY, every new request failed "Stub process is not
    healthy", a graceful stop timed out. Now the watchdog takes tritonserver down at once (the
    clients get a connection error), ``slipstream serve`` starts it again, it serves, and a
    SIGTERM to ``serve`` exits 0 leaving nothing behind."""
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "slipstream.server",
        "--model",
        str(tiny_model),
        "--http-port",
        str(http_port),
        "--grpc-port",
        str(grpc_port),
        "--metrics-port",
        str(metrics_port),
        "--exit-timeout",
        "5",
        "--startup-timeout",
        "300",
    ]
    cmd += [arg for key, value in OVERRIDES.items() for arg in ("--set", f"{key}={value}")]
    serve = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    server = TritonServer(
        REPO, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port
    )  # only to reach serve's endpoints
    output = []
    reader = threading.Thread(target=lambda: output.extend(serve.stdout), daemon=True)
    reader.start()
    prefix = f"slipstream_{serve.pid}_{grpc_port}_"
    try:
        deadline = time.monotonic() + 300
        while not server.is_ready():
            assert serve.poll() is None and time.monotonic() < deadline, "".join(output)
            time.sleep(0.2)
        clients = Clients(server, num_grpc=5, http=False)
        wait_streaming(server, 5)
        stub = stub_pids(prefix)
        assert len(stub) == 1
        killed_at = time.monotonic()
        os.kill(stub[0], signal.SIGKILL)
        assert not clients.join(timeout=10), "a client was left hanging"
        answered_in = time.monotonic() - killed_at
        assert all(how == "error" for how, _ in clients.results.values()), clients.results
        assert answered_in < 5
        deadline = time.monotonic() + 300
        while "ready again" not in "".join(output):  # restarted by serve, and it says so
            assert serve.poll() is None and time.monotonic() < deadline, "".join(output)
            time.sleep(0.2)
        assert server.is_ready()
        results, error = run_stream(
            server, text_inputs("back again", sampling={"temperature": 0, "max_tokens": 4})
        )
        assert error is None and texts(results)
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(60) == 0, "".join(output)
    finally:
        if serve.poll() is None:  # a failed test: serve never stopped its tritonserver
            serve.kill()
            serve.wait()
            kill_leftovers(prefix)
    reader.join(5)
    log = "".join(output)
    assert "restarting tritonserver" in log and "ready again" in log, log
    assert wait_gone(prefix) == ([], [])


def nan_model(tiny_model, target):
    """The tiny model with NaN output weights: every step's logits are NaN."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.fill_(float("nan"))
    model.config.tie_word_embeddings = False
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(str(tiny_model)).save_pretrained(target)
    return target


def test_engine_failing_every_step_takes_the_server_down(tiny_model, tmp_path):
    """An engine that fails on every step (here: a model whose logits are all NaN). Before:
    every request failed with an internal error and the model stayed READY for ever. Now
    each request fails alone with a clear error, then the engine is declared dead (2 failed
    steps in a row here), restarts are exhausted (none allowed here) and the server goes
    away so that its supervisor replaces it; nothing is left behind."""
    model = nan_model(tiny_model, tmp_path / "nan-model")
    repo = render_model_repository(
        REPO,
        tmp_path / "repo",
        {"model": str(model), **OVERRIDES, "engine_failure_threshold": 2, "max_engine_restarts": 0},
    )
    server = TritonServer(
        repo, http_port=0, grpc_port=0, metrics_port=0, startup_timeout=300, exit_timeout=5
    ).start()
    errors = []
    try:
        for i in range(2):
            _, error = run_stream(server, text_inputs(f"request {i}", sampling={"max_tokens": 4}))
            errors.append(str(error))
        code = server.process.wait(30)
    finally:
        server.kill()
    assert all("NaN" in e for e in errors), errors
    assert code is not None and not server.is_ready()
    assert "cannot be recovered" in server.log_path.read_text()
    assert wait_gone(server.shm_prefix) == ([], [])


def test_a_stub_killed_before_serve_saw_ready_is_a_crash_to_restart_not_a_failed_start(
    tiny_model, tmp_path
):
    """Seen in CI: the stub died after tritonserver was listening but before ``serve``'s own
    readiness poll saw it, and ``serve`` exited 1 as if the server could not start. The
    launcher now tells the two apart from this run's log: ``came_up`` is True here, so
    ``serve`` hands it to the restart loop; a server that never listened raises as before."""
    repo = render_model_repository(REPO, tmp_path / "repo", {"model": str(tiny_model), **OVERRIDES})
    server = TritonServer(
        repo,
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
        startup_timeout=300,
        log_path=tmp_path / "log",
    )
    (tmp_path / "log").write_text(
        "Started GRPCInferenceService\nStarted HTTPService\n"
    )  # an older run's
    server.start(wait=False)
    try:
        assert not server.came_up()  # only this run's lines count
        deadline = time.monotonic() + 300
        while not server.is_ready():  # the test, not the launcher, sees it ready
            assert server.running and time.monotonic() < deadline
            time.sleep(0.1)
        stub = stub_pids(server.shm_prefix)
        assert len(stub) == 1
        os.kill(stub[0], signal.SIGKILL)
        server.process.wait(60)  # the watchdog stops tritonserver
        with pytest.raises(TritonServerError, match="before it was ready"):
            server.wait_ready()
        assert server.came_up()
    finally:
        server.kill()
    assert wait_gone(server.shm_prefix) == ([], [])
