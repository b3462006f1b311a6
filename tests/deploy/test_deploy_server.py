"""The container's command on a real tritonserver, probed as Kubernetes probes it.

The server is started exactly as the image starts it: the Dockerfile's ENTRYPOINT script
(deploy/serve.sh, mapped back to this repository through the Dockerfile's COPY lines), the cpu
overlay's container `args` and literal `env`, the repository layout the image has (the shipped
model_repository beside deploy/, the embedded default model). Only the port numbers differ:
free ones replace 8000-8002 in the same SLIPSTREAM_*_PORT variables. The probe paths, the
readiness command and the HEALTHCHECK command are read from the rendered manifests and the
Dockerfile, not repeated here. The last test sends SIGTERM with a request in flight, as the
kubelet does when a pod is deleted, and ends the module's server.
"""

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from slipstream.server.launch.launcher import free_port
from slipstream.server.launch.scrape import family_types, parse_samples
from deploy_support import (
    DASHBOARD,
    ROOT,
    container,
    dockerfile_exec_form,
    find,
    http_path_probes,
    image_path_to_repo,
    plain_env,
    render,
)
from support import need_tritonserver

pytestmark = [
    pytest.mark.server,
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("SLIPSTREAM_SKIP_SERVER_TESTS") == "1",
        reason="SLIPSTREAM_SKIP_SERVER_TESTS=1",
    ),
]
OVERLAY = "cpu"
STREAM_TOKENS = 24


