"""The seam between the attention hook and its kernels: what an ops module provides.

Three modules implement it, ``torch_backend`` (any device; the reference), ``cpu_backend``
(the compiled kernels of ``worker/kernels``; the CPU default) and ``triton_backend`` (OpenAI
Triton, CUDA); ``dispatch.get_ops`` picks one per device. All work on the paged
cache layout ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer and on the
step's ``AttentionMetadata`` and the ``AttentionPlan`` made from it, each layer's caches and
scoring coming as an ``AttentionLayer``; slot -1 marks rows (padding) whose K/V is not stored.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from slipstream.worker.attention.layer import AttentionLayer
from slipstream.worker.attention.metadata import AttentionMetadata, AttentionPlan


@runtime_checkable
class AttentionOps(Protocol):
    def plan(
        self, meta: AttentionMetadata, key_cache: torch.Tensor, num_query_heads: int
    ) -> AttentionPlan:
        """What every layer of the step reuses, worked out once (the model runner calls it
        before the forward and keeps it in ``meta.plan``)."""

    def store_step_kv(
        self, key: torch.Tensor, value: torch.Tensor, layer: AttentionLayer, meta: AttentionMetadata
    ) -> None:
        """Write the step's new K/V rows (``[T, Hkv, D]``) into the layer's caches at
        ``meta.slot_mapping``."""

    def paged_attention(
        self, query: torch.Tensor, layer: AttentionLayer, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Causal attention of the step's queries (``[T, H, D]``, sequences packed by
        ``meta.cu_seqlens_q``) over each sequence's K/V in the layer's caches; returns
        ``[T, H, D]``."""
