"""The `server` marker is enforced: a test without it that starts a tritonserver (through the
launcher in its own process, or in a child process as `slipstream serve` does) fails with a
message naming the marker, even when it expected the start to fail; a marked test is left
alone. Checked on a made-up module run by pytest with this tree's conftest and guard."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent

MODULE = """
import os
import subprocess
import sys

import pytest

from slipstream.server.launch.launcher import TritonServer

# Without the guard a real tritonserver starts on the empty repository and is never ready.
START = (
    "TritonServer({repo!r}, http_port=0, grpc_port=0, metrics_port=0, startup_timeout=20)"
    ".start()"
)


def test_unmarked_start_in_this_process(tmp_path):
    with pytest.raises(Exception):  # a test that swallows the failed start still fails
        eval(START.format(repo=str(tmp_path)))


def test_unmarked_start_in_a_child_process(tmp_path):
    code = "from slipstream.server.launch.launcher import TritonServer; "
    subprocess.run([sys.executable, "-c", code + START.format(repo=str(tmp_path))])


def test_unmarked_without_a_server():
    assert TritonServer(".", http_port=1, grpc_port=2, metrics_port=3).command


@pytest.mark.server
def test_marked_runs_with_the_environment_it_was_given():
    assert "SLIPSTREAM_TRITONSERVER" not in os.environ
"""


def test_an_unmarked_test_that_starts_a_tritonserver_fails_naming_the_marker(pytester, monkeypatch):
    monkeypatch.delenv("SLIPSTREAM_TRITONSERVER", raising=False)  # this test's own stand-in
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    server: starts a real tritonserver\n")
    pytester.makepyfile(
        server_guard=(TESTS / "server_guard.py").read_text(),
        device_tier=(TESTS / "device_tier.py").read_text(),
        test_made_up=MODULE,
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rf")
    result.assert_outcomes(passed=2, failed=2)
    for name in ("test_unmarked_start_in_this_process", "test_unmarked_start_in_a_child_process"):
        result.stdout.fnmatch_lines(
            [f"*{name} started a tritonserver but is not marked server: add @pytest.mark.server*"]
        )
