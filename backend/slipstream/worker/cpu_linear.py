"""How the model's linear layers multiply on CPU: the weight layout and the GEMM library.

``onednn`` (the default) packs every ``nn.Linear`` weight once into oneDNN's blocked layout
and runs the layer through oneDNN's inner product, as vLLM's CPU backend does; torch's own
fp32 ``linear`` calls MKL's sgemm, which on the AMD EPYC (Zen 4) VMs here ran the model's
shapes at 30-130 GFLOP/s against oneDNN's 110-210, and the 49k-row LM head at a third of
oneDNN's speed. ``transposed`` keeps torch's linear on a column-major copy of the weight
(faster than the stock layout for small batches on Intel Xeons); ``stock`` changes nothing.
Outputs differ from the stock layout by float rounding only (relative 1e-6).
"""
from __future__ import annotations

import enum
import functools
import logging
from typing import Optional

import torch

log = logging.getLogger("slipstream")


class CpuLinear(str, enum.Enum):
    ONEDNN = "onednn"
    TRANSPOSED = "transposed"
    STOCK = "stock"


# oneDNN picks its blocked weight format for a typical row count; any count works with it.
_PACK_ROWS_HINT = 64
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                             "_reorder_linear_weight")


def _onednn_forward(packed: torch.Tensor, bias: Optional[torch.Tensor],
                    x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _pack(module: torch.nn.Linear) -> None:
    weight = module.weight.detach().contiguous()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS_HINT)
    bias = None if module.bias is None else module.bias.detach()
    # An instance attribute shadows Linear.forward; the stock weight stays (tied embeddings
    # and any code that reads .weight keep working).
    module.forward = functools.partial(_onednn_forward, packed, bias)


def _transpose(module: torch.nn.Linear) -> None:
    if module.weight.is_contiguous():
        module.weight.data = module.weight.data.t().contiguous().t()


def prepare_linears(model: torch.nn.Module, mode: str) -> CpuLinear:
    """Apply ``mode`` to every linear layer of a CPU model; returns the mode applied
    (``onednn`` falls back to ``transposed`` where oneDNN or the dtype is unsupported)."""
    choice = CpuLinear(mode)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if choice is CpuLinear.ONEDNN:
        dtype = linears[0].weight.dtype if linears else torch.float32
        if not onednn_available() or dtype not in _ONEDNN_DTYPES:
            log.warning("oneDNN linear unavailable for %s; using transposed weights", dtype)
            choice = CpuLinear.TRANSPOSED
    for module in linears:
        if choice is CpuLinear.ONEDNN:
            _pack(module)
        elif choice is CpuLinear.TRANSPOSED:
            _transpose(module)
    return choice
