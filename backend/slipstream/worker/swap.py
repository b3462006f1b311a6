"""Preemption by swapping: a preempted request's KV blocks go to a CPU pool and come back.

The alternative, recompute, drops the KV and prefills the request again later. Which is
cheaper depends on the context length:

* recompute costs a forward over every computed token (attention work grows
  quadratically with the context) and, worse for everyone else, it spends the step token
  budget (``max_num_batched_tokens``) that other requests' prefills and decodes need;
* swap costs two copies of ``bytes_per_token`` per computed token over the host link
  (device->host on preemption, host->device on resume) and room in the CPU pool.

For a short context the recompute is a fraction of one step's budget and needs no pool
room, so ``preemption_mode="auto"`` recomputes requests that have computed fewer than
``min_swap_tokens`` tokens (default: a quarter of ``max_num_batched_tokens``, at least two
blocks; override with ``extra={"swap_min_tokens": N}``) and swaps the longer ones.
``preemption_mode="swap"`` swaps every request that has computed anything. Both fall back
to recompute when the pool has no room.

The pool is one preallocated tensor of CPU blocks with the GPU cache's geometry
(``[2, layers, blocks, block_size, kv_heads, head_dim]``), pinned when the cache lives on
a GPU; ``swap_space_bytes`` sets its size. Copies are synchronous: ``swap_out`` returns
with the data on the host and the GPU blocks already freed, ``swap_in`` returns with the
data back in freshly allocated GPU blocks, so ``apply`` has nothing left to do.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from slipstream.core.block_manager import BlockManager
from slipstream.core.config import EngineConfig
from slipstream.core.request import Request
from slipstream.worker.kv_cache import KVCache

log = logging.getLogger("slipstream")


@dataclass
class SwapStats:
    swap_outs: int = 0
    swap_ins: int = 0
    blocks_out: int = 0
    blocks_in: int = 0
    refused: int = 0  # preemptions that fell back to recompute for lack of pool room


class SwapPool:
    def __init__(self, config: EngineConfig, kv_cache: KVCache, block_manager: BlockManager) -> None:
        self.config = config
        self.kv = kv_cache
        self.bm = block_manager
        g = kv_cache.geometry
        self.block_size = g.block_size
        self.num_cpu_blocks = max(int(config.swap_space_bytes) // g.bytes_per_block, 0)
        self.mode = config.preemption_mode
        default_min = max(2 * g.block_size, config.max_num_batched_tokens // 4)
        self.min_swap_tokens = int(config.extra.get("swap_min_tokens", default_min))
        self._data = None  # allocated on first swap: most engines never swap
        self.free: list[int] = list(range(self.num_cpu_blocks - 1, -1, -1))  # pop() = lowest id
        self.swapped: dict[str, list] = {}  # request id -> CPU block ids, in block order
        self.stats = SwapStats()

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_cpu_blocks - len(self.free)

    def _blocks_of(self, req: Request) -> int:
        """Blocks holding the request's computed tokens (the table may hold one more,
        allocated for tokens that were never computed, e.g. rejected drafts)."""
        return min(self.bm.blocks_needed(req.num_computed_tokens), len(req.block_table))

    def should_swap(self, req: Request) -> bool:
        """Called by the scheduler while preempting ``req``: swap (True) or recompute."""
        if self.mode == "recompute" or req.num_computed_tokens <= 0 or not req.block_table:
            return False
        if self.mode == "auto" and req.num_computed_tokens < self.min_swap_tokens:
            return False
        if self._blocks_of(req) > len(self.free):
            self.stats.refused += 1
            return False
        return True

    def can_swap_in(self, req: Request) -> bool:
        """Room for the swapped blocks plus the block its next token may need, so a resumed
        request is not preempted again on its very next step."""
        blocks = self.swapped.get(req.request_id)
        if blocks is None:
            return False
        need = self.bm.blocks_needed(req.num_computed_tokens + 1)
        return need <= self.bm.num_free_blocks

    # -- the copies ----------------------------------------------------------------------------
    def _pool(self) -> torch.Tensor:
        if self._data is None:
            g = self.kv.geometry
            pin = self.kv.data.device.type == "cuda"
            self._data = torch.empty(2, g.num_layers, self.num_cpu_blocks, g.block_size,
                                     g.num_kv_heads, g.head_dim, dtype=g.dtype, device="cpu",
                                     pin_memory=pin)
            log.info("swap pool: %d CPU blocks, %.1f MiB", self.num_cpu_blocks,
                     self._data.numel() * self._data.element_size() / 2**20)
        return self._data

    def swap_out(self, req: Request) -> None:
        """Copy the computed blocks to the pool, then free the GPU blocks.

        ``req.num_computed_tokens`` is kept: after ``swap_in`` the request continues where
        it stopped.
        """
        if req.request_id in self.swapped:
            raise RuntimeError(f"request {req.request_id!r} is already swapped out")
        n = self._blocks_of(req)
        if n > len(self.free):
            raise RuntimeError("swap pool full: check should_swap before swap_out")
        cpu_blocks = [self.free.pop() for _ in range(n)]
        if n:
            payload = self.kv.copy_blocks_out(req.block_table[:n]).to("cpu")
            idx = torch.tensor(cpu_blocks, dtype=torch.long)
            self._pool().index_copy_(2, idx, payload)
        self.swapped[req.request_id] = cpu_blocks
        self.bm.free_request(req)
        self.stats.swap_outs += 1
        self.stats.blocks_out += n

    def swap_in(self, req: Request) -> None:
        """Allocate GPU blocks for the computed tokens and copy the data back."""
        cpu_blocks = self.swapped.get(req.request_id)
        if cpu_blocks is None:
            raise RuntimeError(f"request {req.request_id!r} is not swapped out")
        if req.block_table:
            raise RuntimeError(f"request {req.request_id!r} still holds GPU blocks")
        computed = req.num_computed_tokens
        req.num_computed_tokens = 0
        try:
            self.bm.allocate(req, computed)  # fresh blocks, no prefix-cache sharing
        finally:
            req.num_computed_tokens = computed
        n = len(cpu_blocks)
        if n:
            idx = torch.tensor(cpu_blocks, dtype=torch.long)
            payload = self._pool().index_select(2, idx)
            self.kv.copy_blocks_in(req.block_table[:n], payload)
        del self.swapped[req.request_id]
        self.free.extend(reversed(cpu_blocks))
        self.stats.swap_ins += 1
        self.stats.blocks_in += n

    def discard(self, req: Request) -> None:
        """A finished or aborted request drops its swapped copy (no-op if it has none)."""
        cpu_blocks = self.swapped.pop(req.request_id, None)
        if cpu_blocks is not None:
            self.free.extend(reversed(cpu_blocks))

    def apply(self, sched) -> None:
        """Per-step hook for asynchronous copies; the copies here are synchronous."""
        return None

    def check_invariants(self) -> None:
        held = [b for blocks in self.swapped.values() for b in blocks]
        assert len(held) == len(set(held)), "a CPU block is held twice"
        assert not set(held) & set(self.free), "a held CPU block is also free"
        assert len(held) + len(self.free) == self.num_cpu_blocks, (len(held), len(self.free))
