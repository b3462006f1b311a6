"""The bytes vLLM's ``ZmqEventPublisher`` sends: msgpack of ``msgspec`` structs laid out as
``vllm/distributed/kv_events.py`` declares them (same fields, order, options and tags), so
a consumer decoding with vLLM's own classes reads Slipstream's batches unchanged
(tests/test_kv_events.py compares the bytes with batches vLLM encoded)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

import msgspec

from slipstream.core import kv_cache_events as core
from slipstream.core.block_hash import int_block_hash

ExternalBlockHash = Union[bytes, int]
MEDIUM_GPU = "GPU"  # vLLM's name for the engine's own KV cache tier, whatever the device
GROUP_IDX = 0  # one KV cache group (one attention type)
# vLLM's engine labels every BlockStored with its group's cache kind before publishing
# (KVCacheManager.take_events). The one group here keeps every layer's K/V for every
# position of a cached block (none is dropped behind a sliding window): full attention.
KV_CACHE_SPEC_KIND = "full_attention"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: Optional[ExternalBlockHash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


def use_int_hashes() -> bool:
    """vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (default on): 64-bit ints, else bytes."""
    return bool(int(os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")))


@dataclass(frozen=True)
class WireFormat:
    """Core events -> vLLM's structs."""

    int_hashes: bool  # block hashes as 64-bit ints (else bytes): ``use_int_hashes``
    lora_ids: Mapping[str, int] = field(default_factory=dict)  # adapter name -> vLLM's id
    data_parallel_rank: int = 0

    def batch(self, ts: float, events: list[core.KVCacheEvent]) -> KVEventBatch:
        return KVEventBatch(
            ts=ts,
            events=[self.event(e) for e in events],
            data_parallel_rank=self.data_parallel_rank,
        )

    def event(self, event: core.KVCacheEvent) -> Union[BlockStored, BlockRemoved, AllBlocksCleared]:
        if isinstance(event, core.BlockStored):
            return BlockStored(
                block_hashes=[self.block_hash(h) for h in event.block_hashes],
                parent_block_hash=None
                if event.parent_block_hash is None
                else self.block_hash(event.parent_block_hash),
                token_ids=list(event.token_ids),
                block_size=event.block_size,
                lora_id=self.lora_ids.get(event.lora_name) if event.lora_name else None,
                medium=MEDIUM_GPU,
                lora_name=event.lora_name,
                extra_keys=list(event.extra_keys) if event.extra_keys else None,
                group_idx=GROUP_IDX,
                kv_cache_spec_kind=KV_CACHE_SPEC_KIND,
            )
        if isinstance(event, core.BlockRemoved):
            return BlockRemoved(
                block_hashes=[self.block_hash(h) for h in event.block_hashes],
                medium=MEDIUM_GPU,
                group_idx=GROUP_IDX,
            )
        if isinstance(event, core.AllBlocksCleared):
            return AllBlocksCleared()
        raise TypeError(f"not a KV cache event: {event!r}")

    def block_hash(self, value: Any) -> ExternalBlockHash:
        if not isinstance(value, bytes):
            raise TypeError(
                "KV events need vLLM's block hashes (prefix_caching_hash_algo "
                f"sha256_cbor), got {type(value).__name__}"
            )
        return int_block_hash(value) if self.int_hashes else value


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(type=KVEventBatch)
