"""The one entry that prepares a loaded fp32 model's layers for the CPU engine (the served model,
its draft model and the quality gate's candidates alike)."""

from __future__ import annotations

import logging

import torch

from slipstream.worker.kernels.cpu_features import CpuFeatures
from slipstream.worker.layers.linear import prepare_linears
from slipstream.worker.layers.memory import release_freed_memory
from slipstream.worker.layers.norm import prepare_norms
from slipstream.worker.layers.reduced_linear import WeightFormat, prepare_reduced_linears

log = logging.getLogger("slipstream")


def prepare_cpu_model(model: torch.nn.Module, weights: str, cpu_linear: str) -> str:
    """The CPU engine's layers for a loaded fp32 model: its linear layers in ``weights``
    (``float32`` in ``cpu_linear``'s layout, or ``bfloat16`` / ``int8``), its norms on the
    compiled kernel. Returns what runs the products, for the start-up log."""
    if weights == WeightFormat.FLOAT32.value:
        how = f"fp32 weights; products: {prepare_linears(model, cpu_linear).value}"
    else:
        how = prepare_reduced_linears(model, WeightFormat(weights))
        release_freed_memory()
    log.info("CPU linear layers: %s (%s)", how, CpuFeatures.detect())
    prepare_norms(model)
    return how
