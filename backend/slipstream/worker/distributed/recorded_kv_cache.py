"""Rank 0's KV cache under tensor parallelism: the engine's block copies (copy-on-write of
forked sequences) are made here as on one rank, and kept for the other ranks, which make
them in their own caches before the next step's forward (``step_plan``)."""

from __future__ import annotations

import torch

from slipstream.worker.kv_cache import KVCache, KVGeometry


class RecordedKVCache(KVCache):
    def __init__(self, geometry: KVGeometry, num_blocks: int, device: torch.device) -> None:
        super().__init__(geometry, num_blocks, device)
        self._copies: list[tuple[int, int]] = []

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        super().copy_blocks(pairs)
        self._copies.extend(pairs)

    def take_copies(self) -> list[tuple[int, int]]:
        """The copies made since the last call, in order."""
        copies, self._copies = self._copies, []
        return copies
