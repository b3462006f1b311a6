"""What the tests against a real tritonserver share: the shipped repository and the tiny
model's settings, gRPC/HTTP request helpers, the server's metrics and what it leaves behind.

tritonclient is imported where it is used: the e2e conftest reads the constants here, and a
missing client extra must skip the modules that need it (their ``importorskip``), not break
collection.
"""

import glob
import json
import queue
import subprocess
import time
import urllib.error
import urllib.request

import numpy as np

from slipstream.server.launch.scrape import scrape
from support import ROOT

REPO = ROOT / "model_repository"
MODEL = "slipstream"
MAX_MODEL_LEN = 1024  # the tiny model's position limit: the longest request a cancel must cut short
OVERRIDES = {
    "kv_cache_memory_bytes": 8 * 1024 * 1024,
    "max_model_len": MAX_MODEL_LEN,
    "max_num_seqs": 32,
    "metrics_interval_ms": 50,
}
PROMPTS = [
    "Hello there",
    "The quick brown fox jumps over the lazy dog",
    "Once upon a time",
    "What is the capital of France?",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "Triton Inference Server streams tokens",
    "a",
    "Paged attention stores keys and values in blocks of sixteen tokens each, "
    "so that memory is allocated on demand",
    "In-flight batching",
    "Why is the sky blue?",
    "def fibonacci(n):",
    "Bonjour, comment allez-vous ?",
    "The meaning of life is",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit",
    "x y z",
    "The end.",
]
GREEDY = {"temperature": 0, "max_tokens": 12}


def tensor(name, value):
    import tritonclient.grpc as grpcclient

    value = np.asarray(value)
    dtype = {"O": "BYTES", "b": "BOOL"}.get(value.dtype.kind) or {
        np.dtype(np.int32): "INT32",
        np.dtype(np.float32): "FP32",
        np.dtype(np.uint64): "UINT64",
        np.dtype(np.int64): "INT64",
    }[value.dtype]
    t = grpcclient.InferInput(name, list(value.shape), dtype)
    t.set_data_from_numpy(value)
    return t


def text_inputs(prompt, stream=True, sampling=None, **extra):
    prompt = prompt if isinstance(prompt, bytes) else prompt.encode()
    inputs = [
        tensor("text_input", np.array([prompt], dtype=object)),
        tensor("stream", np.array([stream])),
    ]
    if sampling is not None:
        body = sampling if isinstance(sampling, str) else json.dumps(sampling)
        inputs.append(tensor("sampling_parameters", np.array([body.encode()], dtype=object)))
    for name, value in extra.items():
        inputs.append(tensor(name, value))
    return inputs


class StreamClient:
    """Many requests on one gRPC stream; responses routed by request id."""

    def __init__(self, url):
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.queues = {}
        self.errors = queue.Queue()
        self.client.start_stream(callback=self._callback)

    def _callback(self, result, error):
        if error is not None:
            self.errors.put(error)
            return
        self.queues[result.get_response().id].put(result)

    def send(self, request_id, inputs):
        self.queues[request_id] = queue.Queue()
        self.client.async_stream_infer(
            MODEL, inputs, request_id=request_id, enable_empty_final_response=True
        )

    def responses(self, request_id, timeout=120):
        out = []
        while True:
            result = self.queues[request_id].get(timeout=timeout)
            out.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return out

    def close(self, cancel=False):
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def run_stream(server, inputs, timeout=120):
    """One request on its own stream: (responses, error)."""
    import tritonclient.grpc as grpcclient

    results = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(MODEL, inputs, enable_empty_final_response=True)
    out = []
    try:
        while True:
            result, error = results.get(timeout=timeout)
            if error is not None:
                return out, error
            out.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return out, None
    finally:
        client.stop_stream()
        client.close()


def texts(results):
    out = []
    for r in results:
        t = r.as_numpy("text_output")
        if t is not None:
            out.append(t.reshape(-1)[0].decode())
    return out


def http_post(server, path, body, timeout=120):
    req = urllib.request.Request(
        f"http://{server.http_url}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metrics(server):
    """slipstream_* values by name (a bucket's name carries its le: ``..._bucket{le="0.1"}``)."""
    return {
        s.name + (f'{{le="{s.labels["le"]}"}}' if "le" in s.labels else ""): float(s.value)
        for s in scrape(server.metrics_url)
        if s.name.startswith("slipstream_")
    }


def wait_metric(server, name, predicate, timeout=15):
    deadline = time.monotonic() + timeout
    while True:
        value = metrics(server).get(name)
        if value is not None and predicate(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"metric {name} = {value} after {timeout} s")
        time.sleep(0.05)


def leftovers(shm_prefix):
    """Processes (stubs, watchdogs) and shared-memory regions of one server still around."""
    procs = subprocess.run(
        ["pgrep", "-f", shm_prefix], capture_output=True, text=True
    ).stdout.split()
    return procs, glob.glob(f"/dev/shm/{shm_prefix}*")


def wait_gone(shm_prefix, timeout=10):
    deadline = time.monotonic() + timeout
    while any(leftovers(shm_prefix)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return leftovers(shm_prefix)
