"""Starting and stopping a machine's rank processes (``rank_main``): each with the
environment's Python, this package first on its path, pinned to its cores."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import slipstream
from slipstream.worker.distributed.topology import Topology, format_cores

RANK_MODULE = "slipstream.engine.executor.rank_main"
STOP_GRACE_S = 5.0  # a rank asked to stop gets this long to exit by itself
TERMINATE_GRACE_S = 2.0  # then this long after SIGTERM, before SIGKILL


def _is_python(path: object) -> bool:
    if not path:
        return False
    candidate = Path(str(path))
    return (
        candidate.name.startswith("python")
        and candidate.is_file()
        and os.access(candidate, os.X_OK)
    )


def environment_python() -> str:
    """The interpreter of the environment this package runs in. Inside Triton's Python
    backend stub ``sys.executable`` is not one (the stub embeds Python): the environment's
    interpreter is the one under its prefix (the virtualenv whose ``bin/`` the launcher puts
    first on PATH)."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates: list[object] = [sys.executable]
    for prefix in (sys.prefix, os.environ.get("VIRTUAL_ENV"), sys.base_prefix):
        if prefix:
            candidates += [Path(prefix) / "bin" / version, Path(prefix) / "bin" / "python3"]
    candidates += [shutil.which(version), shutil.which("python3")]
    for candidate in candidates:
        if _is_python(candidate):
            return str(candidate)
    raise RuntimeError(
        "tensor parallelism: no Python interpreter found to start the other ranks with "
        f"(tried {sys.executable!r} and {sys.prefix}/bin)"
    )


def package_root() -> str:
    """The directory this ``slipstream`` package is imported from: the ranks import the same
    code as rank 0, whatever their working directory."""
    return str(Path(slipstream.__file__).resolve().parent.parent)


@dataclass
class RankProcess:
    rank: int
    process: subprocess.Popen

    def exit_reason(self) -> Optional[str]:
        """How the process ended, or None while it runs."""
        code = self.process.poll()
        if code is None:
            return None
        who = f"rank {self.rank} (pid {self.process.pid})"
        if code < 0:
            return f"{who} was killed by {signal.Signals(-code).name}"
        return f"{who} exited with code {code}"


def spawn_rank(rank: int, topology: Topology, cores: list[int]) -> RankProcess:
    """Start rank ``rank`` on this machine, pinned to ``cores``."""
    env = dict(os.environ)
    root = package_root()
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    env["OMP_NUM_THREADS"] = str(len(cores))
    env.setdefault("PYTHONUNBUFFERED", "1")
    command = [
        environment_python(),
        "-m",
        RANK_MODULE,
        "--rank",
        str(rank),
        "--world-size",
        str(topology.world),
        "--nnodes",
        str(topology.nnodes),
        "--master-addr",
        topology.master_addr,
        "--master-port",
        str(topology.master_port),
        "--cores",
        format_cores(cores),
        "--parent-pid",
        str(os.getpid()),
    ]
    process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, close_fds=True)
    return RankProcess(rank, process)


def stop_ranks(ranks: list[RankProcess], grace_s: float = STOP_GRACE_S) -> None:
    """End every process in ``ranks``: each gets ``grace_s`` to exit by itself (it was told
    to stop), then SIGTERM, then SIGKILL; each is reaped (no zombie is left). ``grace_s``
    0: killed at once (a broken group's ranks, a hung one among them)."""
    deadline = time.monotonic() + grace_s
    for rank in ranks:
        try:
            rank.process.wait(max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            pass
    running = [r for r in ranks if r.process.poll() is None]
    for rank in running:
        rank.process.kill() if grace_s <= 0 else rank.process.terminate()
    for rank in running:
        try:
            rank.process.wait(TERMINATE_GRACE_S)
        except subprocess.TimeoutExpired:
            rank.process.kill()
            rank.process.wait()
