"""An int8 weight in blocks of 32 (``quantization=int8``), packed as
``kernels/csrc/cpu_q8_gemm.cpp``
reads it, and its products with int8 activations quantized the same way.

A weight ``[N, K]`` is quantized symmetrically per output column and block of 32 along K
(``scale = max|w| / 127``), as llama.cpp's Q8_0; each product quantizes its input rows the
same way per block and sums the blocks' integer products exactly before scaling them
(the kernel's header says how). A few outlier input channels (``int8_outliers``
finds them at load) stay out of the blocks: their weight columns are kept exactly in float32
and the kernel adds their products apart. The packed layout is the only resident copy of the
weight: a tied input embedding looks its rows up in it (``rows``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from slipstream.worker import kernels
from slipstream.worker.layers.quantization import panel_layout
from slipstream.worker.layers.quantization.panel_layout import PANEL

BLOCK = 32  # K per scale
QUAD = 4  # consecutive k per lane (vpdpbusd sums four products)


@dataclass(frozen=True)
class Q8Weight:
    packed: torch.Tensor  # uint8 [N/32, K/4, 2, 16, 4]: q + 128
    scales: torch.Tensor  # float32 [N/32, K/32, 32]
    out_features: int  # N (the packed tensors are padded to a multiple of 32)
    in_features: int  # K
    # input channels left out of the blocks (int64 [k]; their columns zero in `packed`) and
    # their weight columns as they are, float32 [N/32, k, 32]
    outliers: Optional[torch.Tensor] = None
    outlier_w: Optional[torch.Tensor] = None

    @property
    def nbytes(self) -> int:
        extra = self.outlier_w.nbytes if self.outlier_w is not None else 0
        return self.packed.nbytes + self.scales.nbytes + extra

    def columns(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Output columns ``ids`` ``[T]`` as stored: ``q`` float32 ``[T, K]`` (-127..127) and
        their block scales ``[T, K/32]``."""
        q = panel_layout.columns(self.packed, ids).float().sub_(128)
        return q, self.scales[ids // PANEL, :, ids % PANEL]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the dequantized weight, float32 ``[*ids.shape, K]`` (the lookups of
        a tied embedding; the compiled reader where the kernels are loaded, same values)."""
        flat = ids.reshape(-1)
        if kernels.load():
            found = torch.ops.slipstream_cpu.q8_rows(
                self.packed,
                self.scales,
                self.out_features,
                self.in_features,
                flat.to(torch.int64).contiguous(),
                self.outliers,
                self.outlier_w,
            )
            return found.reshape(*ids.shape, self.in_features)
        q, scale = self.columns(flat)
        values = q.view(-1, self.in_features // BLOCK, BLOCK).mul_(scale[..., None])
        values = values.view(-1, self.in_features)
        if self.outliers is not None and self.outlier_w is not None:
            values[:, self.outliers] = self.outlier_w[flat // PANEL, :, flat % PANEL]
        return values.reshape(*ids.shape, self.in_features)

    def dequantized(self) -> torch.Tensor:
        """The whole weight in float32 ``[N, K]`` (tests)."""
        return self.rows(torch.arange(self.out_features))

    def with_outliers(self, channels: torch.Tensor) -> "Q8Weight":
        """Blocks loaded as they were shipped (``from_blocks``) with input ``channels``
        multiplied apart in float32: their values stay in the blocks (the activations there
        are zero), and their columns, the blocks' own values, are kept beside them."""
        if channels.numel() == 0:
            return replace(self, outliers=None, outlier_w=None)
        channels = channels.to(torch.int64).sort().values.contiguous()
        q, scale = self.columns(torch.arange(self.out_features))
        values = q[:, channels] * scale[:, channels // BLOCK]
        return replace(self, outliers=channels, outlier_w=panel_layout.per_column(values))


def supports(weight: torch.Tensor) -> bool:
    """The layout needs K in whole blocks."""
    return weight.dim() == 2 and weight.shape[1] % BLOCK == 0 and weight.shape[1] > 0


def block_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per block of 32 along the last dim: ``x ~= q * scale`` per block.
    ``q`` int16 ``[..., K]``, ``scale`` float32 ``[..., K/32]``. Rounds as the kernel does
    (``x * (127 / amax)``, ties to even)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK)
    amax = blocks.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv[..., None]).clamp_(-127, 127).to(torch.int16)
    return q.reshape(x.shape), amax / 127.0


