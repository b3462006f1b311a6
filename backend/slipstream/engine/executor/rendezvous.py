"""Where a tensor-parallel group meets: torch.distributed's TCP store, served by rank 0 on
``master_addr:master_port``. Besides the process group's own rendezvous it carries what the
other ranks need to know of rank 0: its engine config (so a headless machine needs nothing
but rank 0's address) and its sockets' endpoints (``plan_channel``)."""

from __future__ import annotations

import dataclasses
import datetime
import json
from dataclasses import dataclass

import torch.distributed as dist

from slipstream.core.config import EngineConfig
from slipstream.worker.distributed.topology import Topology

CONFIG_KEY = "slipstream/config"
PLANS_KEY = "slipstream/plans"
REPORTS_KEY = "slipstream/reports"
# How long a rank waits for rank 0's store, and rank 0 for every rank to say hello.
JOIN_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Meeting:
    """What a rank reads from the store: rank 0's config and socket endpoints."""

    config: EngineConfig
    plans: str
    reports: str


def listen(topology: Topology) -> dist.TCPStore:
    """Rank 0's store; ``RuntimeError`` naming the address when it cannot serve there (a
    port taken, an address not of this machine)."""
    try:
        return dist.TCPStore(
            topology.master_addr,
            topology.master_port,
            topology.world,
            True,
            timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S),
            wait_for_workers=False,
        )
    except (RuntimeError, ValueError, OSError) as exc:
        raise RuntimeError(
            f"tensor parallelism: rank 0 cannot listen on master_addr:master_port "
            f"{topology.master_addr}:{topology.master_port}: {exc}"
        ) from None


def connect(addr: str, port: int, timeout_s: float = JOIN_TIMEOUT_S) -> dist.TCPStore:
    """A rank's connection to rank 0's store (waits up to ``timeout_s`` for it)."""
    try:
        return dist.TCPStore(addr, port, None, False, timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError, OSError) as exc:
        raise RuntimeError(f"cannot reach rank 0's store at {addr}:{port}: {exc}") from None


def publish(store: dist.Store, config: EngineConfig, plans: str, reports: str) -> None:
    store.set(PLANS_KEY, plans)
    store.set(REPORTS_KEY, reports)
    store.set(CONFIG_KEY, json.dumps(dataclasses.asdict(config)))  # last: the others wait on it


def read(store: dist.Store) -> Meeting:
    config = EngineConfig(**json.loads(store.get(CONFIG_KEY)))
    return Meeting(config, store.get(PLANS_KEY).decode(), store.get(REPORTS_KEY).decode())
