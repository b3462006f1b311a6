"""The ZMQ sockets between rank 0 and the other ranks (tensors never cross them: those go
through torch.distributed).

* plans, rank 0 -> each rank: a ROUTER bound by rank 0, one DEALER per rank. A rank says
  hello once connected (so rank 0 knows it can be reached) and waits for rank 0's word that
  every rank has (then they all join the process group); then it reads step plans, and the
  pings rank 0 sends meanwhile. A rank that hears nothing from rank 0 for
  ``LEADER_SILENCE_S`` takes rank 0 for gone (or for a group it came too late to) and exits.
* reports, each rank -> rank 0: a PULL bound by rank 0, one PUSH per rank: heartbeats every
  ``HEARTBEAT_PERIOD_S``, "ready" once its model is loaded, and its error when it fails.

Rank 0 binds loopback when the group is on one machine, every interface otherwise; the ports
are any free ones, published in the group's rendezvous store.
"""

from __future__ import annotations

import enum
import threading
from typing import Optional

import msgspec
import zmq

HEARTBEAT_PERIOD_S = 0.5
# a rank silent this long is hung (stopped, or cut off): the group is broken
HEARTBEAT_TIMEOUT_S = 10.0
LEADER_SILENCE_S = 10.0  # a rank that hears nothing from rank 0 this long exits
HELLO = b"hello"


class ReportKind(enum.IntEnum):
    BEAT = 1
    READY = 2
    ERROR = 3


class Report(msgspec.Struct, array_like=True):
    rank: int
    kind: ReportKind
    text: str = ""


_REPORTS = msgspec.msgpack.Decoder(Report)
_ENCODER = msgspec.msgpack.Encoder()


def _identity(rank: int) -> bytes:
    return f"rank-{rank}".encode()


class LeaderSockets:
    """Rank 0's side. ``send`` and ``wait_for_hellos`` may be called from any thread (they
    share the ROUTER under a lock); ``receive_report`` from one thread only."""

    def __init__(self, bind_host: str) -> None:
        self.context = zmq.Context()
        self.plans = self.context.socket(zmq.ROUTER)
        self.plans.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unreachable rank is an error
        self.plans.setsockopt(zmq.LINGER, 0)
        self.reports = self.context.socket(zmq.PULL)
        self.reports.setsockopt(zmq.LINGER, 0)
        address = f"tcp://{bind_host}"
        self.plan_port = self.plans.bind_to_random_port(address)
        self.report_port = self.reports.bind_to_random_port(address)
        self._lock = threading.Lock()
        self._closed = False

    def wait_for_hellos(self, ranks: set[int], timeout_s: float) -> set[int]:
        """Read hellos for up to ``timeout_s``; the ranks still missing from ``ranks``."""
        missing = set(ranks)
        with self._lock:
            if self.plans.poll(int(timeout_s * 1000)):
                while self.plans.poll(0):
                    identity, message = self.plans.recv_multipart()
                    if message == HELLO:
                        missing.discard(int(identity.decode().rsplit("-", 1)[1]))
        return missing

    def send(self, ranks: list[int], message: bytes) -> Optional[int]:
        """``message`` to each rank; the first rank it could not reach (None: all)."""
        with self._lock:
            if self._closed:
                return ranks[0] if ranks else None
            frame = zmq.Frame(message)
            for rank in ranks:
                try:
                    self.plans.send_multipart([_identity(rank), frame], copy=False)
                except zmq.ZMQError:
                    return rank
        return None

    def receive_report(self, timeout_s: float) -> Optional[Report]:
        if not self.reports.poll(int(timeout_s * 1000)):
            return None
        return _REPORTS.decode(self.reports.recv())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self.context.destroy(linger=0)


class RankSockets:
    """A rank's side: ``receive`` on its main thread; ``report`` from any thread."""

    def __init__(self, rank: int, plan_endpoint: str, report_endpoint: str) -> None:
        self.rank = rank
        self.context = zmq.Context()
        self.plans = self.context.socket(zmq.DEALER)
        self.plans.setsockopt(zmq.IDENTITY, _identity(rank))
        self.plans.setsockopt(zmq.LINGER, 0)
        self.plans.connect(plan_endpoint)
        self.reports = self.context.socket(zmq.PUSH)
        self.reports.setsockopt(zmq.LINGER, 1000)  # an error report is sent before exiting
        self.reports.connect(report_endpoint)
        self._lock = threading.Lock()
        self.plans.send(HELLO)

    def receive(self, timeout_s: float) -> Optional[bytes]:
        """The next message from rank 0, or None after ``timeout_s`` of silence."""
        if not self.plans.poll(int(timeout_s * 1000)):
            return None
        return self.plans.recv()

    def report(self, kind: ReportKind, text: str = "") -> None:
        with self._lock:
            self.reports.send(_ENCODER.encode(Report(self.rank, kind, text)))

    def close(self) -> None:
        with self._lock:
            self.context.destroy(linger=1000)
