"""The request vocabularies a Slipstream model serves, wired together: the stub's own
(vLLM's), TensorRT-LLM's ensemble and its LLM-API model (``server/trtllm``), and TensorRT-LLM's
metric families. Chosen per model from its settings:

* ``interface: "llmapi"``: every request is an LLM-API model's;
* ``compatibility: "trtllm"`` or a batch dimension (``max_batch_size`` > 0): every request is
  the ensemble's (TensorRT-LLM's semantics with ``compatibility: "trtllm"``);
* otherwise the native vocabulary, and the ensemble's for a request that carries one of its
  inputs: a request that carries none never enters ``server/trtllm``.

Pure Python (no Triton): ``auto_complete`` is what a model's ``auto_complete_config`` does.
"""

from __future__ import annotations

from typing import TypeVar

from slipstream.server.stub import model_config
from slipstream.server.stub.extensions import Extensions
from slipstream.server.stub.model_config import AutoCompleteConfig, ModelSettings
from slipstream.server.stub.request_interface import NATIVE, Interfaces
from slipstream.server.trtllm.interface import (
    LlmapiInterface,
    TrtllmInterface,
    config_additions,
)
from slipstream.server.trtllm.metrics import trtllm_families


def interfaces(settings: ModelSettings, batched: bool) -> Interfaces:
    if settings.interface == "llmapi":
        return Interfaces(LlmapiInterface(settings.compatibility == "trtllm"))
    if settings.compatibility == "trtllm" or batched:
        return Interfaces(TrtllmInterface(settings.compatibility == "trtllm"))
    return Interfaces(NATIVE, (TrtllmInterface(),))


EXTENSIONS = Extensions(
    config_additions=config_additions,
    interfaces=interfaces,
    metric_families={"trtllm": trtllm_families},
)

_Config = TypeVar("_Config", bound=AutoCompleteConfig)


def auto_complete(config: _Config) -> _Config:
    """A model config completed with the native inputs and outputs and TensorRT-LLM's."""
    return model_config.auto_complete(config, EXTENSIONS.config_additions)
