"""Paged KV-cache bookkeeping: fixed-size blocks, ref counts, automatic prefix caching.

Block 0 is reserved as a scratch block: padding rows (static batching, CUDA-graph padding)
write their throw-away K/V there, so they never touch a request's blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Collection, Hashable, Iterable, Optional, Sequence

from slipstream.core.block_hash import BlockHasher, BlockKeySource, event_extra_keys
from slipstream.core.kv_cache_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from slipstream.core.request import Request

NULL_BLOCK = 0


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: Optional[Hashable] = None  # set once the block is full and registered
    token_ids: tuple[int, ...] = ()


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found cached

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class _PerRequest:
    # hashes of the request's full blocks
    block_hashes: list[Hashable] = field(default_factory=list)


class BlockPool:
    """Counts of a pool that hands its blocks out from a free list (GPU KV cache, CPU swap)."""

    free: Collection[int]

    @property
    def num_usable_blocks(self) -> int:
        raise NotImplementedError

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - len(self.free)


class BlockManager(BlockPool):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hasher: Optional[BlockHasher] = None,
        lora_paths: Optional[dict[str, str]] = None,
        emit_events: bool = False,
    ) -> None:
        """``hasher`` names full blocks (default: the fast built-in hash; vLLM's
        ``sha256_cbor`` for KV events routers can match); ``lora_paths`` (adapter name ->
        directory) goes into LoRA blocks' keys as vLLM puts it there. With ``emit_events``
        every change to the set of cached hashes is queued for ``take_events``."""
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in LRU order: the front is evicted first. A freed block keeps its hash
        # (and so stays a prefix-cache hit) until it is handed out again.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.hash_to_block: dict[Hashable, int] = {}
        self.per_request: dict[str, _PerRequest] = {}
        # per request being served: its full prompt blocks' hashes (prompt_blocks_in_flight)
        self._prompt_chains: dict[str, list[Hashable]] = {}
        self.stats = PrefixCacheStats()
        self.hasher = hasher or BlockHasher()
        self.lora_paths = dict(lora_paths or {})
        # None: events off. A fresh cache is empty: say so, so that a consumer that saw an
        # earlier engine (a restart) forgets its blocks.
        self.events: Optional[list[KVCacheEvent]] = [AllBlocksCleared()] if emit_events else None

    # -- queries -------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1  # minus the scratch block

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ----------------------------------------------------------------
    def find_cached_prefix(self, req: Request) -> list[int]:
        """Blocks already holding the request's leading full blocks.

        The last token is never served from cache: its logits are needed to sample.
        """
        # Prompt logprobs need every prompt position's logits: recompute, as vLLM does.
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return []
        tokens = req.all_token_ids
        hits: list[int] = []
        keys = self._key_source(req)
        parent = None
        for start in range(0, len(tokens) - 1 - self.block_size + 1, self.block_size):
            chunk = tuple(tokens[start : start + self.block_size])
            h = self.hasher.hash_block(parent, chunk, keys.extra_keys(len(hits)))
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hits.append(block_id)
            parent = h
        return hits

    def prompt_blocks_in_flight(self, requests: Iterable[Request]) -> set[Hashable]:
        """Hashes of the full prompt blocks these (running) requests are still to compute:
        they enter the cache as each request's prefill reaches them."""
        pending: set[Hashable] = set()
        for req in requests:
            state = self.per_request.get(req.request_id)
            if state is None or req.num_computed_tokens >= req.num_prompt_tokens:
                continue
            pending.update(self._prompt_chain(req)[len(state.block_hashes) :])
        return pending

    def next_prefix_block(self, req: Request, num_cached_blocks: int) -> Optional[Hashable]:
        """The hash of ``req``'s first prompt block after its ``num_cached_blocks`` cached
        ones, or None when the cache could not serve it anyway (past the prompt, or the
        block holding the last prompt token, which is always recomputed)."""
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return None
        if (num_cached_blocks + 1) * self.block_size > req.num_prompt_tokens - 1:
            return None
        return self._prompt_chain(req)[num_cached_blocks]

    def record_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_prompt_tokens
        self.stats.hits += num_hit_tokens

    # -- allocation --------------------------------------------------------------------
    def can_allocate(
        self,
        req: Request,
        num_new_tokens: int,
        cached: Sequence[int] = (),
        start: Optional[int] = None,
    ) -> bool:
        revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        need = self._blocks_short(req, num_new_tokens, cached, start)
        return max(need, 0) + revived <= len(self.free)

    def allocate(self, req: Request, num_new_tokens: int, cached: Sequence[int] = ()) -> None:
        """Give ``req`` room for ``num_new_tokens`` tokens past its progress, first taking
        prefix-cache hits."""
        need = self._blocks_short(req, num_new_tokens, cached, None)
        state = self.per_request.setdefault(req.request_id, _PerRequest())
        for block_id in cached:
            self._touch(block_id)
            req.block_table.append(block_id)
            state.block_hashes.append(self.blocks[block_id].block_hash)
        if need > len(self.free):
            raise RuntimeError("KV cache exhausted: check can_allocate before allocate")
        for _ in range(need):
            req.block_table.append(self._take_free())

    def _blocks_short(
        self, req: Request, num_new_tokens: int, cached: Sequence[int], start: Optional[int]
    ) -> int:
        """Free blocks ``req`` lacks, beyond its table and ``cached``, for ``num_new_tokens``
        tokens from position ``start`` (default: its progress); negative: none."""
        start = req.num_computed_tokens if start is None else start
        return self.blocks_needed(start + num_new_tokens) - len(req.block_table) - len(cached)

    def register_full_blocks(self, req: Request) -> None:
        """Publish the request's newly completed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        state = self.per_request.setdefault(req.request_id, _PerRequest())
        num_full = min(req.num_computed_tokens // self.block_size, len(req.block_table))
        tokens = req.all_token_ids
        keys = self._key_source(req)
        stored: list[int] = []  # indices of the blocks entering the cache now
        while len(state.block_hashes) < num_full:
            i = len(state.block_hashes)
            parent = state.block_hashes[-1] if state.block_hashes else None
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            h = self.hasher.hash_block(parent, chunk, keys.extra_keys(i))
            state.block_hashes.append(h)
            block = self.blocks[req.block_table[i]]
            if block.block_hash is None and h not in self.hash_to_block:
                block.block_hash, block.token_ids = h, chunk
                self.hash_to_block[h] = block.block_id
                stored.append(i)
        if self.events is not None and stored:
            self._emit_stored(self.events, req, state.block_hashes, stored, keys)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's rule: only while no request holds a block).
        False, and nothing changes, while any is held."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            block.block_hash, block.token_ids = None, ()
        self.hash_to_block.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """The events queued since the last call, oldest first ([] when events are off)."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    def fork(self, parent: Request, child: Request, num_tokens: int) -> Optional[tuple[int, int]]:
        """Give ``child`` the parent's KV for its first ``num_tokens`` tokens: full blocks are
        shared (one more reference each); the partly filled last block, which both will write
        their next tokens into, is copied into a fresh block. Returns that copy as
        ``(source, destination)`` for the worker to make, or None. With no free block the child
        recomputes the partial block's tokens instead (its progress stops before them)."""
        full = num_tokens // self.block_size
        child.block_table = []
        for block_id in parent.block_table[:full]:
            self._touch(block_id)
            child.block_table.append(block_id)
        parent_state = self.per_request.get(parent.request_id, _PerRequest())
        self.per_request[child.request_id] = _PerRequest(list(parent_state.block_hashes[:full]))
        child.num_computed_tokens = full * self.block_size
        if num_tokens == child.num_computed_tokens or not self.free:
            return None
        copy = (parent.block_table[full], self._take_free())
        child.block_table.append(copy[1])
        child.num_computed_tokens = num_tokens
        return copy

    def free_request(self, req: Request) -> None:
        """Release every block of ``req`` (tail first, so shared prefixes are evicted last)."""
        for block_id in reversed(req.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"double free of block {block_id}"
            if block.ref_count == 0:
                self.free[block_id] = None
                if block.block_hash is None:
                    self.free.move_to_end(block_id, last=False)  # unhashed: reuse first
        req.block_table = []
        self.per_request.pop(req.request_id, None)
        self._prompt_chains.pop(req.request_id, None)

    def check_invariants(self) -> None:
        used = sum(1 for b in self.blocks[1:] if b.ref_count > 0)
        assert used + len(self.free) == self.num_usable_blocks, (used, len(self.free))
        assert all(self.blocks[b].ref_count == 0 for b in self.free)
        assert NULL_BLOCK not in self.free

    # -- internals -----------------------------------------------------------------------
    def _prompt_chain(self, req: Request) -> list[Hashable]:
        """The hashes of ``req``'s full prompt blocks, made once while it is served."""
        chain = self._prompt_chains.get(req.request_id)
        if chain is None:
            keys, tokens, parent = self._key_source(req), req.prompt_token_ids, None
            chain = []
            for i in range(req.num_prompt_tokens // self.block_size):
                chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
                parent = self.hasher.hash_block(parent, chunk, keys.extra_keys(i))
                chain.append(parent)
            self._prompt_chains[req.request_id] = chain
        return chain

    def _key_source(self, req: Request) -> BlockKeySource:
        name = req.params.lora_name
        return BlockKeySource(
            name, self.lora_paths.get(name) if name else None, req.params.cache_salt
        )

    def _emit_stored(
        self,
        events: list[KVCacheEvent],
        req: Request,
        hashes: list[Hashable],
        stored: list[int],
        keys: BlockKeySource,
    ) -> None:
        """One ``BlockStored`` per run of consecutive new blocks (a block already cached
        under the same hash by another request breaks a run: its hash is not new)."""
        runs: list[list[int]] = []
        for i in stored:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        size, tokens = self.block_size, req.all_token_ids
        for run in runs:
            first, last = run[0], run[-1]
            events.append(
                BlockStored(
                    block_hashes=tuple(hashes[first : last + 1]),
                    parent_block_hash=hashes[first - 1] if first else None,
                    token_ids=tuple(tokens[first * size : (last + 1) * size]),
                    block_size=size,
                    lora_name=req.params.lora_name,
                    extra_keys=tuple(event_extra_keys(keys.extra_keys(i)) for i in run),
                )
            )

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict from the prefix cache
            if self.hash_to_block.get(block.block_hash) == block_id:
                del self.hash_to_block[block.block_hash]
                if self.events is not None:
                    self.events.append(BlockRemoved((block.block_hash,)))
            block.block_hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id
