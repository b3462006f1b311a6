"""One rank's membership of a tensor-parallel group: torch.distributed's rendezvous store and
process group (gloo on CPU, NCCL on CUDA), and the collectives the sharded model runs.

The process group is made directly (``ProcessGroupGloo(store, rank, size, ...)``), not as
torch.distributed's global default group: an engine that the supervisor replaces builds a
fresh group while the dead one's threads may still hold the old, and an in-process engine
(tests, benchmarks) must not leave a global behind.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

# A step's collectives wait at most this long for the slowest rank (between two of them lies
# one layer's work); a rank that hangs is seen sooner by its heartbeats (plan_channel).
STEP_COLLECTIVE_TIMEOUT_S = 60.0
# Collectives while the ranks load (the slowest rank's model load lies between two).
LOAD_COLLECTIVE_TIMEOUT_S = 900.0
_SUM: Any = dist.ReduceOp.SUM
_MIN: Any = dist.ReduceOp.MIN


@dataclass
class CollectiveClock:
    """Time this rank spent inside collectives (the benchmark's all-reduce time per step)."""

    seconds: float = 0.0
    calls: int = 0


class RankGroup:
    """The group as one rank sees it: ``rank`` of ``world``, tensors on ``device``."""

    def __init__(self, pg: Any, rank: int, world: int, device: torch.device):
        """``pg``: a gloo or NCCL backend (their collectives take a list of tensors)."""
        self.pg = pg
        self.rank = rank
        self.world = world
        self.device = device
        self.clock = CollectiveClock()
        self._timeout = datetime.timedelta(seconds=LOAD_COLLECTIVE_TIMEOUT_S)

    @classmethod
    def join(
        cls,
        store: dist.Store,
        rank: int,
        world: int,
        device: torch.device,
        loopback: bool,
    ) -> "RankGroup":
        """Build this rank's process group (blocks until every rank has joined)."""
        timeout = datetime.timedelta(seconds=LOAD_COLLECTIVE_TIMEOUT_S)
        pg: Any
        if device.type == "cuda":
            pg = dist.ProcessGroupNCCL(store, rank, world, dist.ProcessGroupNCCL.Options())
        else:
            gloo: Any = dist.ProcessGroupGloo  # its _Options are not in torch's stubs
            options = gloo._Options()
            options._timeout = timeout
            # one machine: loopback, whatever the host name resolves to; across machines the
            # interface that name (or GLOO_SOCKET_IFNAME) gives
            options._devices = [
                gloo.create_device(hostname="127.0.0.1")
                if loopback
                else gloo.create_default_device()
            ]
            pg = dist.ProcessGroupGloo(store, rank, world, options)
        return cls(pg, rank, world, device)

    def close(self) -> None:
        """Let go of the process group (its sockets, and the store it holds: rank 0's port);
        a collective after this raises. The model's hooks keep this object, not the group."""
        self.pg = None

    def serving(self) -> None:
        """Loading is over: from now on a collective waits ``STEP_COLLECTIVE_TIMEOUT_S``."""
        self._timeout = datetime.timedelta(seconds=STEP_COLLECTIVE_TIMEOUT_S)

    # -- collectives -----------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks. A reduced-precision CPU tensor is summed in fp32 (each
        rank's partial product rounded once, not again by the sum) and returned so."""
        if tensor.device.type == "cpu" and tensor.dtype != torch.float32:
            tensor = tensor.float()
        tensor = tensor.contiguous()
        options = dist.AllreduceOptions()
        options.reduceOp = _SUM
        options.timeout = self._timeout
        self._run(lambda pg: pg.allreduce([tensor], options))
        return tensor

    def gather_to_first(self, tensor: torch.Tensor) -> Optional[list[torch.Tensor]]:
        """Every rank's ``tensor`` (equal shapes), in rank order, on rank 0; None elsewhere."""
        tensor = tensor.contiguous()
        options = dist.GatherOptions()
        options.rootRank = 0
        options.timeout = self._timeout
        if self.rank == 0:
            parts = [torch.empty_like(tensor) for _ in range(self.world)]
            self._run(lambda pg: pg.gather([parts], [tensor], options))
            return parts
        self._run(lambda pg: pg.gather([], [tensor], options))
        return None

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' ``value``."""
        tensor = torch.tensor([value], dtype=torch.long, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = _MIN
        options.timeout = self._timeout
        self._run(lambda pg: pg.allreduce([tensor], options))
        return int(tensor.item())

    def _run(self, collective: Callable[[Any], dist.Work]) -> None:
        pg = self.pg
        if pg is None:
            raise RuntimeError(f"rank {self.rank}'s tensor-parallel group is closed")
        start = time.perf_counter()
        collective(pg).wait()
        self.clock.seconds += time.perf_counter() - start
        self.clock.calls += 1
