"""KV cache events in vLLM's format, checked against vLLM's own code: block hashes and
encoded batches in tests/kv_events/data/kv_events/vllm_kv_events.json were made by vLLM 0.32
(make_vllm_fixtures.py beside them). The engine's events must encode to the same bytes,
the publisher must speak vLLM's ZMQ protocol (sequence numbers, replay) and never stall a
step; the real-server test is in test_kv_events_server.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from slipstream.core import kv_cache_events as core
from slipstream.core.block_hash import (
    BlockKeySource,
    Sha256CborHasher,
    event_extra_keys,
    int_block_hash,
)
from slipstream.core.block_manager import BlockManager
from slipstream.core.request import Request
from slipstream.core.sampling_params import SamplingParams
from slipstream.kv_events import wire
from slipstream.kv_events.config import KVEventsConfig
from slipstream.kv_events.publisher import END_SEQ, KVEventPublisher

FIXTURES = json.loads(
    (Path(__file__).parent / "data" / "kv_events" / "vllm_kv_events.json").read_text()
)
BLOCK = FIXTURES["block_size"]
TOKENS = FIXTURES["tokens"]
LORA = FIXTURES["lora"]
SALT = FIXTURES["cache_salt"]
TS = FIXTURES["ts"]


def keys(lora: bool, salt: bool) -> BlockKeySource:
    return BlockKeySource(
        LORA["name"] if lora else None, LORA["path"] if lora else None, SALT if salt else None
    )


def chain(hasher: Sha256CborHasher, source: BlockKeySource, tokens: list) -> list:
    hashes, parent = [], None
    for i in range(len(tokens) // BLOCK):
        parent = hasher.hash_block(
            parent, tuple(tokens[i * BLOCK : (i + 1) * BLOCK]), source.extra_keys(i)
        )
        hashes.append(parent)
    return hashes


@pytest.mark.parametrize("case", FIXTURES["hashes"], ids=lambda c: c["name"])
def test_block_hashes_equal_vllms_sha256_cbor(case, monkeypatch):
    if case["pythonhashseed"] is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", case["pythonhashseed"])
    hasher = Sha256CborHasher()
    assert hasher.none_hash.hex() == case["none_hash"]
    got = chain(hasher, keys(case["lora"], case["cache_salt"]), TOKENS)
    assert [h.hex() for h in got] == case["block_hashes"]


def test_int_form_is_the_low_64_bits_vllm_publishes():
    batch = next(b for b in FIXTURES["batches"] if b["int_hashes"] and not b["lora"])
    published = msgspec.msgpack.decode(bytes.fromhex(batch["stored"]))[1][0]["block_hashes"]
    plain = next(c for c in FIXTURES["hashes"] if c["name"] == "plain")
    assert [int_block_hash(bytes.fromhex(h)) for h in plain["block_hashes"]] == published


def manager_with_cached_request(lora: bool, salt: bool, monkeypatch) -> tuple:
    """A 6-block manager (as the fixture's vLLM pool) after one request's 4 full blocks
    were computed; returns it, the request and the events so far."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    bm = BlockManager(
        6,
        BLOCK,
        hasher=Sha256CborHasher(),
        lora_paths={LORA["name"]: LORA["path"]},
        emit_events=True,
    )
    params = SamplingParams(
        lora_name=LORA["name"] if lora else None, cache_salt=SALT if salt else None
    )
    req = Request("r", list(TOKENS), params)
    bm.allocate(req, len(TOKENS))
    req.num_computed_tokens = len(TOKENS)
    bm.register_full_blocks(req)
    return bm, req, bm.take_events()


def wire_for(batch: dict) -> wire.WireFormat:
    return wire.WireFormat(batch["int_hashes"], {LORA["name"]: LORA["id"]})


def encode(fmt: wire.WireFormat, events: list) -> bytes:
    return wire.encoder().encode(fmt.batch(TS, events))


BATCH_IDS = [
    f"{'int' if b['int_hashes'] else 'bytes'}-{'lora+salt' if b['lora'] else 'plain'}"
    for b in FIXTURES["batches"]
]


@pytest.mark.parametrize("batch", FIXTURES["batches"], ids=BATCH_IDS)
def test_block_stored_bytes_equal_vllms(batch, monkeypatch):
    _, _, events = manager_with_cached_request(batch["lora"], batch["cache_salt"], monkeypatch)
    assert events[0] == core.AllBlocksCleared()  # a fresh cache says so first
    assert encode(wire_for(batch), events[1:]).hex() == batch["stored"]


