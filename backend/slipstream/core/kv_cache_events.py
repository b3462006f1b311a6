"""What the block manager tells the outside world about its prefix cache, as plain values.

The same three events vLLM publishes (``vllm/distributed/kv_events.py``): a run of full
blocks entered the cache, blocks left it, everything left it. The wire format and the
socket live outside ``core`` (``slipstream/kv_events/``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Optional, Union


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[Hashable, ...]  # one per block, in order; each block's parent is the one before
    parent_block_hash: Optional[Hashable]  # the first block's parent (None: prompt start)
    token_ids: tuple[int, ...]  # every token of these blocks
    block_size: int
    lora_name: Optional[str]
    extra_keys: Optional[tuple[Optional[tuple[Any, ...]], ...]]  # per block: vLLM's untagged extra keys, or None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[Hashable, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
