"""Rank 0 of a tensor-parallel group: it starts the group, passes each step on, watches the
other ranks and ends them.

The engine (scheduler, sampler, rank 0's share of the model) runs in this process, on the
engine thread. ``TensorParallelLeader.start``:

1. serves the group's store on ``master_addr:master_port`` and binds its sockets;
2. starts this machine's other ranks (``rank_processes``: the environment's Python, each
   pinned to its cores); other machines' ranks are started there (``headless``);
3. waits for every rank's hello, then tells them all to join the torch.distributed group,
   and joins it;
4. pins the engine thread to rank 0's cores.

The engine's factory then loads rank 0's share (``member``) while every other rank loads
its own. From then on each step's batch goes to the others before rank 0's forward
(``announce``), and a monitor thread watches them: a rank's process that exits, an error it
reports, or heartbeats that stop for ``HEARTBEAT_TIMEOUT_S`` break the group. A broken group
fails the step under way (``GroupFailure``), kills this machine's ranks (which also frees a
collective rank 0 is stuck in), and is reported by ``failure`` so that the engine loop goes
dead at once: the supervisor then builds a new engine, and a new group with it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Optional

import torch

from slipstream.core.config import EngineConfig
from slipstream.engine.executor import rendezvous
from slipstream.engine.executor.member import LeaderMember
from slipstream.engine.executor.rank_processes import RankProcess, spawn_rank, stop_ranks
from slipstream.worker.device import DeviceSettings
from slipstream.worker.distributed import step_plan
from slipstream.worker.distributed.errors import GroupFailure
from slipstream.worker.distributed.plan_channel import (
    HEARTBEAT_PERIOD_S,
    HEARTBEAT_TIMEOUT_S,
    LeaderSockets,
    Report,
    ReportKind,
)
from slipstream.worker.distributed.process_group import CollectiveClock, RankGroup
from slipstream.worker.distributed.step_plan import PlanKind, StepPlan
from slipstream.worker.distributed.topology import Topology, rank_cores
from slipstream.worker.model_runner import StepBatch

log = logging.getLogger("slipstream")

CAUSE_WAIT_S = 1.0  # a failed collective waits this long for the monitor to learn why


class TensorParallelLeader:
    def __init__(
        self, topology: Topology, store: torch.distributed.TCPStore, sockets: LeaderSockets
    ) -> None:
        self.topology = topology
        self.store: Optional[torch.distributed.TCPStore] = store
        self.sockets = sockets
        self.local: list[RankProcess] = []
        self.group: Optional[RankGroup] = None
        self.member: Optional[LeaderMember] = None
        self.failure: Optional[str] = None  # why the group broke (None: it serves)
        self._lock = threading.Lock()
        self._closing = False
        self._joined: set[int] = set()  # ranks that said hello
        self._beats: dict[int, float] = {}  # rank -> monotonic time of its last heartbeat
        self._ready: set[int] = set()
        self._ready_changed = threading.Condition(self._lock)
        self._stop_monitor = threading.Event()
        self._monitor = threading.Thread(
            target=self._watch, name="slipstream-tp-monitor", daemon=True
        )
        self._pinned: Optional[tuple[int, set[int], int]] = None  # thread, cores, threads

    @property
    def others(self) -> list[int]:
        return list(range(1, self.topology.world))

    # -- start ------------------------------------------------------------------------------
    @classmethod
    def start(cls, config: EngineConfig, settings: DeviceSettings) -> "TensorParallelLeader":
        """The group, every rank joined (see the module); raises ``RuntimeError`` naming the
        rank or address that kept it from starting."""
        topology = Topology.of(config)
        cores = rank_cores(config.cpu_threads_bind, topology.ranks_per_node)
        store = rendezvous.listen(topology)
        if topology.master_port == 0:  # any free port: the others learn the one taken
            topology = Topology(topology.world, topology.nnodes, topology.master_addr, store.port)
        sockets = LeaderSockets("127.0.0.1" if topology.one_machine else "*")
        leader = cls(topology, store, sockets)
        try:
            host = topology.master_addr
            rendezvous.publish(
                store,
                config,
                f"tcp://{host}:{sockets.plan_port}",
                f"tcp://{host}:{sockets.report_port}",
            )
            leader._monitor.start()
            for index, rank in enumerate(topology.node_ranks(0)):
                if rank != 0:
                    leader.local.append(spawn_rank(rank, topology, cores[index]))
            leader._wait_for_hellos()
            leader.sockets.send(leader.others, step_plan.encode(StepPlan.bare(PlanKind.JOIN)))
            leader.group = leader._join(settings.device)
            leader.member = LeaderMember(leader.group, leader.announce, leader.broken)
            if settings.device.type == "cpu":
                leader._pin(cores[0])
        except BaseException:
            leader.close()
            raise
        log.info(
            "tensor parallel group of %d ranks on %d machine(s), rank 0 at %s:%d",
            topology.world,
            topology.nnodes,
            topology.master_addr,
            topology.master_port,
        )
        return leader

    def _wait_for_hellos(self) -> None:
        missing = set(self.others)
        deadline = time.monotonic() + rendezvous.JOIN_TIMEOUT_S
        while missing:
            self._raise_if_failed("did not start")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"tensor parallelism: rank(s) {sorted(missing)} did not join rank 0 at "
                    f"{self.topology.master_addr}:{self.topology.master_port} within "
                    f"{rendezvous.JOIN_TIMEOUT_S:.0f} s"
                )
            still = self.sockets.wait_for_hellos(missing, 0.2)
            with self._lock:
                self._joined |= missing - still
            missing = still

    def _join(self, device: torch.device) -> RankGroup:
        """Join the process group on a helper thread, so that a rank failing meanwhile is
        seen (the join itself cannot be interrupted)."""
        assert self.store is not None
        store, result, errors = self.store, [], []

        def join() -> None:
            try:
                result.append(
                    RankGroup.join(store, 0, self.topology.world, device, self.topology.one_machine)
                )
            except Exception as exc:  # noqa: BLE001 - handed to the waiting thread
                errors.append(exc)

        thread = threading.Thread(target=join, name="slipstream-tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            self._raise_if_failed("did not start")
        if errors:
            raise RuntimeError(f"tensor parallelism: joining the group failed: {errors[0]}")
        return result[0]

    def _raise_if_failed(self, what: str) -> None:
        if self.failure is not None:
            raise RuntimeError(f"tensor parallelism: the group {what}: {self.failure}")

    def _pin(self, cores: list[int]) -> None:
        """Rank 0's torch work (the engine thread, the OpenMP threads it starts) on its
        cores; undone by ``close``."""
        thread = threading.get_native_id()
        self._pinned = (thread, os.sched_getaffinity(0), torch.get_num_threads())
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))

    def wait_until_ready(self) -> None:
        """Return once every other rank has loaded its share (raise if one failed)."""
        with self._ready_changed:
            while not set(self.others) <= self._ready and self.failure is None:
                self._ready_changed.wait(0.2)
        self._raise_if_failed("failed while loading")
        if self.group is not None:
            self.group.serving()

    def load_failure(self) -> Optional[str]:
        """Why the group failed while loading, where a rank's failure is known (waited for
        briefly: a collective only says that a peer went away); None where rank 0 failed
        on its own."""
        return self._known_cause()

    # -- serving ---------------------------------------------------------------------------
    def announce(self, batch: StepBatch, copies: list[tuple[int, int]]) -> None:
        """Send the step to the other ranks (before rank 0's forward)."""
        if self.failure is not None:
            raise self._group_failure()
        plan = step_plan.encode(StepPlan.of_batch(batch, copies))
        unreachable = self.sockets.send(self.others, plan)
        if unreachable is not None:
            self._fail(f"rank {unreachable} cannot be reached")
            raise self._group_failure()

    def broken(self, exc: BaseException) -> BaseException:
        """The group's failure for an exception out of rank 0's forward."""
        cause = self._known_cause()
        self._fail(cause or f"a step failed on rank 0: {type(exc).__name__}: {exc}")
        return self._group_failure()

    def _known_cause(self) -> Optional[str]:
        """A rank's failure, waited for up to ``CAUSE_WAIT_S`` (a peer that died is seen by
        a collective before the monitor sees its process end), or None."""
        deadline = time.monotonic() + CAUSE_WAIT_S
        while time.monotonic() < deadline:
            if self.failure is not None:
                return self.failure
            for process in self.local:
                reason = process.exit_reason()
                if reason is not None:
                    return reason
            time.sleep(0.05)
        return None

    def fatal_error(self) -> Optional[str]:
        """What the engine says when the group has broken, or None while it serves."""
        if self.failure is None:
            return None
        return f"its tensor-parallel group broke: {self.failure}"

    def _group_failure(self) -> GroupFailure:
        return GroupFailure(self.fatal_error() or "its tensor-parallel group was closed")

    @property
    def clock(self) -> CollectiveClock:
        """Rank 0's time in collectives (all-reduces and the logits' gather)."""
        return self.group.clock if self.group is not None else CollectiveClock()

    # -- the monitor -----------------------------------------------------------------------
    def _watch(self) -> None:
        ping = step_plan.encode(StepPlan.bare(PlanKind.PING))
        last_ping = 0.0
        while not self._stop_monitor.is_set():
            try:
                report = self.sockets.receive_report(0.1)
            except Exception:  # noqa: BLE001 - the sockets were closed under us
                return
            now = time.monotonic()
            if report is not None:
                self._take(report, now)
            if self.failure is None and not self._closing:
                reason = self._check(now)
                if reason is not None:
                    self._fail(reason)
            if now - last_ping >= HEARTBEAT_PERIOD_S and self.failure is None:
                with self._lock:
                    joined = sorted(self._joined)
                unreachable = self.sockets.send(joined, ping)
                if unreachable is not None and not self._closing:
                    self._fail(f"rank {unreachable} cannot be reached")
                last_ping = now

    def _take(self, report: Report, now: float) -> None:
        if report.kind is ReportKind.BEAT:
            self._beats[report.rank] = now
        elif report.kind is ReportKind.READY:
            # silence is counted from here: a rank that hangs before its first heartbeat
            # reaches rank 0 is seen as well
            self._beats.setdefault(report.rank, now)
            with self._ready_changed:
                self._ready.add(report.rank)
                self._ready_changed.notify_all()
        elif report.kind is ReportKind.ERROR and not self._closing:
            self._fail(f"rank {report.rank} failed: {report.text}")

    def _check(self, now: float) -> Optional[str]:
        for process in self.local:
            reason = process.exit_reason()
            if reason is not None:
                return reason
        for rank, seen in self._beats.items():
            if now - seen > HEARTBEAT_TIMEOUT_S:
                return (
                    f"rank {rank} has sent no heartbeat for {now - seen:.0f} s "
                    "(hung, or cut off from rank 0)"
                )
        return None

    def _fail(self, reason: str) -> None:
        """Break the group (once): say why, and end this machine's ranks, which also ends
        a collective rank 0 may be waiting in."""
        with self._ready_changed:
            if self.failure is not None or self._closing:
                return
            self.failure = reason
            self._ready_changed.notify_all()
        log.error("tensor parallel group failed: %s", reason)
        stop_ranks(self.local, grace_s=0.0)

    # -- stop ------------------------------------------------------------------------------
    def close(self) -> None:
        """End the group: the other ranks are told to stop (killed after a grace period),
        the monitor, sockets, store and process group go, rank 0's pinning is undone."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            joined = sorted(self._joined)
        self.sockets.send(joined, step_plan.encode(StepPlan.bare(PlanKind.STOP)))
        stop_ranks(self.local)
        self._stop_monitor.set()
        if self._monitor.is_alive():
            self._monitor.join(2.0)
        self.sockets.close()
        if self.group is not None:
            self.group.close()
        self.group = self.member = None
        self.store = None
        if self._pinned is not None:
            thread, cores, threads = self._pinned
            try:
                os.sched_setaffinity(thread, cores)
            except OSError:  # the thread has ended
                pass
            torch.set_num_threads(threads)
            self._pinned = None