@pytest.mark.parametrize("batch", FIXTURES["batches"], ids=BATCH_IDS)
def test_evictions_remove_exactly_the_stored_hashes_in_vllms_encoding(batch, monkeypatch):
    bm, req, _ = manager_with_cached_request(batch["lora"], batch["cache_salt"], monkeypatch)
    bm.free_request(req)
    bm.allocate(Request("other", list(range(5 * BLOCK)), SamplingParams()), 5 * BLOCK)
    removed = bm.take_events()
    assert all(isinstance(e, core.BlockRemoved) and len(e.block_hashes) == 1 for e in removed)
    vllm_removed = wire.decoder().decode(bytes.fromhex(batch["removed"])).events
    fmt = wire_for(batch)
    assert sorted(fmt.block_hash(e.block_hashes[0]) for e in removed) == sorted(
        e.block_hashes[0] for e in vllm_removed
    )
    # the same events in vLLM's eviction order encode to vLLM's bytes
    by_hash = {fmt.block_hash(e.block_hashes[0]): e for e in removed}
    ordered = [by_hash[e.block_hashes[0]] for e in vllm_removed]
    assert encode(fmt, ordered).hex() == batch["removed"]


@pytest.mark.parametrize("batch", FIXTURES["batches"], ids=BATCH_IDS)
def test_reset_sends_all_blocks_cleared_as_vllm(batch, monkeypatch):
    bm, req, _ = manager_with_cached_request(batch["lora"], batch["cache_salt"], monkeypatch)
    assert not bm.reset_prefix_cache()  # a request still holds blocks: refused, as vLLM
    assert bm.take_events() == []
    bm.free_request(req)
    assert bm.reset_prefix_cache()
    assert bm.find_cached_prefix(Request("again", list(TOKENS), req.params)) == []
    assert encode(wire_for(batch), bm.take_events()).hex() == batch["cleared"]


@pytest.mark.parametrize("batch", FIXTURES["batches"], ids=BATCH_IDS)
def test_vllm_batches_decode_and_reencode_to_the_same_bytes(batch):
    for name in ("stored", "removed", "cleared"):
        raw = bytes.fromhex(batch[name])
        decoded = wire.decoder().decode(raw)
        assert decoded.ts == TS and decoded.data_parallel_rank == 0
        assert wire.encoder().encode(decoded) == raw


def test_events_only_for_blocks_new_to_the_cache(monkeypatch):
    """A second request over the same prefix hits the cache: no event repeats its blocks;
    its own new blocks come as one BlockStored whose parent is the last shared block."""
    bm, first, _ = manager_with_cached_request(False, False, monkeypatch)
    bm.free_request(first)  # its blocks stay cached
    longer = Request("b", TOKENS[:64] + list(range(5000, 5016)), SamplingParams())
    cached = bm.find_cached_prefix(longer)
    assert len(cached) == 4
    longer.num_computed_tokens = 64
    bm.allocate(longer, longer.num_tokens - 64, cached)
    longer.num_computed_tokens = longer.num_tokens
    bm.register_full_blocks(longer)
    (stored,) = bm.take_events()
    first_hashes = chain(Sha256CborHasher(), BlockKeySource(), TOKENS)
    assert stored.parent_block_hash == first_hashes[3]
    assert stored.token_ids == tuple(range(5000, 5016))
    assert stored.extra_keys == (None,) and event_extra_keys(None) is None


def test_kv_events_config_takes_vllms_fields_and_refuses_others():
    config = KVEventsConfig.parse(
        '{"enable_kv_cache_events": true, "endpoint": '
        '"tcp://*:5557", "topic": "kv", "buffer_steps": 5}'
    )
    assert config.enabled and config.publisher == "zmq" and config.hwm == 100_000
    assert not KVEventsConfig.parse('{"enable_kv_cache_events": false}').enabled
    with pytest.raises(ValueError, match="unknown field"):
        KVEventsConfig.parse('{"enable_kv_cache_events": true, "port": 1}')
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "kafka"}')
    with pytest.raises(ValueError, match="endpoint"):
        KVEventsConfig.parse('{"enable_kv_cache_events": true, "endpoint": "localhost:1"}')


# -- the publisher --------------------------------------------------------------------------
@pytest.fixture
def subscriber():
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind("tcp://127.0.0.1:0")
    yield sub
    sub.close(linger=0)
    ctx.term()


def receive(sub, n: int, timeout_s: float = 10.0) -> list:
    frames = []
    deadline = time.monotonic() + timeout_s
    while len(frames) < n and time.monotonic() < deadline:
        if sub.poll(100):
            frames.append(sub.recv_multipart())
    return frames