def quantize(weight: torch.Tensor, outliers: Optional[torch.Tensor] = None) -> Q8Weight:
    """``weight`` ``[N, K]`` (any float dtype) packed for ``cpu_q8_gemm``; ``outliers``: input
    channels kept out of the blocks (their columns exact, in float32)."""
    if not supports(weight):
        raise ValueError(f"int8 blocks need K a multiple of {BLOCK}, got {tuple(weight.shape)}")
    n, k = weight.shape
    weight = weight.detach().float()
    outlier_w = None
    if outliers is not None and outliers.numel():
        outliers = outliers.to(torch.int64).contiguous()
        columns = weight[:, outliers]  # [N, k]
        outlier_w = panel_layout.per_column(columns)
        weight = weight.index_fill(1, outliers, 0.0)
    else:
        outliers = None
    q, scale = block_quantize(weight)
    packed = panel_layout.pack((q + 128).to(torch.uint8), QUAD)  # padding: never stored
    return Q8Weight(packed, panel_layout.per_column(scale), n, k, outliers, outlier_w)


def from_blocks(q: torch.Tensor, scale: torch.Tensor) -> Q8Weight:
    """Blocks as a checkpoint ships them (GGUF's Q8_0): ``q`` int8 ``[N, K]`` and ``scale``
    ``[N, K/32]`` (float16 or float32, held as float32: exact), packed as they are."""
    n, k = q.shape
    if k % BLOCK or scale.shape != (n, k // BLOCK):
        raise ValueError(f"int8 blocks need K a multiple of {BLOCK}, got {tuple(q.shape)}")
    shifted = (q.to(torch.int16) + 128).to(torch.uint8)
    packed = panel_layout.pack(shifted, QUAD)
    return Q8Weight(packed, panel_layout.per_column(scale.float()), n, k)


def stack(weights: Sequence[Q8Weight]) -> Optional[Q8Weight]:
    """Weights sharing an input as one, by output columns (q, k, v or gate, up); None where
    one's columns do not fill its last panel (the stacked columns would not be contiguous)."""
    k, first = weights[0].in_features, weights[0].outliers
    if any(w.in_features != k or w.out_features % PANEL for w in weights):
        return None
    if any(not panel_layout.same(w.outliers, first) for w in weights):
        return None  # one input, one set of outlier channels
    outlier_w = None
    if first is not None:
        outlier_w = torch.cat([w.outlier_w for w in weights if w.outlier_w is not None])
    return Q8Weight(
        torch.cat([w.packed for w in weights]),
        torch.cat([w.scales for w in weights]),
        sum(w.out_features for w in weights),
        k,
        first,
        outlier_w,
    )


def kernel_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the compiled block-quantized gemms read it (float32, rows of unit stride); the
    torch fallbacks take the same, so both paths see the same values."""
    if x.dtype != torch.float32:
        x = x.float()
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x


def product(
    weight: Q8Weight, x: torch.Tensor, bias: Optional[torch.Tensor], kernel: bool
) -> torch.Tensor:
    """``x`` ``[M, K]`` float32 times the weight: ``[M, N]`` float32. ``kernel``: the compiled
    kernel is loaded (else the same arithmetic in torch, slowly)."""
    x = kernel_rows(x)
    if kernel:
        return torch.ops.slipstream_cpu.q8_gemm(
            x,
            weight.packed,
            weight.scales,
            weight.out_features,
            bias,
            weight.outliers,
            weight.outlier_w,
        )
    return _torch_product(weight, x, bias)


def _torch_product(weight: Q8Weight, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The kernel's arithmetic in torch: the blocks' integer sums (exact in float32, at most
    32 x 127 x 127), each scaled by both operands' block scales, summed over the blocks."""
    idx = weight.outliers
    blocked = x if idx is None else x.index_fill(1, idx, 0.0)
    qa, sa = block_quantize(blocked)
    qw, sw = weight.columns(torch.arange(weight.out_features))
    rows, blocks = x.shape[0], x.shape[1] // BLOCK
    a = qa.float().view(rows, blocks, BLOCK).transpose(0, 1)  # [B, M, 32]
    w = qw.view(-1, blocks, BLOCK).permute(1, 2, 0)  # [B, 32, N]
    sums = torch.bmm(a, w)  # [B, M, N]
    y = (sums * sa.t()[..., None] * sw.t()[:, None, :]).sum(0)
    if idx is not None and weight.outlier_w is not None:
        n = weight.out_features
        columns = weight.outlier_w.permute(0, 2, 1).reshape(-1, idx.numel())[:n]  # [N, k]
        y = y + x[:, idx] @ columns.t()
    return y if bias is None else y + bias
