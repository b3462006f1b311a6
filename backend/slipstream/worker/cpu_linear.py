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
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

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


def _stacked(modules: Sequence[torch.nn.Linear]) -> tuple:
    weight = torch.cat([m.weight.detach() for m in modules]).contiguous()
    if all(m.bias is None for m in modules):
        return weight, None
    bias = torch.cat([m.bias.detach() if m.bias is not None
                      else weight.new_zeros(m.out_features) for m in modules])
    return weight, bias


def fused_linear(modules: Sequence[torch.nn.Linear],
                 mode: CpuLinear) -> Callable[[torch.Tensor], torch.Tensor]:
    """One GEMM over ``modules`` stacked by output rows (q, k, v or gate, up share an input),
    in ``mode``'s library and layout: the GEMM reads the input once and is one call instead
    of several. Split, its output is each layer's own where the library computes an output
    column the same way at either width (the caller checks)."""
    weight, bias = _stacked(modules)
    if mode is CpuLinear.ONEDNN:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS_HINT)
        return functools.partial(_onednn_forward, packed, bias)
    if mode is CpuLinear.TRANSPOSED:
        weight = weight.t().contiguous().t()
    return lambda x: F.linear(x, weight, bias)


def applied_mode(module: torch.nn.Linear) -> Optional[CpuLinear]:
    """The layout ``prepare_linears`` gave ``module``; None where something else replaced its
    forward (a LoRA wrapper): its product is then not the weight's alone."""
    forward = module.__dict__.get("forward")
    if isinstance(forward, functools.partial) and forward.func is _onednn_forward:
        return CpuLinear.ONEDNN
    if forward is not None:
        return None
    if not module.weight.is_contiguous() and module.weight.t().is_contiguous():
        return CpuLinear.TRANSPOSED
    return CpuLinear.STOCK


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