def join(pub: KVEventPublisher, sub) -> int:
    """PUB drops what it sends before a subscription reaches it (ZMQ's slow joiner): send
    probes until one arrives; returns the next sequence number."""
    for _ in range(100):
        pub.publish([core.AllBlocksCleared()])
        if sub.poll(100):
            last = sub.recv_multipart()
            while sub.poll(200):
                last = sub.recv_multipart()
            return int.from_bytes(last[1], "big") + 1
    raise AssertionError("the subscriber never joined")


def stored_event(i: int) -> core.BlockStored:
    return core.BlockStored((bytes([i]) * 32,), None, tuple(range(BLOCK)), BLOCK, None, (None,))


def test_publisher_sends_topic_sequence_and_vllm_batches(subscriber, monkeypatch):
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    endpoint = subscriber.getsockopt_string(zmq.LAST_ENDPOINT)  # connect mode: we bind
    pub = KVEventPublisher(KVEventsConfig(True, endpoint=endpoint, topic="kv"))
    try:
        first = join(pub, subscriber)
        for i in range(3):
            pub.publish([stored_event(i)])
        frames = receive(subscriber, 3)
    finally:
        pub.shutdown()
    assert [f[0] for f in frames] == [b"kv"] * 3
    assert [int.from_bytes(f[1], "big") for f in frames] == [first, first + 1, first + 2]
    batches = [wire.decoder().decode(f[2]) for f in frames]
    assert [b.events[0].block_hashes for b in batches] == [[bytes([i]) * 32] for i in range(3)]
    assert all(b.data_parallel_rank == 0 and b.events[0].medium == "GPU" for b in batches)


def test_replay_socket_resends_buffered_batches_then_the_end_marker(subscriber):
    endpoint = subscriber.getsockopt_string(zmq.LAST_ENDPOINT)
    pub = KVEventPublisher(
        KVEventsConfig(True, endpoint=endpoint, replay_endpoint="tcp://127.0.0.1:0", buffer_steps=3)
    )
    ctx = zmq.Context()
    req = ctx.socket(zmq.DEALER)  # vLLM's consumers use a REQ-shaped (empty frame) request
    try:
        first = join(pub, subscriber)
        for i in range(5):
            pub.publish([stored_event(i)])
        assert len(receive(subscriber, 5)) == 5
        req.connect(pub.replay_endpoint)
        req.send_multipart((b"", (first + 3).to_bytes(8, "big")))
        replies = []
        while not replies or replies[-1][2] != END_SEQ:
            assert req.poll(5000), "no replay answer"
            replies.append(req.recv_multipart())
    finally:
        req.close(linger=0)
        ctx.term()
        pub.shutdown()
    assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == [first + 3, first + 4]
    assert [wire.decoder().decode(r[3]).events[0].block_hashes for r in replies[:-1]] == [
        [int_block_hash(bytes([3]) * 32)],
        [int_block_hash(bytes([4]) * 32)],
    ]  # vLLM's default
    assert replies[-1] == [b"", b"", END_SEQ, b""]


def test_a_full_queue_drops_batches_and_never_blocks_the_engine(subscriber):
    endpoint = subscriber.getsockopt_string(zmq.LAST_ENDPOINT)
    pub = KVEventPublisher(KVEventsConfig(True, endpoint=endpoint, max_queue_size=2, hwm=1))
    pub._queue.put(None)  # the publisher thread stops: nothing drains the queue any more
    pub._thread.join(5)
    try:
        start = time.monotonic()
        for i in range(1000):
            pub.publish([stored_event(i % 256)])
        assert time.monotonic() - start < 1.0
        assert pub.dropped >= 997
    finally:
        pub.shutdown(timeout=0.1)


def test_ipv6_loopback_endpoint_binds_as_vllms_rule_says():
    """``tcp://[::1]:PORT`` contains "::": vLLM binds it, so a subscriber (a router) connects
    to a publisher reachable from this machine only."""
    pub = KVEventPublisher(KVEventsConfig(True, endpoint="tcp://[::1]:0"))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.IPV6, 1)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        assert pub.endpoint.startswith("tcp://[::1]:") and not pub.endpoint.endswith(":0")
        sub.connect(pub.endpoint)
        join(pub, sub)
    finally:
        sub.close(linger=0)
        ctx.term()
        pub.shutdown()


def test_cache_salt_isolates_prefixes_and_same_salt_shares_them(monkeypatch):
    bm, first, _ = manager_with_cached_request(False, True, monkeypatch)  # salted with SALT
    bm.free_request(first)
    same = Request("same", list(TOKENS), SamplingParams(cache_salt=SALT))
    other = Request("other", list(TOKENS), SamplingParams(cache_salt="tenant-b"))
    plain = Request("plain", list(TOKENS), SamplingParams())
    assert len(bm.find_cached_prefix(same)) == 4
    assert bm.find_cached_prefix(other) == [] and bm.find_cached_prefix(plain) == []
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")
