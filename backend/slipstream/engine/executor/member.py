"""One rank of a tensor-parallel group as the model factory sees it: the model is cut to the
rank's share before its CPU layers are prepared, the ranks agree on one number of KV blocks
(the block tables rank 0's scheduler writes must be valid on every rank), and rank 0's cache
and runner pass each step on to the others."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from slipstream.worker.distributed.process_group import RankGroup
from slipstream.worker.distributed.recorded_kv_cache import RecordedKVCache
from slipstream.worker.distributed.sharding import ShardInfo, shard_model
from slipstream.worker.kv_cache import KVCache, KVGeometry
from slipstream.worker.model_runner import ModelRunner, StepBatch


class GroupMember:
    """A rank other than 0: its share of the model, a plain cache and runner."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group

    def shard(self, model: torch.nn.Module) -> ShardInfo:
        return shard_model(model, self.group)

    def agree_num_blocks(self, num_blocks: int) -> int:
        """The fewest blocks any rank's budget holds (every rank allocates that many)."""
        return self.group.min_int(num_blocks)

    def kv_cache(self, geometry: KVGeometry, num_blocks: int, device: torch.device) -> KVCache:
        return KVCache(geometry, num_blocks, device)

    def runner(self, *args: Any, **kwargs: Any) -> ModelRunner:
        return ModelRunner(*args, **kwargs)


class LeaderRunner(ModelRunner):
    """Rank 0's runner: each batch is announced to the other ranks before its forward (they
    run the same one on their shares); a forward that fails breaks the group, since the
    other ranks are left inside its collectives."""

    def __init__(
        self,
        *args: Any,
        announce: Callable[[StepBatch], None],
        broken: Callable[[BaseException], BaseException],
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._announce = announce
        self._broken = broken

    def run(self, batch: StepBatch) -> torch.Tensor:
        self._announce(batch)
        try:
            return super().run(batch)
        except Exception as exc:
            raise self._broken(exc) from exc


class LeaderMember(GroupMember):
    """Rank 0: its cache records block copies, its runner announces steps."""

    def __init__(
        self,
        group: RankGroup,
        announce: Callable[[StepBatch, list[tuple[int, int]]], None],
        broken: Callable[[BaseException], BaseException],
    ) -> None:
        super().__init__(group)
        self._announce = announce
        self._broken = broken
        self.cache: Optional[RecordedKVCache] = None

    def kv_cache(self, geometry: KVGeometry, num_blocks: int, device: torch.device) -> KVCache:
        self.cache = RecordedKVCache(geometry, num_blocks, device)
        return self.cache

    def runner(self, *args: Any, **kwargs: Any) -> ModelRunner:
        return LeaderRunner(*args, announce=self._announce_step, broken=self._broken, **kwargs)

    def _announce_step(self, batch: StepBatch) -> None:
        copies = self.cache.take_copies() if self.cache is not None else []
        self._announce(batch, copies)
