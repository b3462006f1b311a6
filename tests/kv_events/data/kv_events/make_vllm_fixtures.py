#!/usr/bin/env python3
"""Write vllm_kv_events.json: block hashes and encoded KV event batches made by vLLM's own
code, for tests/kv_events/test_kv_events.py (CI has no vLLM; this runs once, in the peer venv):

    ~/.cache/slipstream/peers/venv/bin/python tests/kv_events/data/kv_events/make_vllm_fixtures.py

Everything comes from vLLM: ``hash_block_tokens`` / ``sha256_cbor`` / ``init_none_hash``
for the hashes, a real ``BlockPool`` with KV events on and ``Request`` objects (LoRA and
``cache_salt`` included) for the events, ``msgspec.msgpack.Encoder`` on ``KVEventBatch``
as ``ZmqEventPublisher`` encodes them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import msgspec
import torch
import vllm
from vllm import envs
from vllm.distributed.kv_events import KVEventBatch
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from vllm.v1.request import Request

BLOCK_SIZE = 16
TOKENS = list(range(1000, 1070))  # 4 full blocks and 6 tokens
LORA = {"name": "doll", "id": 1, "path": "/models/loras/doll"}
SALT = "tenant-a"
TS = 1700000000.25
OUT = Path(__file__).with_name("vllm_kv_events.json")
# the cache group of a plain decoder (Slipstream's one group): what the published events say
SPEC = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=3, head_size=64, dtype=torch.float32)


def use_int_hashes(on: bool) -> None:
    os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1" if on else "0"
    if hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()
    assert envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES is on


def request(rid: str, lora: bool, salt: bool) -> Request:
    lora_request = LoRARequest(LORA["name"], LORA["id"], LORA["path"]) if lora else None
    return Request(
        rid,
        list(TOKENS),
        SamplingParams(max_tokens=1),
        None,
        lora_request=lora_request,
        cache_salt=SALT if salt else None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256_cbor),
    )


def hashes_case(name: str, seed: str | None, lora: bool, salt: bool) -> dict:
    if seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = seed
    init_none_hash(sha256_cbor)
    req = request(name, lora, salt)
    return {
        "name": name,
        "pythonhashseed": seed,
        "lora": lora,
        "cache_salt": salt,
        "none_hash": kv_cache_utils.NONE_HASH.hex(),
        "block_hashes": [h.hex() for h in req.block_hashes],
    }


def encode(events: list) -> str:
    batch = KVEventBatch(ts=TS, events=events, data_parallel_rank=0)
    return msgspec.msgpack.Encoder().encode(batch).hex()


def batches_case(int_hashes: bool, lora: bool, salt: bool) -> dict:
    """Cache a request's 4 full blocks, evict them by allocating every block, reset."""
    use_int_hashes(int_hashes)
    os.environ.pop("PYTHONHASHSEED", None)
    init_none_hash(sha256_cbor)
    pool = BlockPool(
        num_gpu_blocks=6,
        enable_caching=True,
        hash_block_size=BLOCK_SIZE,
        enable_kv_cache_events=True,
    )
    req = request("r", lora, salt)
    blocks = pool.get_new_blocks(5)
    pool.cache_full_blocks(req, blocks, 0, 4, BLOCK_SIZE, 0)
    stored = pool.take_events()
    for event in stored:  # as vLLM's KVCacheManager.take_events labels them for publishing
        event.kv_cache_spec_kind = get_kv_cache_spec_kind(SPEC).value
        event.kv_cache_spec_sliding_window = get_kv_cache_spec_sliding_window(SPEC)
    pool.free_blocks(blocks)
    pool.get_new_blocks(5)  # every block: the cached ones are evicted
    removed = pool.take_events()
    pool.free_blocks(pool.blocks[1:])
    assert pool.reset_prefix_cache()
    cleared = pool.take_events()
    return {
        "int_hashes": int_hashes,
        "lora": lora,
        "cache_salt": salt,
        "stored": encode(stored),
        "removed": encode(removed),
        "cleared": encode(cleared),
    }


def main() -> None:
    cases = [
        hashes_case("plain", None, False, False),
        hashes_case("seeded", "123", False, False),
        hashes_case("lora", None, True, False),
        hashes_case("salted", None, False, True),
        hashes_case("lora_salted", None, True, True),
    ]
    batches = [
        batches_case(i, lora, salt)
        for i in (True, False)
        for lora, salt in ((False, False), (True, True))
    ]
    OUT.write_text(
        json.dumps(
            {
                "made_by": f"vLLM {vllm.__version__}, msgspec {msgspec.__version__}, "
                f"Python {sys.version.split()[0]}: {Path(__file__).name}",
                "block_size": BLOCK_SIZE,
                "tokens": TOKENS,
                "lora": LORA,
                "cache_salt": SALT,
                "ts": TS,
                "hashes": cases,
                "batches": batches,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
