"""KV-cache geometry and allocation, sized from the model's own shapes (GQA/MQA aware)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slipstream.worker.transfer import to_device


@dataclass(frozen=True)
class KVGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """K and V, every layer: with GQA this is num_kv_heads, not num_attention_heads."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @classmethod
    def from_model_config(cls, config, block_size: int, dtype: torch.dtype) -> "KVGeometry":
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(text.num_hidden_layers, kv_heads, head_dim, block_size, dtype)


def num_blocks_for_budget(geometry: KVGeometry, budget_bytes: int) -> int:
    return budget_bytes // geometry.bytes_per_block


class KVCache:
    """One tensor for the whole cache: ``[2, layers, blocks, block_size, kv_heads, head_dim]``."""

    def __init__(self, geometry: KVGeometry, num_blocks: int, device: torch.device) -> None:
        g = geometry
        self.geometry = g
        self.num_blocks = num_blocks
        self.data = torch.zeros(
            2,
            g.num_layers,
            num_blocks,
            g.block_size,
            g.num_kv_heads,
            g.head_dim,
            dtype=g.dtype,
            device=device,
        )
        self.key_caches = [self.data[0, i] for i in range(g.num_layers)]
        self.value_caches = [self.data[1, i] for i in range(g.num_layers)]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write of forked sequences: block ``dst`` := block ``src``, every layer."""
        if not pairs:
            return
        src, dst = to_device(torch.tensor(pairs, dtype=torch.long).T.contiguous(), self.data.device)
        self.data.index_copy_(2, dst, self.data.index_select(2, src))

    def copy_blocks_out(self, block_ids: list[int]) -> torch.Tensor:
        """Gather blocks for swapping: ``[2, layers, n, block_size, Hkv, D]``."""
        idx = to_device(torch.tensor(block_ids, dtype=torch.long), self.data.device)
        return self.data.index_select(2, idx)

    def copy_blocks_in(self, block_ids: list[int], payload: torch.Tensor) -> None:
        idx = to_device(torch.tensor(block_ids, dtype=torch.long), self.data.device)
        self.data.index_copy_(2, idx, payload.to(self.data.device))
