"""GPU memory sized as vLLM sizes it, on made-up figures: ``gpu_memory_utilization`` is a share
of the device's TOTAL memory; weights (draft model included), the activations' peak and the
CUDA graphs come off it before the KV cache takes the rest, shared with the draft's cache."""

from __future__ import annotations

import pytest

from slipstream import EngineConfig
from slipstream.worker.memory_plan import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    GIB,
    BlockSizes,
    MemoryFigures,
    cpu_kv_bytes,
    plan_memory,
)

H200 = 141 * GIB


def figures(**changes) -> MemoryFigures:
    values = dict(
        total=H200,
        free_at_start=H200 - GIB // 2,  # the CUDA context of another process
        weights=2 * GIB + GIB // 2,
        draft_weights=0,
        activations=3 * GIB,
        cuda_graphs=GIB // 4,
        non_torch=GIB // 4,
    )
    values.update(changes)
    return MemoryFigures(**values)


def test_the_kv_cache_gets_the_budget_of_total_memory_less_everything_else():
    plan = plan_memory(figures(), 0.9, BlockSizes(target=2 * 2**20))
    budget = int(H200 * 0.9)
    assert plan.budget == budget
    assert plan.kv_bytes == budget - (2 * GIB + GIB // 2) - 3 * GIB - GIB // 4 - GIB // 4
    assert plan.num_blocks == plan.kv_bytes // (2 * 2**20)
    assert plan.draft_num_blocks == 0
    # the memory other processes hold is not this engine's to take (vLLM: per instance)
    assert plan.non_kv + plan.kv_bytes == budget


def test_the_draft_models_weights_and_cache_come_out_of_the_same_budget():
    blocks = BlockSizes(target=4 * 2**20, draft=2**20, draft_extra_blocks=128)
    alone = plan_memory(figures(), 0.9, BlockSizes(target=4 * 2**20))
    plan = plan_memory(figures(draft_weights=GIB), 0.9, blocks)
    assert plan.kv_bytes == alone.kv_bytes - GIB
    assert plan.draft_num_blocks == plan.num_blocks + 128
    used = plan.num_blocks * 4 * 2**20 + plan.draft_num_blocks * 2**20
    assert used <= plan.kv_bytes < used + 5 * 2**20  # no more than one block pair left over


def test_a_start_with_less_free_memory_than_the_budget_is_refused_with_the_figures():
    with pytest.raises(ValueError) as err:
        plan_memory(figures(free_at_start=100 * GIB), 0.9, BlockSizes(target=2**20))
    assert "100.00 of 141.00 GiB" in str(err.value)
    assert "gpu_memory_utilization 0.9" in str(err.value)
    assert plan_memory(figures(free_at_start=100 * GIB), 0.7, BlockSizes(target=2**20))


def test_a_budget_that_holds_no_cache_is_refused_naming_each_figure():
    with pytest.raises(ValueError) as err:
        plan_memory(figures(activations=140 * GIB), 0.9, BlockSizes(target=2**20))
    message = str(err.value)
    for figure in ("weights", "draft model", "activation peak", "CUDA graphs", "non-torch"):
        assert figure in message
    assert "140.00 GiB" in message


def test_the_log_line_states_each_figure():
    text = plan_memory(figures(draft_weights=GIB), 0.5, BlockSizes(2**20, 2**19, 8)).describe()
    assert "total 141.00 GiB x gpu_memory_utilization 0.5 = 70.50 GiB" in text
    assert "weights 2.50 GiB" in text and "draft model 1.00 GiB" in text
    assert "activation peak 3.00 GiB" in text and "CUDA graphs 0.25 GiB" in text
    assert "blocks +" in text and "draft blocks" in text


def test_defaults_are_vllms_on_cuda_and_one_gib_on_cpu():
    config = EngineConfig()
    assert config.kv_cache_memory_bytes is None and config.gpu_memory_utilization is None
    assert DEFAULT_GPU_MEMORY_UTILIZATION == 0.9
    assert cpu_kv_bytes(None) == GIB and cpu_kv_bytes(12345) == 12345


@pytest.mark.parametrize("value", [0, 1.5, -0.1])
def test_a_utilization_outside_zero_to_one_is_refused(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        plan_memory(figures(), value, BlockSizes(target=2**20))
