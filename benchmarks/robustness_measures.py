"""Figures for issue 12's classes (hostile input, a dead engine, shutdown), measured against a
real tritonserver on the tiny random model: what each client gets, requests sent / completed /
refused / cancelled, KV blocks leaked, clients left hanging, processes and shared-memory
regions left after the server stopped.

    PYTHONPATH=backend:benchmarks python benchmarks/robustness_measures.py [--out FILE.json]

Takes a few minutes (about ten server starts). Timings depend on the machine's load.
"""

from __future__ import annotations

import argparse
import glob
import http.client
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from slipstream.cache_dir import cache_root
from slipstream.server.launch.launcher import TritonServer, free_port, stub_pids
from slipstream.server.launch.repository import DEFAULT_MODEL_REPOSITORY, render_model_repository
from slipstream.server.launch.scrape import sample_value, scrape
from slipstream.testing import make_tiny_model_dir

SETTINGS = {
    "kv_cache_memory_bytes": 8 * 1024 * 1024,
    "max_model_len": 512,
    "max_num_seqs": 32,
    "metrics_interval_ms": 50,
}
GREEDY = {"temperature": 0, "max_tokens": 60, "ignore_eos": True}
LONG = {"temperature": 0, "max_tokens": 480, "ignore_eos": True}


# ----------------------------------------------------------------------------- clients
def tensor(name, value):
    value = np.asarray(value)
    dtype = {"O": "BYTES", "b": "BOOL"}.get(value.dtype.kind) or {
        np.dtype(np.int32): "INT32",
        np.dtype(np.uint64): "UINT64",
    }[value.dtype]
    t = grpcclient.InferInput(name, list(value.shape), dtype)
    t.set_data_from_numpy(value)
    return t


def inputs(prompt, sampling=None, **extra):
    ins = [
        tensor("text_input", np.array([prompt.encode()], dtype=object)),
        tensor("stream", np.array([True])),
    ]
    if sampling is not None:
        body = sampling if isinstance(sampling, str) else json.dumps(sampling)
        ins.append(tensor("sampling_parameters", np.array([body.encode()], dtype=object)))
    return ins + [tensor(k, v) for k, v in extra.items()]


