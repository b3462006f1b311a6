"""A bf16 weight packed for ``kernels/csrc/cpu_bf16_gemm.cpp`` (``dtype=bfloat16`` on a CPU with
AVX512-BF16 and no AMX), and its products. The packed layout (``panel_layout``, pairs of k
per lane) is the only resident copy of the weight: a tied input embedding looks its rows up
in it (``rows``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from slipstream.worker.layers.quantization import panel_layout

PAIR = 2  # consecutive k per lane (vdpbf16ps sums two products)


@dataclass(frozen=True)
class Bf16Weight:
    packed: torch.Tensor  # bfloat16 [N/32, K/2, 2, 16, 2]
    out_features: int  # N (the packed tensor is padded to a multiple of 32)
    in_features: int  # K

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight, widened to float32 ``[*ids.shape, K]`` (a tied
        embedding's lookups)."""
        found = panel_layout.columns(self.packed, ids.reshape(-1)).float()
        return found.reshape(*ids.shape, self.in_features)


def supports(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.shape[1] % PAIR == 0 and weight.shape[1] > 0


def pack(weight: torch.Tensor) -> Bf16Weight:
    """``weight`` ``[N, K]`` rounded to bf16 (if it is not already) and packed."""
    if not supports(weight):
        raise ValueError(f"bf16 panels need an even K, got {tuple(weight.shape)}")
    n, k = weight.shape
    return Bf16Weight(panel_layout.pack(weight.detach().to(torch.bfloat16), PAIR), n, k)


def stack(weights: Sequence[Bf16Weight]) -> Optional[Bf16Weight]:
    """Weights sharing an input as one, by output columns; None where one's columns do not
    fill its last panel."""
    k = weights[0].in_features
    if any(w.in_features != k or w.out_features % panel_layout.PANEL for w in weights):
        return None
    return Bf16Weight(
        torch.cat([w.packed for w in weights]), sum(w.out_features for w in weights), k
    )


def product(
    weight: Bf16Weight, x: torch.Tensor, bias: Optional[torch.Tensor], bf16_out: bool
) -> torch.Tensor:
    """``x`` ``[M, K]`` (float32 or bf16, rounded to bf16) times the weight: ``[M, N]``
    float32, or bf16 with ``bf16_out``."""
    return torch.ops.slipstream_cpu.bf16_gemm(x, weight.packed, weight.out_features, bias, bf16_out)
