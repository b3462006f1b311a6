"""model.json (vLLM engine arguments) and config.pbtxt parameters as the slipstream backend
reads them, without a server; the load through a real tritonserver is in test_vllm_backend."""

import json

import pytest

from slipstream import EngineConfig
from slipstream.server.stub.engine_arg_reader import resolve_model, translate
from slipstream.server.stub.model_config import load_settings
from support import ROOT

# The stub's modules that import triton_python_backend_utils (directly or through wire).
TRITON_BOUND_STUB_MODULES = ("adapter", "intake", "sender", "wire")

SAMPLE = {"model": "facebook/opt-125m", "gpu_memory_utilization": 0.5, "enforce_eager": True}


def test_vllm_sample_engine_args_map_onto_engine_settings():
    args = translate(
        {
            **SAMPLE,
            "model": "default",
            "max_model_len": 1024,
            "dtype": "half",
            "block_size": 32,
            "max_num_seqs": 8,
            "max_num_batched_tokens": 256,
            "enable_prefix_caching": "false",
            "enable_chunked_prefill": True,
            "seed": 3,
            "swap_space": 0.5,
            "scheduling_policy": "priority",
            "speculative_config": {
                "method": "ngram",
                "num_speculative_tokens": 3,
                "prompt_lookup_max": 4,
                "disable_by_batch_size": 6,
            },
        }
    )
    assert args.engine == {
        "model": "default",
        "gpu_memory_utilization": 0.5,
        "enable_cuda_graphs": False,
        "max_model_len": 1024,
        "dtype": "float16",
        "block_size": 32,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 256,
        "enable_prefix_caching": False,
        "enable_chunked_prefill": True,
        "seed": 3,
        "swap_space_bytes": 2**29,
        "policy": "priority",
        "speculative_method": "ngram",
        "num_speculative_tokens": 3,
        "ngram_prompt_lookup_max": 4,
        "speculative_disable_by_batch_size": 6,
    }
    EngineConfig.from_dict(args.engine)  # every mapped value is a valid setting


def test_unknown_engine_argument_is_named_with_the_supported_ones():
    with pytest.raises(ValueError) as err:
        translate({**SAMPLE, "invalid_attribute": True})
    assert "unknown or unsupported engine argument 'invalid_attribute'" in str(err.value)
    assert "max_num_seqs" in str(err.value)  # the list of what is understood


@pytest.mark.parametrize(
    "key, value, reason",
    [
        ("pipeline_parallel_size", "2", "tensor parallelism only"),
        ("node_rank", 1, "headless"),
        ("quantization", "fp8", "weights load unquantized"),
        ("trust_remote_code", True, "built into transformers"),
        ("kv_cache_dtype", "fp8", "the model's dtype"),
    ],
)
def test_arguments_this_engine_cannot_honour_are_refused(key, value, reason):
    with pytest.raises(ValueError) as err:
        translate({**SAMPLE, key: value})
    assert f"{key}={value!r} is not supported (" in str(err.value) and reason in str(err.value)


@pytest.mark.parametrize(
    "key, value",
    [
        ("tensor_parallel_size", 1),
        ("pipeline_parallel_size", 1),
        ("enable_lora", "false"),
        ("quantization", None),
        ("trust_remote_code", False),
        ("served_model_name", "x"),
        ("disable_log_requests", True),
        ("distributed_executor_backend", "mp"),
    ],
)
def test_arguments_meaning_nothing_to_do_are_accepted(key, value):
    assert translate({**SAMPLE, key: value}).engine["enable_cuda_graphs"] is False


def test_every_problem_is_reported_at_once():
    with pytest.raises(ValueError) as err:
        translate({"dtype": "fp4", "pipeline_parallel_size": 4, "nonsense": 1})
    assert str(err.value).count(";") == 2


