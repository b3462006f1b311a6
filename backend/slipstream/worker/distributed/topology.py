"""Where a tensor-parallel group's ranks run: how many, over how many machines, how the
others reach rank 0, and which CPU cores each rank of a machine takes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from slipstream.core.config import EngineConfig

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class Topology:
    world: int  # ranks in all
    nnodes: int  # machines; each runs world / nnodes consecutive ranks
    master_addr: str
    master_port: int

    @classmethod
    def of(cls, config: EngineConfig) -> "Topology":
        return cls(
            config.tensor_parallel_size, config.nnodes, config.master_addr, config.master_port
        )

    @property
    def ranks_per_node(self) -> int:
        return self.world // self.nnodes

    def node_ranks(self, node: int) -> range:
        per = self.ranks_per_node
        return range(node * per, (node + 1) * per)

    @property
    def one_machine(self) -> bool:
        """Every rank on rank 0's machine: the group's sockets stay on loopback."""
        return self.nnodes == 1


def parse_cpu_bind(text: str) -> list[list[int]]:
    """vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` syntax: one core list per rank, ``|`` between
    ranks, each a comma list of cores and ``a-b`` ranges (``"0-31|32-63"``)."""
    groups = []
    for part in text.split("|"):
        cores: list[int] = []
        for item in part.split(","):
            item = item.strip()
            if not item:
                continue
            low, _, high = item.partition("-")
            try:
                first, last = int(low), int(high or low)
            except ValueError:
                raise ValueError(f"cpu_threads_bind: {item!r} is not a core or a-b range") from None
            if last < first:
                raise ValueError(f"cpu_threads_bind: empty range {item!r}")
            cores.extend(range(first, last + 1))
        if not cores:
            raise ValueError(f"cpu_threads_bind {text!r}: a rank without cores")
        groups.append(sorted(set(cores)))
    return groups


def rank_cores(
    bind: Optional[str], ranks: int, allowed: Optional[set[int]] = None
) -> list[list[int]]:
    """Each of a machine's ``ranks`` ranks' cores: ``bind``'s groups (disjoint, one per
    rank), else the cores this process may use split evenly (contiguous, each rank at least
    one: with fewer cores than ranks, ranks share them)."""
    if bind:
        groups = parse_cpu_bind(bind)
        if len(groups) != ranks:
            raise ValueError(
                f"cpu_threads_bind {bind!r} names {len(groups)} core groups for {ranks} ranks "
                "on this machine"
            )
        seen: set[int] = set()
        for group in groups:
            if seen & set(group):
                raise ValueError(f"cpu_threads_bind {bind!r}: ranks must not share cores")
            seen |= set(group)
        return groups
    cores = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    if len(cores) < ranks:
        return [[cores[r % len(cores)]] for r in range(ranks)]
    bounds = [len(cores) * r // ranks for r in range(ranks + 1)]
    return [cores[bounds[r] : bounds[r + 1]] for r in range(ranks)]


def format_cores(cores: list[int]) -> str:
    return ",".join(str(c) for c in cores)
