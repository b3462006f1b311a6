"""What the layer above the stub adds to every model it serves: the config additions of its
request interfaces, the interfaces a model's settings select, and the metric families it
defines. The stub's adapter takes them as its ``extensions``; the composition root
(``slipstream.server.triton_model``) sets TensorRT-LLM's. Pure Python (no Triton)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from slipstream.server.stub.metrics import FamilyBuilder
from slipstream.server.stub.model_config import ModelSettings
from slipstream.server.stub.request_interface import ConfigAdditions, Interfaces, no_additions


def native_only(settings: ModelSettings, batched: bool) -> Interfaces:
    return Interfaces()


@dataclass(frozen=True)
class Extensions:
    # the model config (as Triton hands it to auto-complete) -> what its interfaces add
    config_additions: Callable[[Mapping[str, Any]], ConfigAdditions] = no_additions
    # a model's settings and whether it has a batch dimension -> the interfaces it serves
    interfaces: Callable[[ModelSettings, bool], Interfaces] = native_only
    # metric_families name -> the families of that set
    metric_families: Mapping[str, FamilyBuilder] = field(default_factory=dict)