def test_model_path_resolution(tmp_path, monkeypatch):
    model_dir = tmp_path / "repo" / "m"
    (model_dir / "1" / "weights").mkdir(parents=True)
    (tmp_path / "cwd_weights").mkdir()
    monkeypatch.chdir(tmp_path)
    search = [model_dir, model_dir / "1", tmp_path]
    assert resolve_model("default", search) == "default"
    assert resolve_model("weights", search) == str((model_dir / "1" / "weights").resolve())
    assert resolve_model("./cwd_weights", search) == str((tmp_path / "cwd_weights").resolve())
    with pytest.raises(ValueError, match="does not download"):
        resolve_model("invalid_model", search)


def write(tmp_path, model_json=None):
    model_dir = tmp_path / "m"
    (model_dir / "1").mkdir(parents=True)
    if model_json is not None:
        (model_dir / "1" / "model.json").write_text(json.dumps(model_json))
    return model_dir


def test_parameters_override_model_json(tmp_path):
    model_dir = write(tmp_path, {"model": "default", "max_num_seqs": 8, "block_size": 32})
    settings = load_settings({"max_num_seqs": "4"}, "slipstream", model_dir)
    assert settings.engine == {
        "model": "default",
        "max_num_seqs": "4",
        "block_size": 32,
        "max_queue_size": 256,
    }  # the server default


@pytest.mark.parametrize(
    "backend, params, model_json, report, families",
    [
        # on by default: the inference gateway's and vLLM's dashboards' series (issue 27)
        ("slipstream", {}, {}, True, ("slipstream", "vllm")),
        ("vllm", {}, {}, False, ("slipstream", "vllm")),  # the vLLM backend alias: its default, off
        ("slipstream", {"REPORT_CUSTOM_METRICS": "true"}, {}, True, ("slipstream", "vllm")),
        (
            "vllm",
            {"REPORT_CUSTOM_METRICS": "TRUE"},
            {"disable_log_stats": True},
            False,
            ("slipstream", "vllm"),
        ),
        ("python", {}, {}, True, ("slipstream",)),  # model_repository/slipstream: on by default
        (
            "python",
            {"REPORT_CUSTOM_METRICS": "false", "metric_families": "vllm"},
            {},
            False,
            ("vllm",),
        ),
    ],
)
def test_custom_metrics_switches(tmp_path, backend, params, model_json, report, families):
    settings = load_settings(params, backend, write(tmp_path, {"model": "default", **model_json}))
    assert (settings.report_metrics, settings.metric_families) == (report, families)


@pytest.mark.parametrize(
    "value, expected", [("", False), ("false", False), ("true", True), ("True", True)]
)
def test_health_check_switch(tmp_path, value, expected):
    params = {"ENABLE_VLLM_HEALTH_CHECK": value}
    assert load_settings(params, "slipstream", write(tmp_path)).health_check is expected


@pytest.mark.parametrize(
    "params, message",
    [
        ({"ENABLE_VLLM_HEALTH_CHECK": "yes"}, 'must be "true" or "false"'),
        ({"metric_families": "vllm,prometheus"}, "unknown ['prometheus']"),
    ],
)
def test_bad_switch_values_fail_the_load(tmp_path, params, message):
    with pytest.raises(ValueError) as err:
        load_settings(params, "slipstream", write(tmp_path))
    assert message in str(err.value)


