"""The one table of request inputs (server/stub/input_table.py) is what the model config
declares, what the parser reads and what docs/requests.md lists."""

import subprocess
import sys

import numpy as np
import pytest

from slipstream.server import model_interfaces
from slipstream.server.stub import model_config
from slipstream.server.stub.input_table import INPUTS, Reading, TritonType
from slipstream.server.stub.request_parser import BadRequestError, parse_request
from support import ROOT

REPO = ROOT
NUMPY = {
    TritonType.BOOL: np.bool_,
    TritonType.INT32: np.int32,
    TritonType.UINT64: np.uint64,
    TritonType.FP32: np.float32,
}


class Config:
    def __init__(self, declared: dict) -> None:
        self.declared, self.inputs = declared, []

    def as_dict(self) -> dict:
        return self.declared

    def add_input(self, entry: dict) -> None:
        self.inputs.append(entry)

    def add_output(self, entry: dict) -> None:
        pass

    def set_model_transaction_policy(self, policy: dict) -> None:
        pass

    def set_max_batch_size(self, size: int) -> None:
        pass


def test_readme_lists_the_table():
    script = REPO / "scripts" / "request_inputs_table.py"
    done = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_names_are_unique():
    names = [row.name for row in INPUTS]
    assert len(names) == len(set(names))


def test_auto_complete_declares_every_row_in_table_order():
    config = model_config.auto_complete(Config({"backend": "python"}))
    assert [e["name"] for e in config.inputs] == [row.name for row in INPUTS]
    prompt = config.inputs[0]
    assert prompt == {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]}


def test_auto_complete_keeps_declared_inputs_and_frees_the_prompt_for_trtllm_clients():
    config = model_interfaces.auto_complete(
        Config({"input": [{"name": "stream"}], "max_batch_size": 8})
    )
    names = [e["name"] for e in config.inputs]
    assert "stream" not in names
    assert config.inputs[0]["name"] == "text_input" and config.inputs[0]["optional"] is True


@pytest.mark.parametrize(
    "row",
    [
        r
        for r in INPUTS
        if r.reading in (Reading.OPTION, Reading.SAMPLING_INT, Reading.SAMPLING_FLOAT)
    ],
    ids=lambda r: r.name,
)
def test_parser_reads_each_typed_input_into_its_target(row):
    value = np.array([1], dtype=NUMPY[row.data_type])
    parsed = parse_request({"text_input": np.array([b"hi"], dtype=object), row.name: value})
    target = getattr(parsed.options, row.target, None)
    if target is None:
        target = getattr(parsed.params, row.target)
    assert target in (1, True, [1], 1.0)


@pytest.mark.parametrize(
    "row", [r for r in INPUTS if r.reading is Reading.REFUSED], ids=lambda r: r.name
)
def test_parser_refuses_refused_inputs_by_name(row):
    with pytest.raises(BadRequestError, match=f"input '{row.name}' is not supported"):
        parse_request(
            {
                "text_input": np.array([b"hi"], dtype=object),
                row.name: np.array([b"x"], dtype=object),
            }
        )


def test_shipped_config_lists_no_inputs():
    text = (REPO / "model_repository" / "slipstream" / "config.pbtxt").read_text()
    assert "\ninput [" not in text
