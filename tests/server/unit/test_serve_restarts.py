"""``slipstream serve``'s supervision loop: a restarted tritonserver that dies (or hangs)
before it is ready is cleaned up and started again within the restart budget, instead of
ending ``serve`` (seen in CI: a restart killed right after its model loaded took serve down).
The launcher's side of this contract (start raising TritonServerError, kill) is exercised
against the real server in test_server_lifecycle; here the loop's decisions are checked with a
stand-in whose starts fail as scripted."""

import subprocess
import sys

import pytest

from slipstream.server.launch.cli import serve_until_stopped, start_first
from slipstream.server.launch.triton_install import TritonServerError


class ScriptedServer:
    """Each start runs a real short-lived process: ``ok`` exits at once after a successful
    start (so the loop restarts it), ``fail`` raises as a server dying before ready does."""

    log_path = "-"

    def __init__(self, starts: list) -> None:
        self.starts, self.process, self.kills = list(starts), None, 0
        self.start_calls = 0

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        self.start_calls += 1
        outcome = self.starts.pop(0) if self.starts else "fail"
        self.process = subprocess.Popen([sys.executable, "-c", "pass"])
        if outcome == "fail":
            self.process.wait()
            raise TritonServerError("tritonserver exited with code -9 before it was ready")
        self.process.wait()  # ready, then dies: the loop sees it gone

    def kill(self) -> None:
        self.kills += 1
        if self.process is not None:
            self.process.wait()
        self.process = None

    def log_tail(self, n: int) -> str:
        return ""


def test_a_restart_that_dies_before_ready_is_retried_within_the_budget():
    server = ScriptedServer(["fail", "ok", "fail"])
    server.process = subprocess.Popen([sys.executable, "-c", "pass"])  # the first server dies
    assert serve_until_stopped(server, max_restarts=4) == 1  # gives up only at the budget
    assert server.start_calls == 4  # fail, ok (ready again), fail, fail: each one retried
    assert server.kills >= 4


class FirstStart(ScriptedServer):
    """A first start that fails, having come up (listening) or not."""

    def __init__(self, came_up: bool) -> None:
        super().__init__(["fail"])
        self._came_up = came_up

    def came_up(self) -> bool:
        return self._came_up


def test_a_first_start_that_died_after_coming_up_goes_to_the_restart_loop():
    assert start_first(FirstStart(came_up=True)) is False


def test_a_first_start_that_never_came_up_is_an_error_not_a_restart():
    with pytest.raises(TritonServerError):
        start_first(FirstStart(came_up=False))