class ContainerProcess:
    """deploy/serve.sh running as the pod's container, its stdout (the container log) kept."""

    def __init__(self, env: dict, args: list) -> None:
        self.env = env
        self.ports = {
            name: int(env[f"SLIPSTREAM_{name.upper()}_PORT"])
            for name in ("http", "grpc", "metrics", "openai")
        }
        entrypoint = image_path_to_repo(dockerfile_exec_form("ENTRYPOINT")[-1])
        self.process = subprocess.Popen(
            [str(entrypoint), *args],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        self.log: list = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.log.append(line)

    def url(self, port_name: str, path: str) -> str:
        return f"http://127.0.0.1:{self.ports[port_name]}{path}"

    def get(self, port_name: str, path: str, timeout: float = 3.0) -> int:
        """An httpGet probe: the status code, 0 when the connection fails."""
        try:
            with urllib.request.urlopen(self.url(port_name, path), timeout=timeout) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except (urllib.error.URLError, OSError):
            return 0

    def run_probe_command(self, command: list) -> int:
        """An exec probe, in the container's environment."""
        return subprocess.run(command, env=self.env, capture_output=True, timeout=10).returncode

    def text_log(self) -> str:
        return "".join(self.log)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def container_env(spec: dict) -> dict:
    """The container's environment here: its literal values with free ports, what the kubelet
    would fill in resolved for this machine, and this environment's `slipstream` on PATH."""
    env = dict(os.environ)
    env.update(plain_env(spec))
    for name in ("HTTP", "GRPC", "METRICS", "OPENAI"):
        env[f"SLIPSTREAM_{name}_PORT"] = str(free_port())
    for item in spec.get("env", []):
        field = item.get("valueFrom", {}).get("resourceFieldRef", {})
        if field.get("resource") == "limits.cpu":  # this machine's cores play the limit
            env[item["name"]] = str(len(os.sched_getaffinity(0)))
    bindir = os.path.dirname(sys.executable)
    env["PATH"] = os.pathsep.join([bindir, env.get("PATH", "")])
    return env


@pytest.fixture(scope="module")
def spec():
    return container(OVERLAY)


@pytest.fixture(scope="module")
def pod(spec):
    """The container, started; returns once its startup probe passes, as the kubelet waits."""
    need_tritonserver()
    proc = ContainerProcess(container_env(spec), list(spec.get("args", [])))
    path, port = http_path_probes(spec)["startupProbe"]
    probe = spec["startupProbe"]
    budget = probe["periodSeconds"] * probe["failureThreshold"]
    start = time.monotonic()
    try:
        while proc.get(port, path) != 200:
            assert proc.process.poll() is None, f"the container exited:\n{proc.text_log()[-6000:]}"
            assert time.monotonic() - start < budget, f"startup probe failed for {budget} s"
            time.sleep(0.5)
        proc.startup_seconds = time.monotonic() - start
        yield proc
    finally:
        proc.stop()


def series_names(proc: ContainerProcess) -> set:
    """Every series a query may name: the families and their samples (a histogram's
    _bucket/_sum/_count, a counter's _total)."""
    text = urllib.request.urlopen(proc.url("metrics", "/metrics"), timeout=10).read().decode()
    return set(family_types(text)) | {s.name for s in parse_samples(text)}


def stream(proc: ContainerProcess, max_tokens: int, result: dict) -> None:
    body = json.dumps(
        {
            "text_input": "Tell me a long story about a lighthouse keeper.",
            "stream": True,
            "parameters": {
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "temperature": 0,
                "return_num_output_tokens": True,
                "return_finish_reason": True,
            },
        }
    )
    request = urllib.request.Request(
        proc.url("http", "/v2/models/slipstream/generate_stream"),
        data=body.encode(),
        headers={"Content-Type": "application/json"},
    )
    events = []
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            for line in r:
                if line.startswith(b"data:"):
                    events.append(json.loads(line[5:]))
                    result.setdefault("first_event", time.monotonic())
    except Exception as e:  # reported by the test
        result["error"] = repr(e)
    result["events"] = events
    result["end"] = time.monotonic()


# ------------------------------------------------------------------------------- probes
def test_startup_probe_passes_once_the_model_is_loaded(pod, spec):
    path, port = http_path_probes(spec)["startupProbe"]
    assert pod.get(port, path) == 200
    assert pod.get("http", "/v2/models/slipstream/ready") == 200


def test_readiness_probe_command_succeeds_on_a_ready_server(pod, spec):
    assert pod.run_probe_command(spec["readinessProbe"]["exec"]["command"]) == 0


def test_readiness_probe_command_fails_where_no_server_answers(pod, spec):
    env = dict(pod.env, SLIPSTREAM_HTTP_PORT=str(free_port()))
    assert (
        subprocess.run(
            spec["readinessProbe"]["exec"]["command"], env=env, capture_output=True, timeout=10
        ).returncode
        != 0
    )


def test_liveness_probe_answers(pod, spec):
    path, port = http_path_probes(spec)["livenessProbe"]
    assert pod.get(port, path) == 200


def test_image_healthcheck_command_succeeds(pod):
    assert pod.run_probe_command(dockerfile_exec_form("HEALTHCHECK")) == 0


# ------------------------------------------------------------------------------- serving
def test_service_http_port_generates_with_the_default_model(pod):
    body = json.dumps(
        {
            "text_input": "What is the capital of France?",
            "exclude_input_in_output": True,
            "parameters": {"temperature": 0, "max_tokens": 16, "apply_chat_template": True},
        }
    )
    request = urllib.request.Request(
        pod.url("http", "/v2/models/slipstream/generate"),
        data=body.encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as r:
        assert "Paris" in json.loads(r.read())["text_output"]


def test_openai_port_answers_health_models_and_chat(pod):
    """The container serves the OpenAI-compatible API on SLIPSTREAM_OPENAI_PORT (opened
    once Triton is ready)."""
    deadline = time.monotonic() + 60
    while pod.get("openai", "/health") != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert pod.get("openai", "/health") == 200, "".join(pod.log[-20:])
    with urllib.request.urlopen(pod.url("openai", "/v1/models"), timeout=10) as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == ["slipstream"]
    body = {
        "model": "slipstream",
        "max_tokens": 8,
        "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    }
    req = urllib.request.Request(
        pod.url("openai", "/v1/chat/completions"),
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        answer = json.loads(r.read())
    assert "Paris" in answer["choices"][0]["message"]["content"]


def test_triton_log_goes_to_the_container_log(pod):
    assert "successfully loaded 'slipstream'" in pod.text_log()


def test_metrics_port_serves_the_autoscaler_and_dashboard_metrics(pod):
    families = series_names(pod)
    hpa = find(render(f"overlays/{OVERLAY}"), "HorizontalPodAutoscaler")
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] in families
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queries += [
        v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"
    ]
    named = {n for q in queries for n in re.findall(r"\b(?:slipstream|nv)_[a-z0-9_]+", q)}
    assert named and named <= families, sorted(named - families)


# ------------------------------------------------------------------------------- NVIDIA's tools
# The requests the README's benchmark command lines make. genai-perf 0.0.16 wrote these payloads
# into its inputs.json (perf_analyzer, which sends them, cannot run on glibc < 2.38); aiperf's
# comes from the repository's template, rendered as aiperf renders it.
def sse_post(proc: ContainerProcess, path: str, payload: dict) -> list:
    request = urllib.request.Request(
        proc.url("http", path),
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as r:
        return [json.loads(line[5:]) for line in r if line.startswith(b"data:")]


def test_genai_perf_kserve_vllm_request_streams_over_grpc(pod):
    grpcclient = pytest.importorskip("tritonclient.grpc")

    def tensor(name, value, dtype):
        t = grpcclient.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        return t

    inputs = [  # --endpoint-type kserve --backend vllm --streaming --output-tokens-mean 8
        tensor(
            "text_input", np.array([b"Tybalt is gone and Romeo banished"], dtype=object), "BYTES"
        ),
        tensor("exclude_input_in_output", np.array([True]), "BOOL"),
        tensor("stream", np.array([True]), "BOOL"),
        tensor(
            "sampling_parameters",
            np.array([b'{"max_tokens":"8","min_tokens":"8"}'], dtype=object),
            "BYTES",
        ),
    ]
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{pod.ports['grpc']}")
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer("slipstream", inputs, enable_empty_final_response=True)
        texts = []
        while True:
            result, error = responses.get(timeout=300)
            assert error is None, error
            text = result.as_numpy("text_output")
            if text is not None:
                texts.append(text.reshape(-1)[0].decode())
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
        client.close()
    assert len(texts) >= 2 and "".join(texts).strip()


def test_genai_perf_generate_request_streams_from_generate_stream(pod):
    # --endpoint-type generate --endpoint v2/models/slipstream/generate_stream --streaming
    # --output-tokens-mean 12 --extra-inputs ignore_eos:true
    payload = {
        "text_input": ["Tybalt is gone and Romeo banished"],
        "stream": True,
        "max_tokens": 12,
        "ignore_eos": True,
        "return_num_output_tokens": True,
    }
    events = sse_post(pod, "/v2/models/slipstream/generate_stream", payload)
    assert "error" not in events[-1], events[-1]
    assert sum(e["num_output_tokens"] for e in events) == 12


def test_aiperf_template_payload_streams_from_generate_stream(pod):
    import jinja2

    template = (ROOT / "benchmarks" / "aiperf" / "generate_stream.json.j2").read_text()
    rendered = (
        jinja2.Environment(autoescape=True)
        .from_string(template)
        .render(text='Tybalt is "gone" & Romeo <banished>', stream=True, max_tokens=12)
    )
    payload = json.loads(rendered)
    payload["parameters"]["return_num_output_tokens"] = True
    events = sse_post(pod, "/v2/models/slipstream/generate_stream", payload)
    assert "error" not in events[-1], events[-1]
    assert all("text_output" in e for e in events)  # aiperf's response_field
    assert sum(e["num_output_tokens"] for e in events) == 12


# ------------------------------------------------------------------------------- termination
def test_sigterm_drains_the_in_flight_request_and_fails_readiness(pod, spec):
    """What the kubelet does on pod deletion: SIGTERM (after preStop), readiness probes go on,
    SIGKILL after terminationGracePeriodSeconds. The request in flight must finish, readiness
    must fail while draining, the process must exit in time."""
    result: dict = {}
    client = threading.Thread(target=stream, args=(pod, STREAM_TOKENS, result), daemon=True)
    client.start()
    deadline = time.monotonic() + 120
    while "first_event" not in result and client.is_alive():
        assert time.monotonic() < deadline, "no token streamed"
        time.sleep(0.05)
    pod.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    readiness = spec["readinessProbe"]["exec"]["command"]
    ready_while_draining = []
    while pod.process.poll() is None and time.monotonic() - signalled < 30:
        ready_while_draining.append(
            (time.monotonic() - signalled, pod.run_probe_command(readiness) == 0)
        )
        time.sleep(0.2)
    grace = find(render(f"overlays/{OVERLAY}"), "Deployment")["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"
    ]
    code = pod.process.wait(timeout=grace)
    client.join(timeout=30)
    assert code == 0, pod.text_log()[-4000:]
    assert "error" not in result, result.get("error")
    assert result["end"] > signalled, "the request had finished before SIGTERM: nothing drained"
    assert sum(e["num_output_tokens"] for e in result["events"]) == STREAM_TOKENS
    assert result["events"][-1]["finish_reason"] == "length"
    # The server turns not-ready as it handles the signal: a probe in the first moments may
    # still pass; none after that, and none once one has failed.
    assert ready_while_draining and not ready_while_draining[-1][1]
    first_failed = next(i for i, (_, ready) in enumerate(ready_while_draining) if not ready)
    assert all(at < 2.0 for at, _ in ready_while_draining[:first_failed]), ready_while_draining
    assert not any(ready for _, ready in ready_while_draining[first_failed:])
    assert time.monotonic() - signalled < grace
