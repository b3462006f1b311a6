"""A pooling forward: one prompt through the model to its last layer's hidden states (after
the final norm, before the LM head), pooled into one vector.

The prompt gets a KV cache of its own, just its blocks, so a pooling request takes nothing
from the shared cache, touches no other request's blocks and leaves nothing behind; the
same attention operators and forward paths as a generation step run over it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slipstream.core.pooling_params import PoolingParams, PoolingType
from slipstream.worker.attention.metadata import AttentionMetadata
from slipstream.worker.kv_cache import KVCache, KVGeometry
from slipstream.worker.model.forward import ModelForward


def pool(hidden: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """``[T, H]`` hidden states -> ``[H]`` fp32 vector."""
    hidden = hidden.float()
    if params.pooling_type is PoolingType.MEAN:
        vector = hidden.mean(dim=0)
    elif params.pooling_type is PoolingType.CLS:
        vector = hidden[0]
    else:
        vector = hidden[-1]
    return F.normalize(vector, p=2, dim=0) if params.normalize else vector


class PromptPooler:
    def __init__(self, forward: ModelForward, geometry: KVGeometry, device: torch.device) -> None:
        self.forward = forward
        self.geometry = geometry
        self.device = device

    @torch.inference_mode()
    def hidden_states(self, token_ids: list[int]) -> torch.Tensor:
        """``[T, hidden]`` for a whole prompt (one causal sequence)."""
        t, bs = len(token_ids), self.geometry.block_size
        num_blocks = -(-t // bs)
        kv = KVCache(self.geometry, num_blocks, self.device)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.arange(t, dtype=torch.long, device=dev),
            cu_seqlens_q=torch.tensor([0, t], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([t], dtype=torch.int32, device=dev),
            block_tables=torch.arange(num_blocks, dtype=torch.int32, device=dev)[None],
            max_seqlen_q=t,
            max_seqlen_k=t,
            block_size=bs,
            query_lens_host=[t],
            seq_lens_host=[t],
            verify_host=[False],
            prompt_host=[True],
        )
        ids = torch.tensor(token_ids, dtype=torch.long, device=dev)
        positions = torch.arange(t, dtype=torch.long, device=dev)
        return self.forward.hidden_states(ids, positions, meta, kv)

    def embed(self, token_ids: list[int], params: PoolingParams) -> list[float]:
        return pool(self.hidden_states(token_ids), params).cpu().tolist()
