"""docs/configuration.md is generated from the code (scripts/configuration_reference.py): it is
current, it lists every vLLM engine argument with what Slipstream does with it, and every
setting a model's config takes is described."""

import importlib.util
import json
from dataclasses import fields
from pathlib import Path

from slipstream import EngineConfig
from slipstream.server.stub.model_config import SERVER_PARAMETERS

ROOT = Path(__file__).resolve().parents[3]


def generator():
    spec = importlib.util.spec_from_file_location(
        "configuration_reference", ROOT / "scripts" / "configuration_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_reference_is_current():
    text = generator().render()
    assert (ROOT / "docs" / "configuration.md").read_text() == text, (
        "docs/configuration.md is stale: run python scripts/configuration_reference.py"
    )


def test_every_vllm_engine_argument_has_a_row():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    data = json.loads((ROOT / "scripts" / "data" / "vllm_engine_arguments.json").read_text())
    assert len(data["arguments"]) > 200
    missing = [a["flag"] for a in data["arguments"] if f"| `{a['flag']}` |" not in doc]
    assert missing == []
    assert "| `--max-num-seqs` | yes | sets `max_num_seqs`" in doc
    assert "| `--tensor-parallel-size` | yes | sets `tensor_parallel_size`" in doc
    assert "| `--pipeline-parallel-size` | yes | accepted only at `1`" in doc


def test_every_setting_and_serve_option_is_in_the_reference():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    for f in fields(EngineConfig):
        assert f"| `{f.name}` |" in doc, f.name
    for name in SERVER_PARAMETERS:
        assert f"| `{name}` |" in doc, name
    for flag in ("`--set`", "`--port`, `--openai-port`", "`--served-model-name`", "`--prompt`"):
        assert flag in doc


def test_every_environment_variable_listed_is_read_by_the_code():
    code = "\n".join(p.read_text() for p in (ROOT / "backend").rglob("*.py"))
    for name in generator().ENVIRONMENT:
        assert f'"{name}"' in code, name
