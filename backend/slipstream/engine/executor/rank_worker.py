"""A rank other than 0 of a tensor-parallel group, as its own process:
``python -m slipstream.engine.executor.rank_worker --rank R ...`` (``rank_processes`` starts
it, on rank 0's machine or a headless one).

It pins itself to its cores, reads rank 0's engine config from the group's store, says hello,
joins the torch.distributed group, loads its share of the model with the same factory as
rank 0 and reports ready. Then, for each step plan rank 0 sends: the KV block copies rank 0
made, then the same forward on its share (the logits it gathers to rank 0 are all it gives
back). It exits on rank 0's stop, when rank 0 goes silent for ``LEADER_SILENCE_S``, or on an
error, which it reports to rank 0 first. A heartbeat thread tells rank 0 it is alive.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import dataclasses
import logging
import os
import signal
import sys
import threading
import traceback
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from slipstream.worker.distributed.plan_channel import RankSockets

log = logging.getLogger("slipstream")
PR_SET_PDEATHSIG = 1


def _parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="slipstream rank", description=__doc__.split("\n")[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--cores", default="", help="this rank's CPU cores (0,1,4-7)")
    p.add_argument("--parent-pid", type=int, default=0, help="die with this process")
    return p.parse_args(argv)


def _die_with_parent(parent: int) -> None:
    """SIGKILL when the process that started this one ends (Linux), so that a killed engine
    leaves no rank behind; exit now if it already has."""
    if not parent:
        return
    libc = ctypes.util.find_library("c")
    if libc:
        try:
            ctypes.CDLL(libc, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):  # not Linux's libc
            pass
    if os.getppid() != parent:
        sys.exit(f"rank worker: its parent {parent} is gone")


def main(argv: Optional[list[str]] = None) -> int:
    args = _parse(argv)
    from slipstream.worker.distributed.topology import parse_cpu_bind

    cores = parse_cpu_bind(args.cores)[0] if args.cores else None
    if cores:  # before torch starts a thread: the OpenMP pool inherits the mask
        os.sched_setaffinity(0, cores)
    _die_with_parent(args.parent_pid)
    logging.basicConfig(
        level=logging.INFO, format=f"[slipstream rank {args.rank}] %(levelname)s %(message)s"
    )
    return RankWorker(args, cores).run()


class RankWorker:
    def __init__(self, args: argparse.Namespace, cores: Optional[list[int]]) -> None:
        self.args = args
        self.cores = cores
        self.sockets: Optional[RankSockets] = None
        self._stop_beats = threading.Event()

    def run(self) -> int:
        from slipstream.worker.distributed.plan_channel import ReportKind

        try:
            self._serve()
            return 0
        except _LeaderGone as exc:
            log.warning("%s; exiting", exc)
            return 1
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, then fatal
            log.error("rank %d failed:\n%s", self.args.rank, traceback.format_exc())
            if self.sockets is not None:
                self.sockets.report(ReportKind.ERROR, f"{type(exc).__name__}: {exc}")
            return 1
        finally:
            self._stop_beats.set()
            if self.sockets is not None:
                self.sockets.close()

    def _serve(self) -> None:
        import torch

        from slipstream.engine.executor import rendezvous
        from slipstream.engine.executor.member import GroupMember
        from slipstream.engine.factory import ModelFactory, resolved_max_model_len
        from slipstream.worker.device import DeviceSettings
        from slipstream.worker.distributed import step_plan
        from slipstream.worker.distributed.plan_channel import (
            LEADER_SILENCE_S,
            RankSockets,
            ReportKind,
        )
        from slipstream.worker.distributed.process_group import RankGroup
        from slipstream.worker.distributed.step_plan import PlanKind

        a = self.args
        if self.cores:
            torch.set_num_threads(len(self.cores))
        store = rendezvous.connect(a.master_addr, a.master_port)
        meeting = rendezvous.read(store)
        self.sockets = sockets = RankSockets(a.rank, meeting.plans, meeting.reports)
        threading.Thread(target=self._beat, name="slipstream-rank-beat", daemon=True).start()
        config = self._own_config(meeting.config)
        settings = DeviceSettings.resolve(config)
        if settings.device.type == "cuda":
            torch.cuda.set_device(settings.device)
        group = RankGroup.join(store, a.rank, a.world_size, settings.device, a.nnodes == 1)
        factory = ModelFactory(config, settings, GroupMember(group))
        target = factory.load_target(load_tokenizer=False)
        kv = factory.allocate_kv_cache(target.model)
        runner = factory.build_runner(target.model, kv, resolved_max_model_len(target.config))
        group.serving()
        sockets.report(ReportKind.READY)
        log.info("rank %d of %d ready", a.rank, a.world_size)
        while True:
            message = sockets.receive(LEADER_SILENCE_S)
            if message is None:
                raise _LeaderGone(f"rank 0 silent for {LEADER_SILENCE_S:.0f} s")
            plan = step_plan.decode(message)
            if plan.kind is PlanKind.STOP:
                return
            if plan.kind is PlanKind.STEP:
                kv.copy_blocks(plan.block_copies)
                runner.run(plan.batch(settings.device))

    def _own_config(self, config):
        """Rank 0's config, with this rank's device: CUDA ranks take one GPU each, by their
        place on their machine."""
        from slipstream.worker.device import resolve_device

        device = resolve_device(config.device)
        if device.type != "cuda":
            return config
        local = self.args.rank % (self.args.world_size // self.args.nnodes)
        return dataclasses.replace(config, device=f"cuda:{local}")

    def _beat(self) -> None:
        from slipstream.worker.distributed.plan_channel import HEARTBEAT_PERIOD_S, ReportKind

        while not self._stop_beats.wait(HEARTBEAT_PERIOD_S):
            sockets = self.sockets
            if sockets is not None:
                try:
                    sockets.report(ReportKind.BEAT)
                except Exception:  # noqa: BLE001 - closing
                    return


class _LeaderGone(Exception):
    """Rank 0 stopped talking: the group is over for this rank."""


if __name__ == "__main__":
    sys.exit(main())
