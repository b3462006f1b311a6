"""Tensor parallelism's settings: what they accept, and the combinations they refuse."""

import pytest

from slipstream import EngineConfig
from slipstream.server.stub.engine_arg_reader import translate
from slipstream.server.stub.model_config import check_instance_kind


def test_tensor_parallel_settings_parse_from_strings():
    values = {"tensor_parallel_size": "4", "nnodes": "2", "master_addr": "leader"}
    values.update(master_port="29500", cpu_threads_bind="0-1|2-3")
    config = EngineConfig.from_dict(values)
    assert (config.tensor_parallel_size, config.nnodes, config.master_port) == (4, 2, 29500)
    assert config.cpu_threads_bind == "0-1|2-3"


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive integer"),
        ({"tensor_parallel_size": 3, "nnodes": 2, "master_port": 1}, "multiple of nnodes=2"),
        ({"tensor_parallel_size": 2, "nnodes": 2}, "nnodes=2 needs master_port"),
        ({"master_port": 70000}, "master_port must be a TCP port"),
        (
            {"tensor_parallel_size": 2, "preemption_mode": "swap"},
            "tensor_parallel_size=2 cannot serve preemption_mode='swap'",
        ),
        (
            {"tensor_parallel_size": 2, "enable_lora": True},
            "tensor_parallel_size=2 cannot serve enable_lora",
        ),
        (
            {"tensor_parallel_size": 2, "speculative_method": "draft", "speculative_model": "x"},
            "tensor_parallel_size=2 cannot serve speculative_method='draft'",
        ),
        (
            {"tensor_parallel_size": 2, "quantization": "gguf"},
            "tensor_parallel_size=2 cannot serve quantization='gguf'",
        ),
    ],
)
def test_combinations_a_group_cannot_serve_are_refused_by_name(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)


def test_what_one_rank_would_refuse_is_allowed_alone():
    EngineConfig(preemption_mode="swap", enable_lora=True)
    EngineConfig(tensor_parallel_size=2, speculative_method="ngram")


def test_model_json_asks_for_tensor_parallelism_in_vllms_words():
    args = translate({"tensor_parallel_size": 2, "distributed_executor_backend": "mp"})
    assert args.engine == {"tensor_parallel_size": 2}
    assert EngineConfig.from_dict(args.engine).tensor_parallel_size == 2
    across = {"tensor_parallel_size": 4, "nnodes": 2, "master_addr": "a", "master_port": 9}
    assert translate(across).engine == across


def test_under_triton_a_group_needs_one_kind_model_instance():
    check_instance_kind("MODEL", EngineConfig(tensor_parallel_size=2))
    check_instance_kind("CPU", EngineConfig())
    with pytest.raises(ValueError, match="needs instance_group kind KIND_MODEL .*not KIND_GPU"):
        check_instance_kind("GPU", EngineConfig(tensor_parallel_size=2))
