"""Scheduling and memory features end to end through a real tritonserver: priority policy,
swap preemption and n-gram speculative decoding all at once on a KV pool too small for the
load; every stream must still equal the plain engine's output for its prompt alone."""

import json
import os

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")

from slipstream import EngineConfig, SamplingParams  # noqa: E402
from slipstream.engine.loop import EngineLoop  # noqa: E402
from slipstream.server.launch.launcher import TritonServer  # noqa: E402
from slipstream.server.launch.repository import render_model_repository  # noqa: E402
from server_support import OVERRIDES, PROMPTS, REPO, StreamClient, metrics, text_inputs, texts  # noqa: E402

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(
        os.environ.get("SLIPSTREAM_SKIP_SERVER_TESTS") == "1",
        reason="SLIPSTREAM_SKIP_SERVER_TESTS=1",
    ),
]

LONG = {"temperature": 0, "max_tokens": 40, "ignore_eos": True}
FEATURES = {
    "policy": "priority",
    "preemption_mode": "swap",
    "speculative_method": "ngram",
    "num_speculative_tokens": 3,
    "block_size": 8,
    "num_gpu_blocks_override": 24,
    "max_num_batched_tokens": 64,
}


@pytest.fixture(scope="module")
def plain_texts(tiny_model):
    """Greedy text per prompt from the engine alone: no speculation, roomy KV, FIFO."""
    loop = EngineLoop(
        EngineConfig(
            model=str(tiny_model),
            max_model_len=OVERRIDES["max_model_len"],
            kv_cache_memory_bytes=OVERRIDES["kv_cache_memory_bytes"],
        )
    ).start()
    try:
        return {p: loop.generate(p, SamplingParams.from_dict(LONG)).text for p in PROMPTS[:12]}
    finally:
        loop.shutdown()


def test_priority_swap_and_speculation_through_triton(tiny_model, plain_texts, tmp_path):
    trace_file = tmp_path / "trace.json"
    repo = render_model_repository(
        REPO,
        tmp_path / "repo",
        {"model": str(tiny_model), **OVERRIDES, **FEATURES, "trace_file": str(trace_file)},
    )
    with TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0, startup_timeout=300) as srv:
        client = StreamClient(srv.grpc_url)
        try:
            for i, prompt in enumerate(plain_texts):
                client.send(
                    f"r{i}",
                    text_inputs(prompt, sampling=LONG, priority=np.array([i % 3], np.int32)),
                )
            got = {p: "".join(texts(client.responses(f"r{i}"))) for i, p in enumerate(plain_texts)}
            assert client.errors.empty()
        finally:
            client.close()
        m = metrics(srv)
    assert got == plain_texts
    assert m["slipstream_preemptions_total"] > 0  # 12 x 7 blocks wanted, 23 available
    assert m["slipstream_spec_draft_tokens_total"] > 0
    assert 0 <= m["slipstream_spec_acceptance_rate"] <= 1
    # The server wrote its step trace on shutdown: every request ran in some batch slot.
    events = json.loads(trace_file.read_text())["traceEvents"]
    ran = {e["name"] for e in events if e["ph"] == "X" and e["cat"] not in ("step", "padding")}
    assert len(ran) == len(plain_texts)
    # The KV was swapped, not recomputed: the trace marks each preemption with its mode, and
    # at least one victim's blocks went to the CPU pool (a preemption falls back to
    # recompute only when the pool is full). Their outputs are checked above.
    modes = [e["args"]["mode"] for e in events if e.get("cat") == "preemption"]
    assert len(modes) == m["slipstream_preemptions_total"]
    assert "swap" in modes, f"no preemption swapped its KV out: {modes}"
