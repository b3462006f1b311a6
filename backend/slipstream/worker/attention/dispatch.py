"""Pick the paged-attention operators for a device.

``get_ops(device)`` returns a module with ``store_kv``, ``store_step_kv``,
``paged_decode_attention``, ``paged_prefill_attention`` and ``paged_attention``:

* :mod:`slipstream.worker.attention.triton_backend` on CUDA when OpenAI Triton imports,
* :mod:`slipstream.worker.attention.cpu_backend` on CPU when its compiled decode kernel loads,
* :mod:`slipstream.worker.attention.torch_backend` otherwise.

``SLIPSTREAM_ATTENTION=torch`` forces the torch path anywhere, ``SLIPSTREAM_ATTENTION=cpu``
the compiled CPU kernel (raising if it cannot be built); ``SLIPSTREAM_ATTENTION=triton``
forces the kernels (on CPU they only run under ``TRITON_INTERPRET=1``, set before the first
import) and raises if triton cannot be imported. Triton is imported lazily, only here, so the
package works without it.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Optional, Union

import torch

from slipstream.worker import kernels
from slipstream.worker.attention import cpu_backend, torch_backend as torch_ops
from slipstream.worker.attention.base import AttentionOps

logger = logging.getLogger(__name__)

ENV_VAR = "SLIPSTREAM_ATTENTION"
_triton_ops: Optional[ModuleType] = None
_triton_error: Optional[BaseException] = None


def _load_triton_ops() -> Optional[ModuleType]:
    """The kernel module, or None (once, with the reason logged) when triton is unusable."""
    global _triton_ops, _triton_error
    if _triton_ops is None and _triton_error is None:
        try:
            from slipstream.worker.attention import triton_backend as triton_kernels

            _triton_ops = triton_kernels
        except Exception as exc:  # ImportError, or a triton build that fails to initialise
            _triton_error = exc
            logger.warning("OpenAI Triton kernels unavailable, using torch attention: %s", exc)
    return _triton_ops


def triton_available() -> bool:
    return _load_triton_ops() is not None


def get_ops(device: Union[torch.device, str, None] = None, choice: str = "auto") -> AttentionOps:
    """The ops module for ``device`` (see the module docstring for the rules); ``choice``
    (the engine's ``attention_ops``) other than ``auto`` picks one as the variable would."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if choice in ("", "auto"):
        choice = os.environ.get(ENV_VAR, "").strip().lower()
    if choice not in ("", "auto", "torch", "triton", "cpu"):
        raise ValueError(f"{ENV_VAR} must be 'torch', 'cpu' or 'triton', got {choice!r}")
    if choice == "torch":
        return torch_ops
    if choice == "cpu":
        if not kernels.load():
            raise RuntimeError(
                f"{ENV_VAR}=cpu but the CPU kernel is unavailable: {kernels.unavailable_reason()}"
            )
        return cpu_backend
    if choice == "triton":
        ops = _load_triton_ops()
        if ops is None:
            raise RuntimeError(f"{ENV_VAR}=triton but triton cannot be imported: {_triton_error}")
        return ops
    if device.type == "cuda":
        ops = _load_triton_ops()
        if ops is not None:
            return ops
    if device.type == "cpu" and kernels.load():
        return cpu_backend
    return torch_ops
