"""Where a tensor-parallel group meets: torch.distributed's TCP store, served by rank 0 on
``master_addr:master_port``. Besides the process group's own rendezvous it carries what the
other ranks need to know of rank 0: its engine config (so a headless machine needs nothing
but rank 0's address) and its sockets' endpoints (``plan_channel``)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import socket
from dataclasses import dataclass

import torch.distributed as dist

from slipstream.core.config import EngineConfig
from slipstream.worker.distributed.topology import Topology

CONFIG_KEY = "slipstream/config"
PLANS_KEY = "slipstream/plans"
REPORTS_KEY = "slipstream/reports"
# How long a rank waits for rank 0's store, and rank 0 for every rank to say hello.
JOIN_TIMEOUT_S = 600.0
OWN_STORE_TIMEOUT_S = 30.0  # rank 0 reaching its own store


@dataclass(frozen=True)
class Meeting:
    """What a rank reads from the store: rank 0's config and socket endpoints."""

    config: EngineConfig
    plans: str
    reports: str


def listen(topology: Topology) -> dist.TCPStore:
    """Rank 0's store; ``RuntimeError`` naming the address when it cannot serve there (a
    port taken, an address not of this machine)."""
    where = f"master_addr:master_port {topology.master_addr}:{topology.master_port}"
    try:
        _check_own_address(topology.master_addr)
        store = dist.TCPStore(
            topology.master_addr,
            topology.master_port,
            topology.world,
            True,
            timeout=datetime.timedelta(seconds=OWN_STORE_TIMEOUT_S),
            wait_for_workers=False,
        )
    except (RuntimeError, ValueError, OSError) as exc:
        raise RuntimeError(f"tensor parallelism: rank 0 cannot listen on {where}: {exc}") from None
    store.set_timeout(datetime.timedelta(seconds=JOIN_TIMEOUT_S))
    return store


def _check_own_address(host: str) -> None:
    """``OSError`` unless ``host`` names an address of this machine (rank 0 serves there:
    the store's own client would otherwise wait its whole timeout to say so)."""
    for family, kind, proto, _name, address in socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM):
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.bind(address)
                return
            except OSError as exc:
                error = exc
    raise OSError(f"{host} is not an address of this machine ({error})")


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