def stream(url, ins, timeout=120):
    """(text, error or None, seconds)."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    started = time.monotonic()
    client.async_stream_infer("slipstream", ins, enable_empty_final_response=True)
    parts = []
    try:
        while True:
            result, error = results.get(timeout=timeout)
            if error is not None:
                return "".join(parts), str(error), time.monotonic() - started
            out = result.as_numpy("text_output")
            if out is not None:
                parts.append(out.reshape(-1)[0].decode())
            if result.get_response().parameters["triton_final_response"].bool_param:
                return "".join(parts), None, time.monotonic() - started
    finally:
        client.stop_stream()
        client.close()


def metric(server, name):
    value = sample_value(scrape(server.metrics_url, timeout=5), name)
    assert value is not None, f"{name} is not exported"
    return value


def blocks_used(server, settle=3.0):
    deadline = time.monotonic() + settle
    while True:
        used = metric(server, "slipstream_kv_blocks_used")
        if used == 0 or time.monotonic() > deadline:
            return int(used)
        time.sleep(0.05)


def leftovers(prefix):
    procs = subprocess.run(["pgrep", "-f", prefix], capture_output=True, text=True).stdout.split()
    return {"processes": len(procs), "shm_regions": len(glob.glob(f"/dev/shm/{prefix}*"))}


def settle_leftovers(prefix, timeout=10):
    deadline = time.monotonic() + timeout
    while any(leftovers(prefix).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return leftovers(prefix)


def start(model, tmp, exit_timeout=30, model_control="explicit", **extra):
    repo = render_model_repository(
        DEFAULT_MODEL_REPOSITORY,
        Path(tempfile.mkdtemp(dir=tmp)) / "r",
        {"model": str(model), **SETTINGS, **extra},
    )
    return TritonServer(
        repo,
        http_port=0,
        grpc_port=0,
        metrics_port=0,
        startup_timeout=300,
        exit_timeout=exit_timeout,
        model_control=model_control,
    ).start()


# ----------------------------------------------------------------------------- classes
BAD_VALUES = {
    "temperature 1e-300": {"temperature": 1e-300, "max_tokens": 8},
    "repetition_penalty 1e-300, temperature 1": {"temperature": 1, "repetition_penalty": 1e-300},
    "seed 2**64": {"seed": 2**64, "temperature": 1},
    "seed -2**63-1": {"seed": -(2**63) - 1, "temperature": 1},
    "stop_token_ids [10**12], min_tokens 2": {"stop_token_ids": [10**12], "min_tokens": 2},
    "stop_token_ids [vocab size], min_tokens 2": {"stop_token_ids": [49152], "min_tokens": 2},
    "sampling_parameters nested 100,000 deep": "[" * 100_000 + "]" * 100_000,
}


def measure_values(server, per_class=5):
    """Each class ``per_class`` times at once beside one greedy stream."""
    solo, _, _ = stream(server.grpc_url, inputs("the greedy stream", GREEDY))
    rows = {}
    cases = dict(BAD_VALUES)
    cases["typed end_id 2**31-1, min_tokens 2"] = None
    for name, sampling in cases.items():
        outcome = {}

        def bad(i):
            if sampling is None:
                ins = inputs("hello", {"min_tokens": 2}, end_id=np.array([2**31 - 1], np.int32))
            else:
                ins = inputs("hello", sampling)
            outcome[i] = stream(server.grpc_url, ins)

        greedy = {}
        g = threading.Thread(
            target=lambda: greedy.update(
                r=stream(server.grpc_url, inputs("the greedy stream", GREEDY))
            )
        )
        g.start()
        time.sleep(0.2)
        threads = [threading.Thread(target=bad, args=(i,)) for i in range(per_class)]
        for t in threads:
            t.start()
        for t in threads + [g]:
            t.join(120)
        errors = [e for _, e, _ in outcome.values() if e]
        rows[name] = {
            "sent": per_class,
            "completed": per_class - len(errors),
            "refused": len(errors),
            "client gets": (errors[0][:110] if errors else "served (greedy)"),
            "greedy stream byte-identical": greedy["r"][0] == solo and greedy["r"][1] is None,
            "hanging": sum(t.is_alive() for t in threads),
            "leaked blocks": blocks_used(server),
        }
    return rows


def measure_http_strings(server):
    path = "/v2/models/slipstream/generate"
    rows = {}
    for label, body in (
        ("parameters max_tokens '12'", {"parameters": {"max_tokens": "12"}}),
        ("parameters temperature '0'", {"parameters": {"temperature": "0"}}),
        ("parameters seed 2**64+5", {"parameters": {"seed": 2**64 + 5}}),
        (
            "sampling_parameters max_tokens '12', temperature '0'",
            {"sampling_parameters": json.dumps({"max_tokens": "12", "temperature": "0"})},
        ),
        (
            "sampling_parameters seed '2**64+5'",
            {"sampling_parameters": json.dumps({"seed": str(2**64 + 5)})},
        ),
    ):
        req = urllib.request.Request(
            f"http://{server.http_url}{path}",
            data=json.dumps({"text_input": "hi", **body}).encode(),
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                rows[label] = f"{r.status}"
        except urllib.error.HTTPError as e:
            rows[label] = f"{e.code}: {json.loads(e.read())['error'][:90]}"
    return rows


def rss_mb(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def measure_fairness(server, rounds=3):
    """Each hostile request beside a greedy stream, in rounds alternating with the stream
    alone (the machine's speed drifts): the median slowdown of the stream, the median
    latency of a small request sent right after, the stub's memory growth."""
    stub = stub_pids(server.shm_prefix)[0]
    hostile = {
        "100,000 stop strings (1.4 MB JSON)": lambda: inputs(
            "hello", {"stop": [f"stop{i}" for i in range(100_000)]}
        ),
        "64 stop strings of 256 characters": lambda: inputs(
            "hello",
            {
                "stop": ["x" * 255 + str(i % 10) for i in range(64)],
                "max_tokens": 60,
                "ignore_eos": True,
            },
        ),
        "8 MB prompt": lambda: inputs("word " * (8 * 1024 * 1024 // 5)),
    }
    rows = {}
    for label, make in hostile.items():
        ratios, smalls, answers, growth = [], [], [], []
        for _ in range(rounds):
            _, _, alone = stream(server.grpc_url, inputs("the greedy stream", GREEDY))
            rss_before = rss_mb(stub)
            result = {}
            g = threading.Thread(
                target=lambda: result.update(
                    g=stream(server.grpc_url, inputs("the greedy stream", GREEDY))
                )
            )
            g.start()
            time.sleep(0.3)
            _, error, answered = stream(server.grpc_url, make())
            _, _, small = stream(
                server.grpc_url, inputs("a small one", {"temperature": 0, "max_tokens": 4})
            )
            g.join(120)
            ratios.append(result["g"][2] / alone)
            smalls.append(small)
            answers.append(answered)
            growth.append(rss_mb(stub) - rss_before)
        rows[label] = {
            "client gets": (error or "served")[:100],
            "answered in s (median)": round(float(np.median(answers)), 2),
            "greedy stream slowdown x (median)": round(float(np.median(ratios)), 2),
            "small request beside it, s (median)": round(float(np.median(smalls)), 2),
            "stub RSS growth MB (max)": round(max(growth), 1),
        }
    return rows


def measure_dropped(server, count=25):
    """Clients that disconnect: generate_stream is cancelled, /generate is not (Triton)."""
    host, port = server.http_url.split(":")
    rows = {}
    for path in ("generate_stream", "generate"):
        body = json.dumps(
            {
                "text_input": "tell me a long story",
                "stream": path.endswith("m"),
                "parameters": {**LONG, "max_tokens": 400},
            }
        ).encode()
        socks = []
        for _ in range(count):
            s = socket.create_connection((host, int(port)))
            s.sendall(
                b"POST /v2/models/slipstream/%s HTTP/1.1\r\nHost: t\r\nContent-Type: "
                b"application/json\r\nContent-Length: %d\r\n\r\n"
                % (path.encode(), len(body))
                + body
            )
            socks.append(s)
        time.sleep(1.5)
        held = blocks_used(server, settle=0)
        for s in socks:
            s.close()
        t0 = time.monotonic()
        left = blocks_used(server, settle=10)
        rows[path] = {
            "sent": count,
            "blocks held before disconnect": held,
            "blocks held 10 s after disconnect" if left else "blocks freed within s": left
            if left
            else round(time.monotonic() - t0, 2),
        }
        blocks_used(server, settle=120)  # let /generate ones run out
    return rows


# ----------------------------------------------------------------------------- lifecycle
class Streams:
    def __init__(self, server, n_grpc=3, http=True, sampling=LONG):
        self.results, self.threads = {}, []
        for i in range(n_grpc):
            self.threads.append(threading.Thread(target=self._grpc, args=(server, i, sampling)))
        if http:
            self.threads.append(threading.Thread(target=self._http, args=(server, sampling)))
        for t in self.threads:
            t.start()

    def _grpc(self, server, i, sampling):
        _, error, _ = stream(server.grpc_url, inputs(f"story {i}", sampling))
        self.results[f"grpc{i}"] = error[:90] if error else "completed"

    def _http(self, server, sampling):
        req = urllib.request.Request(
            f"http://{server.http_url}/v2/models/slipstream/generate_stream",
            data=json.dumps({"text_input": "x", "stream": True, "parameters": sampling}).encode(),
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                events = [json.loads(line[5:]) for line in r if line.startswith(b"data:")]
            last = events[-1] if events else {}
            self.results["http"] = (
                f"status 200, last event error: {last['error'][:70]}"
                if "error" in last
                else f"status 200, {len(events)} events"
            )
        except Exception as exc:  # noqa: BLE001
            self.results["http"] = repr(exc)[:90]

    def join(self, timeout=120):
        for t in self.threads:
            t.join(timeout)
        return sum(t.is_alive() for t in self.threads)


def cancel_after_final(server, n=20):
    """Streams closed with stop_stream(cancel_requests=True) right after their final response;
    returns how many could not be sent."""
    failed = 0
    for i in range(n):
        client = grpcclient.InferenceServerClient(server.grpc_url)
        done = threading.Event()
        client.start_stream(
            callback=lambda result, error: (
                (error or result.get_response().parameters["triton_final_response"].bool_param)
                and done.set()
            )
        )
        try:
            client.async_stream_infer(
                "slipstream",
                inputs(f"hi {i}", {"temperature": 0, "max_tokens": 3}),
                enable_empty_final_response=True,
            )
            done.wait(60)
        except Exception:  # noqa: BLE001 - counted
            failed += 1
        client.stop_stream(cancel_requests=True)
        client.close()
    return failed


def measure_sigterm(model, tmp, exit_timeout=3):
    server = start(model, tmp, exit_timeout=exit_timeout, model_control="none")
    clients = Streams(server)
    time.sleep(2)
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    code = server.process.wait(120)
    took = time.monotonic() - started
    hanging = clients.join()
    prefix = server.shm_prefix
    finalized = "slipstream: finalize" in server.log_path.read_text()
    left = settle_leftovers(prefix)
    server.kill()
    return {
        "exit code": code,
        "exit after s": round(took, 1),
        "finalized": finalized,
        "clients": clients.results,
        "hanging": hanging,
        **left,
    }


def measure_stop_keepalive(model, tmp):
    server = start(model, tmp, exit_timeout=30)
    idle = http.client.HTTPConnection(*server.http_url.split(":"))
    idle.request("GET", "/v2/health/ready")
    idle.getresponse().read()
    clients = Streams(server, sampling={**LONG, "max_tokens": 40})
    time.sleep(0.5)
    started = time.monotonic()
    server.stop()
    took = time.monotonic() - started
    idle.close()
    report = server.last_stop
    return {
        "stop took s": round(took, 1),
        "models unloaded (finalized)": report.models_unloaded,
        "tritonserver exit code": report.exit_code,
        "clients": clients.results,
        "hanging": clients.join(),
        **settle_leftovers(server.shm_prefix),
    }


def measure_cancel_then_stop(model, tmp, runs=4):
    rows = []
    for how in ("SIGINT to tritonserver", "TritonServer.stop"):
        for _ in range(runs):
            server = start(
                model,
                tmp,
                exit_timeout=5,
                model_control="none" if how.startswith("SIGINT") else "explicit",
            )
            not_sent = cancel_after_final(server)
            started = time.monotonic()
            if how.startswith("SIGINT"):
                server.process.send_signal(signal.SIGINT)
                code = server.process.wait(60)
            else:
                server.stop()
                code = server.last_stop.exit_code
            took = time.monotonic() - started
            finalized = "slipstream: finalize" in server.log_path.read_text()
            left = settle_leftovers(server.shm_prefix)
            server.kill()
            rows.append(
                {
                    "how": how,
                    "streams not sent": not_sent,
                    "exit code": code,
                    "took s": round(took, 1),
                    "finalized": finalized,
                    **left,
                }
            )
    return rows


def measure_killed_stub(model):
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "slipstream.server",
        "--model",
        str(model),
        "--http-port",
        str(http_port),
        "--grpc-port",
        str(grpc_port),
        "--metrics-port",
        str(metrics_port),
        "--exit-timeout",
        "5",
    ]
    cmd += [a for k, v in SETTINGS.items() for a in ("--set", f"{k}={v}")]
    serve = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = TritonServer(
        DEFAULT_MODEL_REPOSITORY,
        http_port=http_port,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
    )
    prefix = f"slipstream_{serve.pid}_{grpc_port}_"
    while not server.is_ready():
        time.sleep(0.2)
    clients = Streams(server, n_grpc=5, http=False)
    time.sleep(1.5)
    stub = stub_pids(prefix)[0]
    killed = time.monotonic()
    os.kill(stub, signal.SIGKILL)
    hanging = clients.join(timeout=30)
    errors_in = time.monotonic() - killed
    while not server.is_ready():
        time.sleep(0.1)
    back_in = time.monotonic() - killed
    text, error, _ = stream(server.grpc_url, inputs("back", {"temperature": 0, "max_tokens": 4}))
    serve.send_signal(signal.SIGTERM)
    code = serve.wait(60)
    return {
        "clients": clients.results,
        "all clients answered within s": round(errors_in, 2),
        "hanging": hanging,
        "ready again after s": round(back_in, 1),
        "request after restart": "ok" if error is None else error[:80],
        "slipstream serve exit code": code,
        **settle_leftovers(prefix),
    }


def measure_failing_engine(model, tmp):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = Path(tmp) / "nan-model"
    m = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    with torch.no_grad():
        m.get_output_embeddings().weight.fill_(float("nan"))
    m.config.tie_word_embeddings = False
    m.save_pretrained(target)
    AutoTokenizer.from_pretrained(str(model)).save_pretrained(target)
    server = start(target, tmp, exit_timeout=5, engine_failure_threshold=5, max_engine_restarts=1)
    started = time.monotonic()
    answers = []
    while server.running and time.monotonic() - started < 120:
        try:
            _, error, _ = stream(server.grpc_url, inputs("hi", {"max_tokens": 4}), timeout=30)
        except Exception as exc:  # noqa: BLE001 - the server went away under the client
            error = repr(exc)
        answers.append((error or "ok")[:90])
    gone_after = time.monotonic() - started
    left = settle_leftovers(server.shm_prefix)
    server.kill()
    kinds = {}
    for a in answers:
        key = (
            "NaN logits"
            if "NaN" in a
            else "engine not serving (restarting)"
            if "restarting" in a or "not serving" in a
            else a[:60]
        )
        kinds[key] = kinds.get(key, 0) + 1
    return {
        "requests sent": len(answers),
        "answers": kinds,
        "server gone (not ready) after s": round(gone_after, 1),
        **left,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="also write the figures as JSON here")
    args = p.parse_args()
    model = make_tiny_model_dir(cache_root() / "test-models" / "tiny-llama", "llama")
    tmp = tempfile.mkdtemp(prefix="slipstream-robustness-")
    figures = {}

    def record(name, measure, *measure_args):
        try:
            figures[name] = measure(*measure_args)
        except Exception as exc:  # noqa: BLE001 - one failed measurement keeps the others
            figures[name] = {"measurement failed": repr(exc)}
        if args.out:
            args.out.write_text(json.dumps(figures, indent=2, default=str))

    server = start(model, tmp)
    try:
        record("bad values beside a greedy stream", measure_values, server)
        record("HTTP generate strings", measure_http_strings, server)
        record("fairness", measure_fairness, server)
        record("dropped HTTP connections", measure_dropped, server)
    finally:
        server.stop()
    record("kill -9 of the stub (slipstream serve)", measure_killed_stub, model)
    record("engine failing every step", measure_failing_engine, model, tmp)
    record("SIGTERM past a 3 s exit timeout (plain tritonserver)", measure_sigterm, model, tmp)
    record("stop with an idle keep-alive connection", measure_stop_keepalive, model, tmp)
    record(
        "20 streams cancelled after their final response, then stop",
        measure_cancel_then_stop,
        model,
        tmp,
    )
    print(json.dumps(figures, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
