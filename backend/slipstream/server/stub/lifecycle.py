"""What the Triton adapter needs to know about the processes it lives in, and the watchdog
it leaves beside them (``slipstream.server.stub.watchdog``). Standard library only.

The stub is started by ``tritonserver`` (its parent) with the shared-memory region name as
its second argument; Triton's own ``--exit-timeout-secs`` bounds how long a graceful stop
waits for in-flight requests before it exits regardless (and may crash doing so).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Optional

from slipstream.core.boolean_text import SETTING, parse_bool
from slipstream.server.stub import watchdog

log = logging.getLogger("slipstream")

TRITON_DEFAULT_EXIT_TIMEOUT_S = 30


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def triton_exit_timeout(server_pid: Optional[int] = None) -> int:
    """tritonserver's ``--exit-timeout-secs`` (its default when not given)."""
    value = _option(
        _cmdline(os.getppid() if server_pid is None else server_pid), "--exit-timeout-secs"
    )
    try:
        return max(int(value), 0) if value is not None else TRITON_DEFAULT_EXIT_TIMEOUT_S
    except ValueError:
        return TRITON_DEFAULT_EXIT_TIMEOUT_S


def _option(args: list[str], name: str) -> Optional[str]:
    for i, arg in enumerate(args):
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
        if arg == name and i + 1 < len(args):
            return args[i + 1]
    return None


class HttpStopProbe:
    """Tells, from outside, that tritonserver has begun to stop: on SIGTERM/SIGINT its HTTP
    frontend resets every new connection, then waits for the open ones for up
    to the exit timeout before the model hears anything. A model that notices only when
    the unload begins may have no time left (Triton then exits mid-stream, or crashes)."""

    def __init__(self, server_pid: Optional[int] = None) -> None:
        args = _cmdline(os.getppid() if server_pid is None else server_pid)
        allow = parse_bool(_option(args, "--allow-http") or "true", SETTING) is not False
        port = _option(args, "--http-port") or "8000"
        host = _option(args, "--http-address") or "0.0.0.0"
        self.address = None
        if allow and port.isdigit():
            self.address = (
                "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host,
                int(port),
            )

    def stopping(self, timeout: float = 0.5) -> bool:
        if self.address is None:
            return False
        try:
            with socket.create_connection(self.address, timeout=timeout) as sock:
                sock.sendall(
                    b"GET /v2/health/live HTTP/1.1\r\nHost: triton\r\nConnection: close\r\n\r\n"
                )
                return sock.recv(16) == b""  # closed unanswered: it no longer serves
        except ConnectionError:  # refused (frontend gone) or reset (new connections refused)
            return True
        except OSError:
            return False  # slow or unknown: not evidence of a stop


def stop_server() -> bool:
    """Ask tritonserver (this stub's parent) to stop, as SIGTERM does: it stops answering
    ready at once, lets the responses already sent reach their clients, waits for what is in
    flight, unloads its models (this one's ``finalize`` runs) and exits. False when the
    parent is not a tritonserver that can be signalled."""
    pid = os.getppid()
    args = _cmdline(pid)
    if pid <= 1 or not args or not os.path.basename(args[0]).startswith("tritonserver"):
        return False
    try:
        os.kill(pid, signal.SIGTERM)
    except OSError:
        return False
    return True


def stub_shm_region() -> Optional[str]:
    """This stub's shared-memory region (its second argument), if this is a stub."""
    args = _cmdline(os.getpid())
    if len(args) > 2 and args[0].endswith("triton_python_backend_stub"):
        return args[2]
    return None


class Watchdog:
    """The watchdog process of this stub: started here, told goodbye on a clean unload."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process

    @property
    def _stdin(self) -> IO[bytes]:
        stdin = self.process.stdin
        assert stdin is not None, "the watchdog is started with stdin=PIPE"
        return stdin

    @classmethod
    def start(cls) -> Optional["Watchdog"]:
        """None when it cannot run (not inside a stub, or no Python to run it with)."""
        server_pid = os.getppid()
        start_time = watchdog.process_start_time(server_pid)
        python = sys.executable or shutil.which("python3")
        if start_time is None or not python or server_pid <= 1:
            return None
        cmd = [
            python,
            watchdog.__file__,
            "--stub-pid",
            str(os.getpid()),
            "--server-pid",
            str(server_pid),
            "--server-start",
            str(start_time),
        ]
        region = stub_shm_region()
        if region:
            cmd += ["--shm", region]
        try:
            process = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, close_fds=True
            )
        except OSError as exc:
            log.warning("slipstream: no watchdog (%s); a dead stub will not be noticed", exc)
            return None
        return cls(process)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def _say(self, message: bytes) -> None:
        try:
            self._stdin.write(message + b"\n")
            self._stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass

    def goodbye(self, timeout: float = 5.0) -> None:
        """A clean unload: the watchdog leaves the server alone and exits."""
        self._say(watchdog.GOODBYE)
        self._close(timeout)

    def fatal(self, reason: str) -> None:
        """The engine is beyond repair: the watchdog takes the server down once we exit."""
        self._say(watchdog.FATAL + reason.replace("\n", " ").encode(errors="replace"))

    def _close(self, timeout: float) -> None:
        try:
            self._stdin.close()
        except OSError:
            pass
        deadline = time.monotonic() + timeout
        while self.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
