"""A machine of a tensor-parallel group other than rank 0's: it serves no requests (no
Triton), only its ranks (``slipstream serve --nnodes N --node-rank K``, K > 0).

It reads rank 0's config from the group's store, starts this machine's ranks (each pinned to
its cores) and waits for them. When they end (the group stopped, broke, or rank 0's engine
was restarted), it starts them again for rank 0's next group, until it is stopped itself.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Optional

from slipstream.engine.executor import rendezvous
from slipstream.engine.executor.rank_processes import RankProcess, spawn_rank, stop_ranks
from slipstream.worker.distributed.topology import Topology, rank_cores

log = logging.getLogger("slipstream")

RETRY_S = 2.0  # between two groups, and between attempts to reach rank 0
STOP_NOW_S = 0.5  # a stopped machine's ranks get this long before SIGTERM


@dataclass(frozen=True)
class HeadlessNode:
    node_rank: int
    nnodes: int
    master_addr: str
    master_port: int
    cpu_threads_bind: Optional[str] = None

    def __post_init__(self) -> None:
        if not 0 < self.node_rank < self.nnodes:
            raise ValueError(
                f"a headless machine has node rank 1..{self.nnodes - 1}, not {self.node_rank}"
            )
        if not self.master_port:
            raise ValueError("a headless machine needs rank 0's master port")

    def serve(self, stop: threading.Event) -> None:
        """Run this machine's ranks, group after group, until ``stop`` is set."""
        while not stop.is_set():
            ranks = self._start_group()
            if not ranks:
                stop.wait(RETRY_S)
                continue
            try:
                while not stop.is_set() and any(r.process.poll() is None for r in ranks):
                    stop.wait(0.5)
            finally:  # the ranks end by themselves with their group; a stop ends them now
                stop_ranks(ranks, grace_s=STOP_NOW_S)
            for rank in ranks:
                log.info("%s", rank.exit_reason())
            stop.wait(RETRY_S)

    def _start_group(self) -> list[RankProcess]:
        """This machine's ranks of rank 0's current group (none when rank 0 cannot be
        reached yet)."""
        try:
            store = rendezvous.connect(self.master_addr, self.master_port)
            config = rendezvous.read(store).config
        except RuntimeError as exc:
            log.warning("waiting for rank 0: %s", exc)
            return []
        if config.nnodes != self.nnodes:
            raise ValueError(
                f"rank 0 runs nnodes={config.nnodes}, this machine was started with "
                f"--nnodes {self.nnodes}"
            )
        topology = Topology(
            config.tensor_parallel_size, self.nnodes, self.master_addr, self.master_port
        )
        cores = rank_cores(self.cpu_threads_bind, topology.ranks_per_node)
        ranks = topology.node_ranks(self.node_rank)
        log.info(
            "machine %d of %d: starting ranks %d-%d of rank 0's group at %s:%d",
            self.node_rank,
            self.nnodes,
            ranks.start,
            ranks.stop - 1,
            self.master_addr,
            self.master_port,
        )
        return [spawn_rank(rank, topology, cores[i]) for i, rank in enumerate(ranks)]
