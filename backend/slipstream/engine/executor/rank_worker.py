"""A rank other than 0 of a tensor-parallel group (its process starts in ``rank_main``).

It reads rank 0's engine config from the group's store, says hello, waits until every rank
has, joins the torch.distributed group, loads its share of the model with the same factory
as rank 0 and reports ready. Then, for each step plan rank 0 sends: the KV block copies rank
0 made, then the same forward on its share (the logits it gathers to rank 0 are all it gives
back). It exits on rank 0's stop, when rank 0 goes silent for ``LEADER_SILENCE_S``, or on an
error, which it reports to rank 0 first. A heartbeat thread tells rank 0 it is alive.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import threading
import traceback
from typing import Optional

import torch

from slipstream.core.config import EngineConfig
from slipstream.engine.executor import rendezvous
from slipstream.engine.executor.member import GroupMember
from slipstream.engine.factory import ModelFactory, resolved_max_model_len
from slipstream.worker.device import DeviceSettings, resolve_device
from slipstream.worker.distributed import step_plan
from slipstream.worker.distributed.plan_channel import (
    HEARTBEAT_PERIOD_S,
    LEADER_SILENCE_S,
    RankSockets,
    ReportKind,
)
from slipstream.worker.distributed.process_group import RankGroup
from slipstream.worker.distributed.step_plan import PlanKind, StepPlan

log = logging.getLogger("slipstream")


class LeaderGone(Exception):
    """Rank 0 stopped talking (or stopped the group): the group is over for this rank."""


class RankWorker:
    def __init__(self, args: argparse.Namespace, cores: Optional[list[int]]) -> None:
        """``args``: ``rank_main``'s command line; ``cores``: where it pinned itself."""
        self.args = args
        self.cores = cores
        self.sockets: Optional[RankSockets] = None
        self._stop_beats = threading.Event()

    def run(self) -> int:
        """Serve until stopped; the process's exit code."""
        try:
            self._serve()
            return 0
        except LeaderGone as exc:
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
        self._wait_for(PlanKind.JOIN)
        group = RankGroup.join(store, a.rank, a.world_size, settings.device, a.nnodes == 1)
        factory = ModelFactory(config, settings, GroupMember(group))
        target = factory.load_target(load_tokenizer=False)
        kv = factory.allocate_kv_cache(target.model)
        runner = factory.build_runner(target.model, kv, resolved_max_model_len(target.config))
        group.serving()
        sockets.report(ReportKind.READY)
        log.info("rank %d of %d ready", a.rank, a.world_size)
        while True:
            plan = self._next_plan()
            if plan.kind is PlanKind.STOP:
                return
            if plan.kind is PlanKind.STEP:
                kv.copy_blocks(plan.block_copies)
                runner.run(plan.batch(settings.device))

    def _own_config(self, config: EngineConfig) -> EngineConfig:
        """Rank 0's config, with this rank's device: CUDA ranks take one GPU each, by their
        place on their machine."""
        if resolve_device(config.device).type != "cuda":
            return config
        local = self.args.rank % (self.args.world_size // self.args.nnodes)
        return dataclasses.replace(config, device=f"cuda:{local}")

    def _next_plan(self) -> StepPlan:
        """Rank 0's next message; ``LeaderGone`` after ``LEADER_SILENCE_S`` without one."""
        assert self.sockets is not None
        message = self.sockets.receive(LEADER_SILENCE_S)
        if message is None:
            raise LeaderGone(f"rank 0 silent for {LEADER_SILENCE_S:.0f} s")
        return step_plan.decode(message)

    def _wait_for(self, kind: PlanKind) -> None:
        """Read rank 0's messages (its pings) until one of ``kind``; a stop ends the rank."""
        while True:
            plan = self._next_plan()
            if plan.kind is kind:
                return
            if plan.kind is PlanKind.STOP:
                raise LeaderGone("rank 0 stopped the group")

    def _beat(self) -> None:
        while not self._stop_beats.wait(HEARTBEAT_PERIOD_S):
            sockets = self.sockets
            if sockets is not None:
                try:
                    sockets.report(ReportKind.BEAT)
                except Exception:  # noqa: BLE001 - closing
                    return
