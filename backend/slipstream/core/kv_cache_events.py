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
    # one per block, in order; each block's parent is the one before
    block_hashes: tuple[Hashable, ...]
    parent_block_hash: Optional[Hashable]  # the first block's parent (None: prompt start)
    token_ids: tuple[int, ...]  # every token of these blocks
    block_size: int
    lora_name: Optional[str]
    # per block: vLLM's untagged extra keys, or None
    extra_keys: Optional[tuple[Optional[tuple[Any, ...]], ...]]


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[Hashable, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
