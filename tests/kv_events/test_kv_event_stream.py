"""The engine's KV event stream for a known sequence of requests equals the one vLLM's own
engine published for it (data/kv_events/vllm_kv_stream.json, recorded by vLLM 0.32's ``LLM``
with make_vllm_stream.py beside it): the same batches of the same events (hashes, parents,
token ids, block size, medium, group, cache-spec kind), request by request; and requests that
share a prefix reuse its blocks as vLLM's do, also when they are queued together."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from slipstream import EngineConfig, SamplingParams
from slipstream.engine import LLMEngine
from slipstream.kv_events import wire
from support import tiny_model_dir

FIXTURE = json.loads(
    (Path(__file__).parent / "data" / "kv_events" / "vllm_kv_stream.json").read_text()
)


@pytest.fixture
def engine(monkeypatch):
    """The fixture's engine settings on the tiny llama (the events depend on token ids, not
    weights): its block size and step budget, vLLM's hashes, events to a list per step."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)  # vLLM's NONE_HASH seed
    batches: list = []
    eng = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir("llama")),
            block_size=FIXTURE["block_size"],
            max_num_batched_tokens=FIXTURE["max_num_batched_tokens"],
            max_model_len=1024,
            num_gpu_blocks_override=64,
            prefix_caching_hash_algo="sha256_cbor",
        ),
        kv_event_sink=batches.append,
    )
    eng.batches = batches
    return eng


def run(engine: LLMEngine, names: list) -> dict:
    """What the engine published while serving ``names`` together (one token each), as
    vLLM's subscriber decoded it, and the prompt tokens it took from its prefix cache."""
    engine.batches.clear()
    hits = engine.block_manager.stats.hits
    prompts = [FIXTURE["prompts"][name] for name in names]
    engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))
    fmt = wire.WireFormat(int_hashes=True)
    encoded = [
        [json.loads(msgspec.json.encode(fmt.event(e))) for e in batch] for batch in engine.batches
    ]
    events = [[{"type": type(e).__name__, **d} for e, d in zip(b, enc)]
              for b, enc in zip(engine.batches, encoded)]  # fmt: skip
    return {"batches": events, "hit_tokens": engine.block_manager.stats.hits - hits}


def stored_blocks(batches: list) -> set:
    """(parent hash, hash, its tokens) of every block announced: the same blocks whichever
    steps computed them and however they were grouped into events."""
    size = FIXTURE["block_size"]
    blocks = set()
    for event in (e for batch in batches for e in batch if e["type"] == "BlockStored"):
        parent = event["parent_block_hash"]
        for i, block in enumerate(event["block_hashes"]):
            blocks.add((parent, block, tuple(event["token_ids"][i * size : (i + 1) * size])))
            parent = block
    return blocks


def test_requests_one_at_a_time_publish_vllms_batches_event_for_event(engine):
    engine.batches.clear()  # the new cache's AllBlocksCleared
    for case in FIXTURE["sequential"]:
        got = run(engine, case["requests"])
        assert got["batches"] == case["batches"], case["requests"]
        assert got["hit_tokens"] == case["hit_tokens"]


def test_same_prefix_requests_queued_together_reuse_it_as_vllms_engine_does(engine):
    """X and A2 fill the first step; B2, queued with them, shares A2's prefix. vLLM caches
    a block when it schedules it, so B2 takes all ten prefix blocks while A2 computes them;
    the engine must not compute them a second time for B2."""
    case = FIXTURE["co_queued"]
    got = run(engine, case["requests"])
    assert got["hit_tokens"] == case["hit_tokens"] == 10 * FIXTURE["block_size"]
    # the same blocks enter the cache, chained to the same parents, as vLLM announced them
    assert stored_blocks(got["batches"]) == stored_blocks(case["batches"])
