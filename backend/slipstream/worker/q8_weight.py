"""An int8 weight in blocks of 32 (``quantization=int8``), packed as ``ops/cpu_q8_gemm.cpp``
reads it, and its products with int8 activations quantized the same way.

A weight ``[N, K]`` is quantized symmetrically per output column and block of 32 along K
(``scale = max|w| / 127``), as llama.cpp's Q8_0; each product quantizes its input rows the
same way per block and sums the blocks' integer products exactly before scaling them
(the kernel's header says how). The packed layout is the only resident copy of the weight:
a tied input embedding looks its rows up in it (``rows``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from slipstream.worker import panel_layout
from slipstream.worker.panel_layout import PANEL

BLOCK = 32  # K per scale
QUAD = 4  # consecutive k per lane (vpdpbusd sums four products)


@dataclass(frozen=True)
class Q8Weight:
    packed: torch.Tensor  # uint8 [N/32, K/4, 2, 16, 4]: q + 128
    scales: torch.Tensor  # float32 [N/32, K/32, 32]
    out_features: int  # N (the packed tensors are padded to a multiple of 32)
    in_features: int  # K

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes

    def columns(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Output columns ``ids`` ``[T]`` as stored: ``q`` float32 ``[T, K]`` (-127..127) and
        their block scales ``[T, K/32]``."""
        q = panel_layout.columns(self.packed, ids).float().sub_(128)
        return q, self.scales[ids // PANEL, :, ids % PANEL]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the dequantized weight, float32 ``[*ids.shape, K]`` (the lookups of
        a tied embedding)."""
        q, scale = self.columns(ids.reshape(-1))
        values = q.view(-1, self.in_features // BLOCK, BLOCK).mul_(scale[..., None])
        return values.reshape(*ids.shape, self.in_features)

    def dequantized(self) -> torch.Tensor:
        """The whole weight in float32 ``[N, K]`` (tests)."""
        return self.rows(torch.arange(self.out_features))


def supports(weight: torch.Tensor) -> bool:
    """The layout needs K in whole blocks."""
    return weight.dim() == 2 and weight.shape[1] % BLOCK == 0 and weight.shape[1] > 0


def _block_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per block of 32 along the last dim: ``x ~= q * scale`` per block.
    ``q`` int16 ``[..., K]``, ``scale`` float32 ``[..., K/32]``. Rounds as the kernel does
    (``x * (127 / amax)``, ties to even)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK)
    amax = blocks.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv[..., None]).clamp_(-127, 127).to(torch.int16)
    return q.reshape(x.shape), amax / 127.0


def quantize(weight: torch.Tensor) -> Q8Weight:
    """``weight`` ``[N, K]`` (any float dtype) packed for ``cpu_q8_gemm``."""
    if not supports(weight):
        raise ValueError(f"int8 blocks need K a multiple of {BLOCK}, got {tuple(weight.shape)}")
    n, k = weight.shape
    q, scale = _block_quantize(weight.detach())
    packed = panel_layout.pack((q + 128).to(torch.uint8), QUAD)  # padding: never stored
    if panel_layout.padded(n) != n:
        scale = torch.cat([scale, scale.new_zeros(panel_layout.padded(n) - n, k // BLOCK)])
    scales = scale.view(-1, PANEL, k // BLOCK).permute(0, 2, 1)
    return Q8Weight(packed, scales.contiguous(), n, k)


def stack(weights: Sequence[Q8Weight]) -> Optional[Q8Weight]:
    """Weights sharing an input as one, by output columns (q, k, v or gate, up); None where
    one's columns do not fill its last panel (the stacked columns would not be contiguous)."""
    k = weights[0].in_features
    if any(w.in_features != k or w.out_features % PANEL for w in weights):
        return None
    return Q8Weight(
        torch.cat([w.packed for w in weights]),
        torch.cat([w.scales for w in weights]),
        sum(w.out_features for w in weights),
        k,
    )


def product(
    weight: Q8Weight, x: torch.Tensor, bias: Optional[torch.Tensor], kernel: bool
) -> torch.Tensor:
    """``x`` ``[M, K]`` float32 times the weight: ``[M, N]`` float32. ``kernel``: the compiled
    kernel is loaded (else the same arithmetic in torch, slowly)."""
    if x.dtype != torch.float32:
        x = x.float()
    if x.stride(-1) != 1:
        x = x.contiguous()
    if kernel:
        return torch.ops.slipstream_cpu.q8_gemm(
            x, weight.packed, weight.scales, weight.out_features, bias
        )
    return _torch_product(weight, x, bias)


def _torch_product(weight: Q8Weight, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The kernel's arithmetic in torch: the blocks' integer sums (exact in float32, at most
    32 x 127 x 127), each scaled by both operands' block scales, summed over the blocks."""
    qa, sa = _block_quantize(x)
    qw, sw = weight.columns(torch.arange(weight.out_features))
    rows, blocks = x.shape[0], x.shape[1] // BLOCK
    a = qa.float().view(rows, blocks, BLOCK).transpose(0, 1)  # [B, M, 32]
    w = qw.view(-1, blocks, BLOCK).permute(1, 2, 0)  # [B, 32, N]
    sums = torch.bmm(a, w)  # [B, M, N]
    y = (sums * sa.t()[..., None] * sw.t()[:, None, :]).sum(0)
    return y if bias is None else y + bias
