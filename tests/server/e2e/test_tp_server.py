"""Tensor parallelism through the real tritonserver, on the embedded model: a ``model.json``
asking ``tensor_parallel_size: 2`` answers as one rank does; so do two "machines" on loopback
(``slipstream serve --nnodes 2``, the second headless); a killed rank is reported to the
request it fails, and the group comes back."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from slipstream.engine import LLMEngine
from slipstream.server.launch.launcher import TritonServer, free_port
from support import need_tritonserver
from tp_support import (
    AGREEMENT,
    MAX_TOKENS,
    PROMPTS,
    Answers,
    embedded_config,
    greedy_answers,
    teacher_forced_agreement,
)

pytestmark = [pytest.mark.server, pytest.mark.slow]
MODEL = "tp"
RANK_MODULE = "slipstream.engine.executor.rank_main"


@pytest.fixture(scope="module")
def reference():
    """One rank's answers, and its engine (to score what the servers answer)."""
    engine = LLMEngine(embedded_config())
    try:
        yield engine, greedy_answers(engine)
    finally:
        engine.close()


def _write_model(repo: Path) -> None:
    directory = repo / MODEL
    (directory / "1").mkdir(parents=True)
    (directory / "config.pbtxt").write_text(
        'backend: "slipstream"\n'
        "instance_group [{ count: 1 kind: KIND_MODEL }]\n"
        # a dead engine is restarted in the stub (the model stays loaded)
        'parameters: { key: "max_engine_restarts" value: { string_value: "1" } }\n'
    )
    args = {
        "model": "default",
        "tensor_parallel_size": 2,
        "max_model_len": 512,
        "kv_cache_memory_bytes": 64 * 2**20,
        "enforce_eager": True,
    }
    (directory / "1" / "model.json").write_text(json.dumps(args))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    need_tritonserver()
    repo = tmp_path_factory.mktemp("tp-repo")
    _write_model(repo)
    with TritonServer(
        repo, http_port=0, grpc_port=0, metrics_port=0, models=[MODEL], startup_timeout=600
    ) as srv:
        yield srv


def _generate(http_url: str, model: str, prompt: str) -> list[int]:
    """The token ids the server answers ``prompt`` with (from its per-token logprobs, whose
    entries list the sampled token first)."""
    body = {
        "text_input": prompt,
        "parameters": {
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 0,
            "return_logprobs": True,
            "exclude_input_in_output": True,
        },
    }
    request = urllib.request.Request(
        f"http://{http_url}/v2/models/{model}/generate", data=json.dumps(body).encode()
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        out = json.loads(response.read())
    entries = json.loads(out["logprobs"]) if isinstance(out["logprobs"], str) else out["logprobs"]
    if entries and isinstance(entries[0], str):  # one JSON string per sequence
        entries = json.loads(entries[0])
    return [int(next(iter(position))) for position in entries]


def _served(http_url: str, model: str) -> list[list[int]]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: batched as clients are
        return list(pool.map(lambda p: _generate(http_url, model, p), PROMPTS))


def _assert_one_ranks_answers(reference, served: list[list[int]]) -> None:
    """The same tokens as one rank, or (a sum's order flipped a near-tie) tokens one rank
    agrees with at >= 99.5% of teacher-forced positions."""
    engine, one = reference
    assert [len(t) for t in served] == [MAX_TOKENS] * len(PROMPTS)
    if served != one.token_ids:
        forced = Answers(one.prompt_ids, served, [])
        assert teacher_forced_agreement(engine, forced) >= AGREEMENT


def test_a_model_json_asking_two_ranks_answers_as_one_rank(server, reference):
    _assert_one_ranks_answers(reference, _served(server.http_url, MODEL))
    ranks = _rank_processes(server.process.pid)
    assert len(ranks) == 1  # rank 1 beside the stub, which is rank 0


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return False


def _rank_processes(ancestor: int) -> list[int]:
    """The rank processes (other than 0) started under process ``ancestor``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if RANK_MODULE.encode() in cmdline and _descends_from(int(entry.name), ancestor):
            found.append(int(entry.name))
    return found


def test_a_killed_rank_fails_its_request_by_name_and_the_group_comes_back(server):
    import tritonclient.grpc as grpcclient

    [rank] = _rank_processes(server.process.pid)
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        inputs = [
            grpcclient.InferInput("text_input", [1], "BYTES"),
            grpcclient.InferInput("stream", [1], "BOOL"),
            grpcclient.InferInput("sampling_parameters", [1], "BYTES"),
        ]
        inputs[0].set_data_from_numpy(np.array([b"Tell me a long story."], dtype=np.object_))
        inputs[1].set_data_from_numpy(np.array([True]))
        sampling = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}
        inputs[2].set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=np.object_))
        client.async_stream_infer(MODEL, inputs, enable_empty_final_response=True)
        result, error = responses.get(timeout=300)
        assert error is None  # streaming
        os.kill(rank, signal.SIGKILL)
        while error is None:
            result, error = responses.get(timeout=60)
        assert "rank 1" in error.message() and "SIGKILL" in error.message(), error.message()
    finally:
        client.stop_stream()
        client.close()
    deadline = time.monotonic() + 300  # the stub's supervisor builds a new group
    while True:
        try:
            answer = _generate(server.http_url, MODEL, PROMPTS[0])
            break
        except urllib.error.HTTPError:
            assert time.monotonic() < deadline
            time.sleep(1)
    assert len(answer) == MAX_TOKENS
    [again] = _rank_processes(server.process.pid)
    assert again != rank


# -- two machines on loopback ------------------------------------------------------------------
def _serve(*args: str, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "slipstream.server.launch.cli", "serve", *args]
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _ready(http_url: str, model: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/models/{model}/ready", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(90)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def test_two_machines_on_loopback_answer_as_one_rank(reference, tmp_path):
    need_tritonserver()
    master, http = free_port(), free_port()
    together = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(master)]
    leader = _serve(
        "--model",
        "default",
        "--tensor-parallel-size",
        "2",
        "--node-rank",
        "0",
        *together,
        "--http-port",
        str(http),
        "--grpc-port",
        "0",
        "--metrics-port",
        "0",
        "--set",
        "max_model_len=512",
        "--set",
        f"kv_cache_memory_bytes={64 * 2**20}",
        log=tmp_path / "node0.log",
    )
    headless = _serve("--node-rank", "1", *together, log=tmp_path / "node1.log")
    try:
        url = f"127.0.0.1:{http}"
        deadline = time.monotonic() + 600
        while not _ready(url, "slipstream"):
            logs = [(tmp_path / f"node{i}.log").read_text()[-3000:] for i in (0, 1)]
            assert leader.poll() is None and headless.poll() is None, logs
            assert time.monotonic() < deadline, logs
            time.sleep(1)
        _assert_one_ranks_answers(reference, _served(url, "slipstream"))
        assert len(_rank_processes(headless.pid)) == 1  # rank 1 runs on "machine" 1
        assert _rank_processes(leader.pid) == []  # rank 0 is the stub, alone on machine 0
    finally:
        _stop(leader)
        _stop(headless)
    assert _rank_processes(headless.pid) == [] and _rank_processes(leader.pid) == []
    assert "ranks 1-1 of rank 0's group" in (tmp_path / "node1.log").read_text()
