"""Where a group's ranks run: cpu_threads_bind (vLLM's syntax) and the default split."""

import pytest

from slipstream.worker.distributed.topology import Topology, parse_cpu_bind, rank_cores


def test_cpu_bind_reads_vllms_syntax():
    assert parse_cpu_bind("0-3|4,6-7") == [[0, 1, 2, 3], [4, 6, 7]]
    assert parse_cpu_bind("1") == [[1]]


@pytest.mark.parametrize(
    "text, message", [("0-x", "not a core"), ("3-1", "empty range"), ("0|", "without cores")]
)
def test_a_malformed_cpu_bind_is_refused(text, message):
    with pytest.raises(ValueError, match=message):
        parse_cpu_bind(text)


def test_a_bind_must_give_each_rank_of_the_machine_its_own_cores():
    assert rank_cores("0-1|2-3", 2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="names 2 core groups for 4 ranks"):
        rank_cores("0-1|2-3", 4)
    with pytest.raises(ValueError, match="must not share cores"):
        rank_cores("0-2|2-3", 2)


def test_without_a_bind_the_allowed_cores_are_split_evenly():
    assert rank_cores(None, 2, {0, 1, 2, 3, 4}) == [[0, 1], [2, 3, 4]]
    assert rank_cores(None, 2, {5, 9}) == [[5], [9]]
    assert rank_cores(None, 3, {0}) == [[0], [0], [0]]  # fewer cores than ranks: shared


def test_each_machine_runs_consecutive_ranks():
    topology = Topology(4, 2, "10.0.0.1", 29500)
    assert topology.ranks_per_node == 2
    assert list(topology.node_ranks(1)) == [2, 3]
    assert not topology.one_machine
