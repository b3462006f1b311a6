"""vLLM's vocabulary on `slipstream serve`: the model positional, the engine arguments users type
for `vllm serve` as flags, `--set` / config parameters / model.json taking the same names (with
Slipstream's own names as aliases that never contradict them), `--version`, a help that shows
defaults and ends with examples. No server is started."""

import json

import pytest

from slipstream import EngineConfig
from slipstream.server.launch.cli import build_parser, main, serve_overrides, triton_ports
from slipstream.server.launch.config_pbtxt import read_parameters
from slipstream.server.launch.repository import (
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_REPOSITORY,
    check_models,
    find_models,
    rename_model,
    render_model_repository,
)
from slipstream.server.stub.model_config import load_settings

VLLM_FLAGS = [
    "/models/m",
    "--max-num-seqs", "8",
    "--max-model-len", "512",
    "--max-num-batched-tokens", "256",
    "--gpu-memory-utilization", "0.5",
    "--enable-prefix-caching",
    "--dtype", "bfloat16",
    "--quantization", "int8",
    "--kv-cache-dtype", "bfloat16",
    "--tensor-parallel-size", "1",
    "--enforce-eager",
    "--swap-space", "2",
    "--seed", "7",
    "--served-model-name", "m",
    "--lora-modules", "sql=/adapters/sql",
    "--port", "9000",
]  # fmt: skip


def serve_args(*argv):
    return build_parser().parse_args(["serve", *argv])


def engine_of(tmp_path, overrides) -> EngineConfig:
    """What the shipped model's engine is given ``overrides``, as serve checks it."""
    repo = render_model_repository(DEFAULT_MODEL_REPOSITORY, tmp_path / "repo", overrides)
    settings = check_models(find_models(repo))[DEFAULT_MODEL_NAME]
    return EngineConfig.from_dict(settings.engine)


def test_vllm_serve_flags_parse_into_config_parameters_under_vllms_names():
    overrides = serve_overrides(serve_args(*VLLM_FLAGS))
    assert overrides == {
        "model": "/models/m",
        "max_num_seqs": "8",
        "max_model_len": "512",
        "max_num_batched_tokens": "256",
        "gpu_memory_utilization": "0.5",
        "enable_prefix_caching": "true",
        "dtype": "bfloat16",
        "quantization": "int8",
        "kv_cache_dtype": "bfloat16",
        "tensor_parallel_size": "1",
        "enforce_eager": "true",
        "swap_space": "2",
        "seed": "7",
        "served_model_name": "m",
        "lora_modules": json.dumps({"sql": "/adapters/sql"}),
        "enable_lora": "true",
    }
    assert serve_args(*VLLM_FLAGS).openai_port == 9000


def test_a_flag_and_set_under_either_name_give_the_same_engine(tmp_path):
    by_flag = engine_of(tmp_path / "a", serve_overrides(serve_args("--enforce-eager")))
    by_vllm_name = engine_of(tmp_path / "b", {"enforce_eager": "true"})
    by_own_name = engine_of(tmp_path / "c", {"enable_cuda_graphs": "false"})
    assert by_flag == by_vllm_name == by_own_name
    assert by_flag.enable_cuda_graphs is False
    swapped = engine_of(tmp_path / "d", serve_overrides(serve_args("--swap-space", "0.5")))
    assert swapped.swap_space_bytes == 2**29
    fcfs = engine_of(tmp_path / "e", {"scheduling_policy": "priority"})
    assert fcfs.policy == "priority"


def test_an_override_replaces_the_parameter_of_the_other_name(tmp_path):
    """The shipped config says enable_cuda_graphs: --set enforce_eager=true takes its place
    instead of contradicting it."""
    repo = render_model_repository(
        DEFAULT_MODEL_REPOSITORY, tmp_path / "repo", {"enforce_eager": "true"}
    )
    params = read_parameters((repo / DEFAULT_MODEL_NAME / "config.pbtxt").read_text())
    assert params["enforce_eager"] == "true" and "enable_cuda_graphs" not in params


def test_two_names_for_one_setting_in_one_config_are_refused(tmp_path):
    with pytest.raises(ValueError, match="enable_cuda_graphs and enforce_eager both set"):
        load_settings({"enable_cuda_graphs": "true", "enforce_eager": "true"}, "python", tmp_path)


def test_model_json_and_config_parameters_take_the_same_names(tmp_path):
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.json").write_text(
        json.dumps({"enforce_eager": True, "swap_space": 1, "scheduling_policy": "priority"})
    )
    from_json = load_settings({}, "slipstream", tmp_path).engine
    from_params = load_settings(
        {"enforce_eager": "true", "swap_space": "1", "scheduling_policy": "priority"},
        "slipstream",
        tmp_path / "elsewhere",
    ).engine
    assert from_json == from_params
    assert from_json["enable_cuda_graphs"] is False and from_json["policy"] == "priority"


def test_tensor_parallelism_is_an_engine_setting_checked_by_the_engine(tmp_path):
    engine = engine_of(tmp_path / "a", serve_overrides(serve_args("--tensor-parallel-size", "2")))
    assert engine.tensor_parallel_size == 2
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        engine_of(tmp_path / "b", serve_overrides(serve_args("--tensor-parallel-size", "0")))


def test_model_positional_and_model_flag_agree_or_are_refused():
    assert serve_overrides(serve_args("m"))["model"] == "m"
    assert serve_overrides(serve_args("--model", "m"))["model"] == "m"
    with pytest.raises(SystemExit, match="two models"):
        serve_overrides(serve_args("a", "--model", "b"))


def test_openai_port_on_tritons_default_port_moves_triton_to_a_free_one():
    assert triton_ports(serve_args("--port", "8000")) == {
        "http_port": 0,
        "grpc_port": 8001,
        "metrics_port": 8002,
    }
    assert triton_ports(serve_args()) == {
        "http_port": 8000,
        "grpc_port": 8001,
        "metrics_port": 8002,
    }
    with pytest.raises(SystemExit, match="also the OpenAI port"):
        triton_ports(serve_args("--port", "9000", "--http-port", "9000"))


def test_served_model_name_renames_the_model_directory_and_config(tmp_path):
    repo = render_model_repository(DEFAULT_MODEL_REPOSITORY, tmp_path / "repo")
    rename_model(repo, DEFAULT_MODEL_NAME, "smol")
    assert [m.name for m in find_models(repo)] == ["smol"]
    assert 'name: "smol"' in (repo / "smol" / "config.pbtxt").read_text()
    with pytest.raises(ValueError):
        rename_model(repo, "smol", "../x")


def test_help_shows_defaults_and_ends_with_examples(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    assert "--max-num-seqs N" in text and "most requests in one engine step (default: 64)" in text
    assert "--enforce-eager, --no-enforce-eager" in text
    assert text.rstrip().splitlines()[-1].startswith("Slipstream's own setting names")
    assert "examples:\n  slipstream serve" in text


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out.strip() == "slipstream 0.1.0"
