"""Preemption by swapping, the device half: the CPU pool tensor and the block copies.

Which requests swap and which CPU blocks hold them is decided in ``core/swap_space.py``;
this pool carries out a step's ``SwapTransfer`` list before the forward. The pool is one
preallocated tensor of CPU blocks with the device cache's geometry (``[2, layers, blocks,
block_size, kv_heads, head_dim]``), pinned when the cache lives on a GPU;
``swap_space_bytes`` sets its size. Copies are synchronous.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from slipstream.core.scheduler_output import SchedulerOutput, SwapDirection, SwapTransfer
from slipstream.worker.kv_cache import KVCache

log = logging.getLogger("slipstream")


def num_cpu_blocks(kv_cache: KVCache, swap_space_bytes: int) -> int:
    return max(int(swap_space_bytes) // kv_cache.geometry.bytes_per_block, 0)


class SwapPool:
    def __init__(self, kv_cache: KVCache, num_blocks: int) -> None:
        self.kv = kv_cache
        self.num_blocks = num_blocks
        # allocated on first swap: most engines never swap
        self._data: Optional[torch.Tensor] = None

    def _pool(self) -> torch.Tensor:
        if self._data is None:
            g = self.kv.geometry
            pin = self.kv.data.device.type == "cuda"
            self._data = torch.empty(
                2,
                g.num_layers,
                self.num_blocks,
                g.block_size,
                g.num_kv_heads,
                g.head_dim,
                dtype=g.dtype,
                device="cpu",
                pin_memory=pin,
            )
            log.info(
                "swap pool: %d CPU blocks, %.1f MiB",
                self.num_blocks,
                self._data.numel() * self._data.element_size() / 2**20,
            )
        return self._data

    def apply(self, sched: SchedulerOutput) -> None:
        """Run the step's copies in the scheduler's order, before its forward."""
        for transfer in sched.swaps:
            self.copy(transfer)

    def copy(self, transfer: SwapTransfer) -> None:
        if not transfer.cpu_blocks:
            return
        idx = torch.tensor(transfer.cpu_blocks, dtype=torch.long)
        if transfer.direction is SwapDirection.OUT:
            payload = self.kv.copy_blocks_out(transfer.device_blocks).to("cpu")
            self._pool().index_copy_(2, idx, payload)
        else:
            self.kv.copy_blocks_in(transfer.device_blocks, self._pool().index_select(2, idx))
