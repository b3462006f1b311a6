"""Watches the Python-backend stub that runs the slipstream model, from outside it.

Triton 2.51 never restarts the stub of a decoupled model (python_backend's
``TRITONBACKEND_ModelInstanceExecute``: "TODO: Implement restart on decoupled"): once the
stub dies (killed, out of memory, a crash in native code) the requests in flight hang
forever, every new one fails with "Stub process ... is not healthy", the model still
reports READY, and a graceful stop then times out. Nothing inside Triton can recover.

So a dead stub is made a dead server: this process (started by the adapter, holding the
read end of a pipe whose write end only the stub holds) sees the pipe close. If the stub
said goodbye first (``finalize``), that was a clean unload. Otherwise it kills
``tritonserver`` at once, so that clients get a connection error instead of hanging, the
replica drops out of its load balancer, and its supervisor (``slipstream serve``,
Kubernetes, a container restart policy) starts a fresh one; then it removes the stub's
shared-memory region, which nobody else will.

Standard library only: it must start fast and small beside a model-sized stub.
Run as ``python watchdog.py --stub-pid P --server-pid Q --server-start T [--shm NAME]``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Optional

GOODBYE = b"bye"  # the adapter's finalize writes this: the stub is ending on purpose
FATAL = b"fatal "  # the adapter gave up on its engine: take the server down (reason follows)


def process_start_time(pid: int) -> Optional[int]:
    """The process's start time in clock ticks (``/proc/PID/stat`` field 22), to tell it
    from a later process that reused its pid; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()  # after "pid (comm) "
    return int(fields[19])


def is_zombie_or_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rindex(b")") + 2 :].split()[0] in (b"Z", b"X")


def log(message: str) -> None:
    sys.stderr.write(f"slipstream watchdog: {message}\n")
    sys.stderr.flush()


def read_until_closed(stream) -> bytes:
    """Everything the stub wrote before its end of the pipe closed."""
    data = b""
    while True:
        chunk = stream.read1(4096) if hasattr(stream, "read1") else stream.read(4096)
        if not chunk:
            return data
        data += chunk


def stop_server(pid: int, start_time: int) -> None:
    if process_start_time(pid) != start_time:
        return  # already gone (or the pid now belongs to someone else)
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + 10
    while not is_zombie_or_gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def remove_shm(name: Optional[str]) -> None:
    if not name:
        return
    try:
        os.unlink(os.path.join("/dev/shm", os.path.basename(name)))
        log(f"removed the stub's shared-memory region {name}")
    except FileNotFoundError:
        pass
    except OSError as exc:
        log(f"could not remove shared-memory region {name}: {exc}")


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stub-pid", type=int, required=True)
    p.add_argument("--server-pid", type=int, required=True)
    p.add_argument("--server-start", type=int, required=True)
    p.add_argument("--shm", help="the stub's shared-memory region name")
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for Triton
    said = read_until_closed(sys.stdin.buffer)
    if said.rstrip().endswith(GOODBYE):
        return 0
    if FATAL in said:
        reason = said[said.rindex(FATAL) + len(FATAL) :].decode(errors="replace").strip()
        log(f"the slipstream engine cannot be recovered ({reason})")
    else:
        log(f"the Python backend stub (pid {args.stub_pid}) died")
    if process_start_time(args.server_pid) == args.server_start:
        log(
            f"Triton cannot restart a decoupled model's stub: stopping tritonserver (pid "
            f"{args.server_pid}) so that its supervisor starts a fresh one"
        )
        stop_server(args.server_pid, args.server_start)
    remove_shm(args.shm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
