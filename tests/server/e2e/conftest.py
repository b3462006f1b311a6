"""Fixtures of the tests against a real tritonserver: the tiny random llama, the shipped
repository rendered on it, one server per module on that repository, and the greedy texts an
in-process engine gives on the same settings. A module with its own repository or server
defines a fixture of the same name, which takes precedence over these."""

import pytest

from slipstream import EngineConfig, SamplingParams
from slipstream.engine.loop import EngineLoop
from slipstream.server.launch.config_pbtxt import read_parameters
from slipstream.server.launch.launcher import TritonServer
from slipstream.server.launch.repository import render_model_repository
from slipstream.server.stub.model_config import split_parameters
from slipstream.testing import make_tiny_model_dir
from server_support import GREEDY, MODEL, OVERRIDES, PROMPTS, REPO
from support import need_tritonserver


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "llama", arch="llama")


@pytest.fixture(scope="module")
def repo(tiny_model, tmp_path_factory):
    return render_model_repository(
        REPO,
        tmp_path_factory.mktemp("repo") / "model_repository",
        {"model": str(tiny_model), **OVERRIDES},
    )


@pytest.fixture(scope="module")
def server(repo):
    need_tritonserver()
    with TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0, startup_timeout=300) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(repo):
    """prompt -> greedy text the engine produces for that prompt alone."""
    params = read_parameters((repo / MODEL / "config.pbtxt").read_text())
    engine_settings, _ = split_parameters(params)
    loop = EngineLoop(EngineConfig.from_dict(engine_settings)).start()
    try:
        cache = {}

        def get(prompt, **overrides):
            key = (prompt, tuple(sorted(overrides.items())))
            if key not in cache:
                sp = SamplingParams.from_dict({**GREEDY, **overrides})
                cache[key] = loop.generate(prompt, sp).text
            return cache[key]

        for p in PROMPTS:
            get(p)
        yield get
    finally:
        loop.shutdown()
