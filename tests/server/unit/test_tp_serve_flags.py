"""`slipstream serve`'s tensor-parallel flags (vLLM's names) as engine settings, and the
headless machine they make of a node rank > 0."""

import pytest

from slipstream import EngineConfig
from slipstream.engine.executor.headless import HeadlessNode
from slipstream.server.launch.cli import (
    DEFAULT_MASTER_PORT,
    build_parser,
    parallel_overrides,
    serve_overrides,
)


def serve(*argv: str):
    return build_parser().parse_args(["serve", *argv])


@pytest.fixture(autouse=True)
def no_leaderworkerset(monkeypatch):
    for name in ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"):
        monkeypatch.delenv(name, raising=False)


def test_one_machine_needs_only_the_rank_count():
    assert serve_overrides(serve("--tensor-parallel-size", "2")) == {"tensor_parallel_size": "2"}
    assert parallel_overrides(serve("--tensor-parallel-size", "2")) == {}


def test_across_machines_the_rendezvous_is_set_and_valid():
    args = serve("--tensor-parallel-size", "4", "--nnodes", "2", "--master-addr", "10.0.0.1")
    overrides = serve_overrides(args)
    assert overrides == {
        "tensor_parallel_size": "4",
        "nnodes": "2",
        "master_addr": "10.0.0.1",
        "master_port": str(DEFAULT_MASTER_PORT),
    }
    config = EngineConfig.from_dict(overrides)
    assert (config.nnodes, config.master_port) == (2, DEFAULT_MASTER_PORT)


def test_leaderworkersets_environment_gives_the_defaults(monkeypatch):
    monkeypatch.setenv("LWS_LEADER_ADDRESS", "group-0.slipstream")
    monkeypatch.setenv("LWS_GROUP_SIZE", "3")
    monkeypatch.setenv("LWS_WORKER_INDEX", "2")
    args = serve()
    assert (args.master_addr, args.nnodes, args.node_rank) == ("group-0.slipstream", 3, 2)
    assert serve("--node-rank", "0").node_rank == 0  # a flag wins over the environment


def test_a_headless_machine_is_not_rank_0s_and_knows_where_rank_0_listens():
    HeadlessNode(1, 2, "10.0.0.1", 29500)
    with pytest.raises(ValueError, match="node rank 1..1, not 0"):
        HeadlessNode(0, 2, "10.0.0.1", 29500)
    with pytest.raises(ValueError, match="needs rank 0's master port"):
        HeadlessNode(1, 2, "10.0.0.1", 0)
