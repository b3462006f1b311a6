"""Preemption by swapping, the bookkeeping half: which requests swap, which CPU blocks
hold them. The copies themselves are the worker's (``slipstream.worker.swap.SwapPool``),
made from the ``SwapTransfer`` lists of the step's ``SchedulerOutput``.

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
blocks; override with ``swap_min_tokens``) and swaps the longer ones.
``preemption_mode="swap"`` swaps every request that has computed anything. Both fall back
to recompute when the pool has no room.
"""

from __future__ import annotations

from dataclasses import dataclass

from slipstream.core.block_manager import BlockManager, BlockPool
from slipstream.core.config import EngineConfig
from slipstream.core.request import Request
from slipstream.core.scheduler_output import SwapDirection, SwapTransfer


@dataclass
class SwapStats:
    swap_outs: int = 0
    swap_ins: int = 0
    blocks_out: int = 0
    blocks_in: int = 0
    refused: int = 0  # preemptions that fell back to recompute for lack of pool room


class SwapSpace(BlockPool):
    def __init__(
        self, config: EngineConfig, block_manager: BlockManager, num_cpu_blocks: int
    ) -> None:
        self.bm = block_manager
        self.num_cpu_blocks = max(num_cpu_blocks, 0)
        self.mode = config.preemption_mode
        default_min = max(2 * block_manager.block_size, config.max_num_batched_tokens // 4)
        self.min_swap_tokens = (
            default_min if config.swap_min_tokens is None else config.swap_min_tokens
        )
        self.free: list[int] = list(range(self.num_cpu_blocks - 1, -1, -1))  # pop() = lowest id
        self.swapped: dict[str, list[int]] = {}  # request id -> CPU block ids, in block order
        self.stats = SwapStats()

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_cpu_blocks

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
        if req.request_id not in self.swapped:
            return False
        return self.bm.blocks_needed(req.num_computed_tokens + 1) <= self.bm.num_free_blocks

    # -- moves -------------------------------------------------------------------------------
    def swap_out(self, req: Request) -> SwapTransfer:
        """Assign CPU blocks to the computed blocks, then free the device blocks (the worker
        copies in the step's order before the forward, so later moves may reuse them). The request
        keeps its ``num_computed_tokens``: after ``swap_in`` it continues where it stopped."""
        if req.request_id in self.swapped:
            raise RuntimeError(f"request {req.request_id!r} is already swapped out")
        n = self._blocks_of(req)
        if n > len(self.free):
            raise RuntimeError("swap pool full: check should_swap before swap_out")
        cpu_blocks = [self.free.pop() for _ in range(n)]
        transfer = SwapTransfer(req, SwapDirection.OUT, list(req.block_table[:n]), cpu_blocks)
        self.swapped[req.request_id] = cpu_blocks
        self.bm.free_request(req)
        self.stats.swap_outs += 1
        self.stats.blocks_out += n
        return transfer

    def swap_in(self, req: Request) -> SwapTransfer:
        """Allocate fresh device blocks (no prefix-cache sharing) for the computed tokens."""
        cpu_blocks = self.swapped.get(req.request_id)
        if cpu_blocks is None:
            raise RuntimeError(f"request {req.request_id!r} is not swapped out")
        if req.block_table:
            raise RuntimeError(f"request {req.request_id!r} still holds device blocks")
        self.bm.allocate(req, 0)  # an empty table: room for all its computed tokens
        del self.swapped[req.request_id]
        self.free.extend(reversed(cpu_blocks))
        self.stats.swap_ins += 1
        self.stats.blocks_in += len(cpu_blocks)
        return SwapTransfer(
            req, SwapDirection.IN, list(req.block_table[: len(cpu_blocks)]), cpu_blocks
        )

    def discard(self, req: Request) -> None:
        """A finished or aborted request drops its swapped copy (no-op if it has none)."""
        cpu_blocks = self.swapped.pop(req.request_id, None)
        if cpu_blocks is not None:
            self.free.extend(reversed(cpu_blocks))

    def check_invariants(self) -> None:
        held = [b for blocks in self.swapped.values() for b in blocks]
        assert len(held) == len(set(held)), "a CPU block is held twice"
        assert not set(held) & set(self.free), "a held CPU block is also free"
        assert len(held) + len(self.free) == self.num_cpu_blocks, (len(held), len(self.free))
