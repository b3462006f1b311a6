"""KV events through a real tritonserver: a model configured with ``kv_events_config``
publishes vLLM-format batches that a plain ZMQ SUB client (loopback) decodes; the blocks of
a prompt arrive as BlockStored with vLLM's sha256_cbor chain over the prompt's tokens, and
the replay socket still holds the engine's first batch, AllBlocksCleared."""

import json
import os
import tempfile
import time

import pytest
import zmq

from slipstream.core import kv_cache_events as core
from slipstream.core.block_hash import Sha256CborHasher, int_block_hash
from slipstream.core.config import EngineConfig
from slipstream.core.sampling_params import SamplingParams
from slipstream.engine import LLMEngine
from slipstream.kv_events import wire
from slipstream.kv_events.publisher import END_SEQ
from slipstream.server.launch.launcher import TritonServer
from slipstream.server.launch.repository import render_model_repository
from server_support import MODEL, OVERRIDES, REPO
from support import http_generate, need_tritonserver

pytestmark = pytest.mark.skipif(
    os.environ.get("SLIPSTREAM_SKIP_SERVER_TESTS") == "1", reason="SLIPSTREAM_SKIP_SERVER_TESTS=1"
)

BLOCK = 16
PROMPT = " ".join(f"word{i}" for i in range(40))  # several full blocks


def prompt_ids(model_dir, prompt: str = PROMPT) -> list:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))(prompt)["input_ids"]


def check_chain(stored: list, ids: list) -> None:
    """Every hash is vLLM's chain over the event's tokens, from the prompt's first block."""
    hasher = Sha256CborHasher()
    parent, expected = None, []
    for i in range(len(ids) // BLOCK):
        parent = hasher.hash_block(parent, tuple(ids[i * BLOCK : (i + 1) * BLOCK]), None)
        expected.append(int_block_hash(parent))
    assert stored[0].parent_block_hash is None
    hashes = [h for event in stored for h in event.block_hashes]
    tokens = [t for event in stored for t in event.token_ids]
    assert hashes == expected[: len(hashes)] and len(hashes) >= len(ids) // BLOCK - 1
    assert tokens == ids[: len(tokens)]
    assert all(e.block_size == BLOCK and e.medium == "GPU" for e in stored)
    assert all(e.kv_cache_spec_kind == "full_attention" for e in stored)  # as vLLM labels them


def test_engine_sends_all_blocks_cleared_at_start_then_prompt_blocks(tiny_model):
    events: list = []
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model),
            block_size=BLOCK,
            prefix_caching_hash_algo="sha256_cbor",
            num_gpu_blocks_override=64,
            max_model_len=256,
        ),
        kv_event_sink=events.extend,
    )
    assert events == [core.AllBlocksCleared()]  # a (re)started engine's cache is empty
    engine.add_request(PROMPT, SamplingParams(max_tokens=2, temperature=0))
    while engine.has_unfinished():
        engine.step()
    stored = [e for e in events if isinstance(e, core.BlockStored)]
    ids = prompt_ids(tiny_model)
    fmt = wire.WireFormat(int_hashes=True)
    check_chain([fmt.event(e) for e in stored], ids)
    events.clear()
    assert engine.reset_prefix_cache() and events == [core.AllBlocksCleared()]


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.server
def test_triton_publishes_vllm_kv_events_to_a_zmq_subscriber(tiny_model, tmp_path):
    need_tritonserver()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.bind("tcp://127.0.0.1:0")  # the publisher connects (vLLM's rule for host:port)
    short = tempfile.mkdtemp(prefix="kv")  # ipc paths must be short
    replay = f"ipc://{short}/replay"
    config = {
        "enable_kv_cache_events": True,
        "endpoint": sub.getsockopt_string(zmq.LAST_ENDPOINT),
        "replay_endpoint": replay,
        "topic": "kv",
    }
    repo = render_model_repository(
        REPO,
        tmp_path / "repo",
        {
            "model": str(tiny_model),
            **OVERRIDES,
            "block_size": BLOCK,
            "kv_events_config": json.dumps(config),
        },
    )
    dealer = ctx.socket(zmq.DEALER)
    try:
        with TritonServer(
            repo, http_port=0, grpc_port=0, metrics_port=0, startup_timeout=300
        ) as srv:
            stored, attempt = [], 0
            deadline = time.monotonic() + 60
            # The first request's events can precede the subscription (ZMQ's slow joiner):
            # send new prompts until one's events arrive.
            while not stored and time.monotonic() < deadline:
                attempt += 1
                prompt = f"try {attempt}: {PROMPT}"
                body = {"text_input": prompt, "parameters": {"max_tokens": 2, "temperature": 0}}
                status, _ = http_generate(srv, MODEL, body)
                assert status == 200
                while sub.poll(500):
                    topic, seq, payload = sub.recv_multipart()
                    batch = wire.decoder().decode(payload)
                    stored += [e for e in batch.events if isinstance(e, wire.BlockStored)]
            dealer.connect(replay)
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            replies = []
            while not replies or replies[-1][2] != END_SEQ:
                assert dealer.poll(10000), "no replay answer"
                replies.append(dealer.recv_multipart())
    finally:
        dealer.close(linger=0)
        sub.close(linger=0)
        ctx.term()
    assert stored, "no BlockStored event reached the subscriber"
    check_chain(stored, prompt_ids(tiny_model, prompt))
    _, topic, seq, payload = replies[0]
    first = wire.decoder().decode(payload)
    assert int.from_bytes(seq, "big") == 0 and topic == b"kv"
    assert isinstance(first.events[0], wire.AllBlocksCleared)