def test_model_json_must_be_a_json_object(tmp_path):
    model_dir = write(tmp_path)
    (model_dir / "1" / "model.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_settings({}, "slipstream", model_dir)
    (model_dir / "1" / "model.json").write_text("{broken")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_settings({}, "slipstream", model_dir)


def test_enable_lora_reads_multi_lora_json_as_vllm_backend_does(tmp_path, monkeypatch):
    model_dir = write(
        tmp_path,
        {
            "model": "default",
            "enable_lora": "true",
            "max_loras": 2,
            "max_lora_rank": 32,
            "max_cpu_loras": 4,
        },
    )
    (model_dir / "1" / "doll").mkdir()
    (tmp_path / "sheep").mkdir()
    monkeypatch.chdir(tmp_path)  # vLLM resolves relative paths against the working directory
    (model_dir / "1" / "multi_lora.json").write_text(
        json.dumps({"doll": "./doll", "sheep": "./sheep"})
    )
    engine = load_settings({}, "slipstream", model_dir).engine
    assert engine["lora_modules"] == {
        "doll": str((model_dir / "1" / "doll").resolve()),
        "sheep": str((tmp_path / "sheep").resolve()),
    }
    config = EngineConfig.from_dict(engine)
    assert (config.enable_lora, config.max_loras, config.max_lora_rank) == (True, 2, 32)
    (model_dir / "1" / "multi_lora.json").write_text(json.dumps({"goat": "./nowhere"}))
    with pytest.raises(ValueError, match="LoRA 'goat' not found"):
        load_settings({}, "slipstream", model_dir)
    (model_dir / "1" / "multi_lora.json").unlink()
    with pytest.raises(ValueError, match="cannot find .*multi_lora.json"):
        load_settings({}, "slipstream", model_dir)


def test_lora_extra_vocab_size_is_accepted_with_a_warning(caplog):
    with caplog.at_level("WARNING", logger="slipstream"):
        args = translate({"enable_lora": True, "lora_extra_vocab_size": 256})
    assert "lora_extra_vocab_size" not in args.engine
    assert "lora_extra_vocab_size=256 is accepted and has no effect" in caplog.text


def test_max_logprobs_from_model_json(tmp_path):
    settings = load_settings({}, "slipstream", write(tmp_path, {"max_logprobs": 5}))
    assert settings.max_logprobs == 5


def test_shipped_sample_repository_checks_out():
    """samples/model_repository: vllm_backend's sample with the backend renamed."""

    from slipstream.server.launch.repository import check_models, find_models

    repo = ROOT / "samples" / "model_repository"
    models = find_models(repo)
    assert [(m.name, m.backend) for m in models] == [("vllm_model", "slipstream")]
    settings = check_models(models)["vllm_model"]
    assert settings.engine["model"] == "default" and settings.report_metrics
    assert (
        find_models(ROOT / "model_repository")[0].name == "slipstream"
    )  # the Python-backend layout is found by its model.py


def test_install_backend_writes_the_backend_under_each_name(tmp_path, capsys):

    from slipstream.server.launch.cli import main

    assert main(["install-backend", "--backend-directory", str(tmp_path), "--alias", "vllm"]) == 0
    source = ROOT / "triton_backends" / "slipstream" / "model.py"
    for name in ("slipstream", "vllm"):
        assert (tmp_path / name / "model.py").read_text() == source.read_text()
    assert "installed" in capsys.readouterr().out


def test_a_model_py_written_before_the_composition_root_is_still_found_and_loads_it(
    tmp_path, monkeypatch
):
    """Repositories rendered before import ``slipstream.server.stub.triton_model`` (or, before
    the server's rooms, ``slipstream.server.triton_model``): both are the composition root's
    class, TensorRT-LLM's interfaces wired in."""
    import importlib
    import shutil
    import sys
    from unittest import mock

    from slipstream.server.launch.repository import find_models

    shipped = ROOT / "model_repository" / "slipstream"
    model = tmp_path / "old" / "slipstream"
    shutil.copytree(shipped, model)
    old = model / "1" / "model.py"
    old.write_text(
        old.read_text().replace(
            "slipstream.server.triton_model", "slipstream.server.stub.triton_model"
        )
    )
    assert "slipstream.server.stub.triton_model" in old.read_text()
    assert [m.name for m in find_models(tmp_path / "old")] == ["slipstream"]
    # Outside a stub: a stand-in for the module only Triton's Python backend provides.
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", mock.MagicMock())
    adapters = ("slipstream.server.triton_model", "slipstream.server.stub.triton_model")
    bound = (*adapters, *(f"slipstream.server.stub.{m}" for m in TRITON_BOUND_STUB_MODULES))
    try:
        current, old_path = (importlib.import_module(name) for name in adapters)
        assert old_path.TritonPythonModel is current.TritonPythonModel
        assert "trtllm" in current.TritonPythonModel.extensions.metric_families
    finally:  # bound to the stand-in: no later test may find them imported
        for name in bound:
            sys.modules.pop(name, None)
