"""Which request vocabulary a request reaches: a native model answers a request that carries
none of TensorRT-LLM's inputs itself (it never enters server/trtllm), and hands one that does
to TensorRT-LLM's interface; a model written for TensorRT-LLM's clients hands it every one."""

import numpy as np
import pytest

from slipstream.server.model_interfaces import interfaces
from slipstream.server.stub.model_config import load_settings
from slipstream.server.stub.request_interface import NATIVE, ModelContext, ModelRequest
from slipstream.server.trtllm.interface import LlmapiInterface, TrtllmInterface

PROMPT = {"text_input": np.array([b"hello"], dtype=np.object_)}
OUTPUTS = ("text_output",)


def settings(tmp_path, **parameters):
    (tmp_path / "1").mkdir(exist_ok=True)
    return load_settings({"model": "default", **parameters}, "slipstream", tmp_path)


def model(batched=False):
    return ModelContext(batched, True, frozenset(OUTPUTS), lambda text: [1])


def test_a_native_request_on_a_native_model_stays_native(tmp_path):
    chosen = interfaces(settings(tmp_path), batched=False)
    sampling = {"sampling_parameters": np.array([b'{"temperature": 0}'], dtype=np.object_)}
    typed = {"max_tokens": np.array([4], np.int32), "stop_words": np.array([b""], np.object_)}
    for inputs in (PROMPT, {**PROMPT, **sampling}, {**PROMPT, **typed}):
        assert chosen.pick(inputs, OUTPUTS) is NATIVE


@pytest.mark.parametrize(
    "extra, outputs",
    [
        ({"beam_width": np.array([2], np.int32)}, OUTPUTS),
        ({"input_ids": np.array([1, 2], np.int32)}, OUTPUTS),
        ({}, ("text_output", "output_ids")),
    ],
    ids=["beam_width", "input_ids", "output_ids"],
)
def test_a_request_with_trtllm_inputs_on_a_native_model_goes_to_trtllm(tmp_path, extra, outputs):
    chosen = interfaces(settings(tmp_path), batched=False)
    assert isinstance(chosen.pick({**PROMPT, **extra}, outputs), TrtllmInterface)


def test_trtllm_models_hand_every_request_to_their_interface(tmp_path):
    for chosen in (
        interfaces(settings(tmp_path, compatibility="trtllm"), batched=False),
        interfaces(settings(tmp_path), batched=True),
    ):
        assert isinstance(chosen.pick(PROMPT, OUTPUTS), TrtllmInterface)
    llmapi = interfaces(settings(tmp_path, interface="llmapi"), batched=False)
    assert isinstance(llmapi.pick(PROMPT, OUTPUTS), LlmapiInterface)


def test_the_native_interface_keeps_the_native_rules(tmp_path):
    """Empty stop words mean none and end_id's text is not emitted, on the native path too."""
    row = {**PROMPT, "stop_words": np.array([b"", b"end"], np.object_), "end_id": np.array([7])}
    translation = NATIVE.translate(ModelRequest(row, OUTPUTS, model()), 0)
    assert translation.row.inputs["stop_words"].tolist() == [b"end"]
    assert translation.row.end_ids == [7]
