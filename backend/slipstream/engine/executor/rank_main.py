"""The entry of a rank process other than 0: ``python -m slipstream.engine.executor.rank_main
--rank R ...`` (``rank_processes`` starts it, on rank 0's machine or a headless one).

Before anything imports torch it pins itself to its cores (the OpenMP threads torch starts
inherit the mask) and arranges to die with the process that started it; then it serves
(``rank_worker``)."""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import logging
import os
import signal
import sys
from typing import Optional

PR_SET_PDEATHSIG = 1


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
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
    args = parse(argv)
    from slipstream.worker.distributed.topology import parse_cpu_bind  # no torch in it

    cores = parse_cpu_bind(args.cores)[0] if args.cores else None
    if cores:
        os.sched_setaffinity(0, cores)
    _die_with_parent(args.parent_pid)
    logging.basicConfig(
        level=logging.INFO, format=f"[slipstream rank {args.rank}] %(levelname)s %(message)s"
    )
    from slipstream.engine.executor.rank_worker import RankWorker

    return RankWorker(args, cores).run()


if __name__ == "__main__":
    sys.exit(main())
