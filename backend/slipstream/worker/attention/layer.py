"""One attention layer as the ops see it: its paged K/V caches and how it scores keys (what
vLLM's ``Attention`` layer holds beside its impl). The model forward makes one per layer call
and hands it to ``store_step_kv`` and ``paged_attention``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class AttentionLayer:
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor  # same shape and strides
    scale: float  # on q.k (usually head_dim ** -0.5)
    sliding_window: Optional[int] = None  # keys within this many positions; None: all
    softcap: Optional[float] = None  # scores squashed into +-softcap by tanh (Gemma2)

    @property
    def window(self) -> int:
        """``sliding_window`` as the kernels take it: 0 for none."""
        return int(self.sliding_window or 0)

    @property
    def cap(self) -> float:
        """``softcap`` as the kernels take it: 0.0 for none."""
        return float(self.softcap or 0.0)
