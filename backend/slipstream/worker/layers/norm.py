"""RMSNorm layers on CPU through the compiled one-pass kernel (``kernels/csrc/cpu_rms_norm.cpp``).

torch computes a Llama-style RMSNorm as ~8 operators (~35 us a call at a few rows; a decode
step of a 30-layer model makes 61 calls); the kernel reads each row once and writes it once.
The module's own ``forward`` is replaced, so the Hugging Face forward and the lean forward
(``fast_forward``, which keeps a norm whose result ``F.rms_norm`` does not reproduce bit for
bit) run the same arithmetic. Outputs differ from torch's by float rounding only (the sum of
squares is accumulated in another order). Only fp32 norms of the known classes change; the
kernel's absence (``SLIPSTREAM_CPU_KERNELS=0``, no compiler) leaves every norm as it was.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from slipstream.worker import kernels

# x * rsqrt(mean(x^2) + eps) * weight, in float32 for an fp32 model (Gemma's adds 1 to the
# weight: not one of these). The lean forward accepts the same classes.
LLAMA_STYLE_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")


def _forward(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32:
        return type(module).forward(module, x)
    return torch.ops.slipstream_cpu.rms_norm(x, module.weight, module.variance_epsilon)


def kernel_norm(module: torch.nn.Module) -> Optional[tuple[torch.Tensor, float]]:
    """(weight, eps) of an fp32 norm whose forward is the compiled RMSNorm (``prepare_norms``
    routed it there); None for any other."""
    forward = module.__dict__.get("forward")
    if not (isinstance(forward, functools.partial) and forward.func is _forward):
        return None
    norm: Any = module  # an RMS norm: its weight and variance_epsilon
    if norm.weight.dtype != torch.float32:
        return None
    return norm.weight, float(norm.variance_epsilon)


def prepare_norms(model: torch.nn.Module) -> int:
    """Route every fp32 Llama-style RMSNorm of a CPU model through the kernel; returns how
    many were (0 where the kernel is unavailable)."""
    norms = [
        m
        for m in model.modules()
        if type(m).__name__ in LLAMA_STYLE_NORMS
        and getattr(m, "weight", None) is not None
        and m.weight.dtype == torch.float32
    ]
    if not norms or not kernels.load():
        return 0
    for module in norms:
        module.forward = functools.partial(_forward, module)
    return len(norms)
