"""The `server` marker's guard, a pytest plugin the root conftest loads.

A test that starts a tritonserver, in this process or through a `slipstream serve` child, is
marked `server`, so that `-m "not server"` starts none. Unmarked tests run with the launcher's
forced binary (``SLIPSTREAM_TRITONSERVER``, inherited by child processes) set to a stand-in
that records the attempt and exits; the test then fails, naming the marker.
"""

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest

FORCED_BINARY = "SLIPSTREAM_TRITONSERVER"
UNMARKED = "started a tritonserver but is not marked server: add @pytest.mark.server"
_GUARD = Path(tempfile.mkdtemp(prefix="slipstream-server-guard-"))
STAND_IN, ATTEMPTS = _GUARD / "bin" / "tritonserver", _GUARD / "attempts"


def pytest_configure(config):
    STAND_IN.parent.mkdir(exist_ok=True)
    STAND_IN.write_text(
        f'#!/bin/sh\necho "tritonserver $*" >> "{ATTEMPTS}"\necho "{UNMARKED}" >&2\nexit 1\n'
    )
    STAND_IN.chmod(0o755)


def pytest_unconfigure(config):
    shutil.rmtree(_GUARD, ignore_errors=True)


@contextlib.contextmanager
def _no_tritonserver(item):
    if item.get_closest_marker("server") is not None:
        yield
        return
    before = os.environ.get(FORCED_BINARY)
    os.environ[FORCED_BINARY] = str(STAND_IN)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(FORCED_BINARY, None)  # the test may have removed it itself
        else:
            os.environ[FORCED_BINARY] = before
        if ATTEMPTS.exists():  # in place of whatever the test made of the stand-in's exit
            attempts = ATTEMPTS.read_text().strip()
            ATTEMPTS.unlink()
            pytest.fail(f"{item.nodeid} {UNMARKED}\n{attempts}", pytrace=False)


# setup too: a module-scoped server fixture starts in the setup of its first test
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _no_tritonserver(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _no_tritonserver(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    with _no_tritonserver(item):
        return (yield)
