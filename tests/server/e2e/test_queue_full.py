"""A full waiting queue answers like a server: refused at once with code UNAVAILABLE and a
Retry-After-style message (HTTP 503 where Triton maps the code, gRPC UNAVAILABLE), and a
server ships with a bounded queue by default."""

import json
import os
import shutil
import threading
import time

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

from slipstream.engine import OVERLOADED, OverloadedError  # noqa: E402
from slipstream.server.launch.launcher import TritonServer  # noqa: E402
from slipstream.server.launch.repository import render_model_repository  # noqa: E402
from slipstream.server.stub.model_config import DEFAULT_MAX_QUEUE_SIZE, load_settings  # noqa: E402
from fault_support import FAULT_MODEL_PY  # noqa: E402
from server_support import OVERRIDES, REPO, http_post  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("SLIPSTREAM_SKIP_SERVER_TESTS") == "1", reason="SLIPSTREAM_SKIP_SERVER_TESTS=1"
)
UNARY = "slipstream_unary"
# long enough that both held requests are still there when the third arrives (a 40-token
# request on the tiny model ended within the 0.3 s between submissions on an idle machine)
LONG = json.dumps({"temperature": 0, "max_tokens": 1000, "ignore_eos": True})
RETRY = "retry after 1 s"


def test_a_server_bounds_its_queue_by_default(tmp_path):
    """Before: max_queue_size 0 (unbounded) unless configured."""
    (tmp_path / "1").mkdir()
    assert load_settings({}, "python", tmp_path).engine["max_queue_size"] == DEFAULT_MAX_QUEUE_SIZE
    unbounded = load_settings({"max_queue_size": "0"}, "python", tmp_path)
    assert unbounded.engine["max_queue_size"] == "0"
    shipped = (REPO / "slipstream" / "config.pbtxt").read_text()
    assert 'key: "max_queue_size"\n  value: { string_value: "256" }' in shipped
    message = str(OverloadedError.queue_full(7))
    assert message.startswith(OVERLOADED) and RETRY in message


def infer_body(sampling):
    return {
        "inputs": [
            {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["x"]},
            {"name": "sampling_parameters", "shape": [1], "datatype": "BYTES", "data": [sampling]},
        ]
    }


def grpc_inputs(sampling):
    inputs = []
    for name, value in (("text_input", b"x"), ("sampling_parameters", sampling.encode())):
        tensor = grpcclient.InferInput(name, [1], "BYTES")
        tensor.set_data_from_numpy(np.array([value], dtype=object))
        inputs.append(tensor)
    return inputs


@pytest.mark.server
@pytest.mark.slow
def test_a_full_queue_is_refused_with_unavailable_and_a_retry_hint(tiny_model, tmp_path):
    """One request runs, one waits (max_num_seqs 1, max_queue_size 1): the next is refused at
    once. Before: "retry later" with no hint of when; HTTP 400 on every endpoint."""
    src = tmp_path / "src"
    shutil.copytree(REPO, src)
    shutil.copytree(src / "slipstream", src / UNARY)
    config = src / UNARY / "config.pbtxt"
    config.write_text(
        config.read_text()
        .replace('name: "slipstream"', f'name: "{UNARY}"')
        .replace("model_transaction_policy {\n  decoupled: true\n}\n", "")
        + 'parameters: {\n  key: "decoupled"\n'
        '  value: { string_value: "false" }\n}\n'
    )
    repo = render_model_repository(
        src,
        tmp_path / "repo",
        {"model": str(tiny_model), **OVERRIDES, "max_num_seqs": 1, "max_queue_size": 1},
    )
    # Slow steps keep the held requests running whatever the machine: the tiny model wrote to
    # the context's end within the 0.3 s between submissions on an idle machine.
    (repo / UNARY / "1" / "model.py").write_text(FAULT_MODEL_PY)
    fault = tmp_path / "fault"
    fault.write_text("slow 0.05")
    with TritonServer(
        repo,
        http_port=0,
        grpc_port=0,
        metrics_port=0,
        startup_timeout=300,
        models=["slipstream", UNARY],
        env={"SLIPSTREAM_FAULT_FILE": str(fault)},
    ) as server:
        held = [
            threading.Thread(
                target=http_post, args=(server, f"/v2/models/{UNARY}/infer", infer_body(LONG))
            )
            for _ in range(2)
        ]
        for thread in held:
            thread.start()
            time.sleep(0.3)  # the first runs before the second arrives, which waits
        started = time.monotonic()
        status, body = http_post(server, f"/v2/models/{UNARY}/infer", infer_body("{}"))
        assert status == 503 and OVERLOADED in body and RETRY in body, (status, body)
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            with pytest.raises(InferenceServerException) as refused:
                client.infer(UNARY, grpc_inputs("{}"))
        assert refused.value.status() == "StatusCode.UNAVAILABLE"
        assert RETRY in refused.value.message()
        assert time.monotonic() - started < 5  # refused at once, not after the held ones
        fault.write_text("")  # the held ones may finish now
        for thread in held:
            thread.join(180)
            assert not thread.is_alive()
        # The decoupled model's generate: Triton 2.51 answers 400 for any model error
        # there (docs/robustness.md), so the message is what tells a client to retry.
        status, body = http_post(
            server,
            "/v2/models/slipstream/generate",
            {"text_input": "x", "parameters": {"max_tokens": 2}},
        )
        assert status == 200, body
