"""The attention function transformers calls inside every layer: it writes the step's new
K/V into the paged cache and attends over each sequence's blocks (block-diagonal causal).

transformers passes no per-call state we can use, so the model runner publishes the
step's metadata (with its attention plan) and cache tensors in a ``StepContext`` for the
length of the forward: ``with step_context(...): model(...)``.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator, Optional, cast

import torch

from slipstream.worker.attention.base import AttentionOps
from slipstream.worker.attention.layer import AttentionLayer
from slipstream.worker.attention.metadata import AttentionMetadata

ATTENTION_NAME = "slipstream_paged"
_local = threading.local()


@dataclass
class StepContext:
    meta: AttentionMetadata
    key_caches: list[torch.Tensor]  # per layer [num_blocks, block_size, Hkv, D]
    value_caches: list[torch.Tensor]
    ops: AttentionOps  # torch_backend, cpu_backend or triton_backend


@contextlib.contextmanager
def step_context(ctx: StepContext) -> Iterator[StepContext]:
    """Publish ``ctx`` to the attention hook of the forward run inside the block; it is
    withdrawn however the forward ends, so no later call can see a finished step's state."""
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        _local.ctx = None


def get_context() -> StepContext:
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("slipstream attention called outside an engine step")
    return ctx


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query ``[1, H, T, D]``, key/value ``[1, Hkv, T, D]`` -> ``([1, T, H, D], None)``."""
    ctx = get_context()
    # transformers' attention layers carry an int layer_idx; torch types module attributes
    # as Tensor | Module
    index = cast(int, module.layer_idx)
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    layer = AttentionLayer(
        ctx.key_caches[index], ctx.value_caches[index], scale, sliding_window, softcap
    )
    ctx.ops.store_step_kv(k, v, layer, ctx.meta)
    out = ctx.ops.paged_attention(q.contiguous(), layer, ctx.meta)
    return out.unsqueeze(0), None


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return ATTENTION_NAME
