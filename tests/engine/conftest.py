"""Fixtures of the engine tests."""

import pytest

from slipstream.engine.loop import EngineLoop
from engine_support import config


@pytest.fixture(scope="module")
def loop():
    """One running ``EngineLoop`` on the tiny llama for the module (``engine_support.config``)."""
    with EngineLoop(config()) as running:
        yield running
