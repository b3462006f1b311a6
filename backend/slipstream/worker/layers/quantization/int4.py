"""A 4-bit weight as ``kernels/csrc/cpu_q4_gemm.cpp`` reads it, whatever checkpoint it came from
(GGUF
Q4_0 / Q4_1 / Q4_K, AWQ, GPTQ: ``gguf``, ``awq``, ``gptq`` beside this file turn each into
this form without widening a weight), and its products with int8 activations.

A weight ``[N, K]`` is ``w = d * q + m`` with ``q`` in 0..15 and ``d``, ``m`` per output
column and group of ``G`` input channels (32 for GGUF's blocks, AWQ / GPTQ's group size);
``d`` and ``m`` are float16 where the checkpoint's values are (Q4_0, Q4_1), float32 where they
are products of its values (Q4_K's super-block scale times a block's, AWQ / GPTQ's ``-s * z``),
so that every weight is the checkpoint's value exactly. The nibbles are the only resident copy
of the weight: a tied input embedding looks its rows up in them (``rows``).

A few outlier input channels (``int8_outliers``) can be left out of the activations' int8
blocks; their weight columns (the blocks' own values, in float32) are added apart, as for
int8. GPTQ's act-order checkpoints (``desc_act``) order K by group: ``perm`` says which input
channel each of the kernel's channels reads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from slipstream.worker import kernels
from slipstream.worker.layers.quantization import panel_layout
from slipstream.worker.layers.quantization.int8 import block_quantize, kernel_rows
from slipstream.worker.layers.quantization.panel_layout import LANES, PANEL

BLOCK = 32  # K per block of nibbles (and per activation scale)
LEVELS = 16


@dataclass(frozen=True)
class Int4Weight:
    packed: torch.Tensor  # uint8 [N/32, K/32, 4, 2, 16, 4] (the kernel's header says how)
    scales: torch.Tensor  # float16 or float32 [N/32, K/G, 2, 32]: d, then m
    group: int  # G
    out_features: int  # N (the packed tensors are padded to a multiple of 32)
    in_features: int  # K
    # input channels (of the kernel's K) left out of the activations' blocks, int64 [k], and
    # the weight's values there, float32 [N/32, k, 32]
    outliers: Optional[torch.Tensor] = None
    outlier_w: Optional[torch.Tensor] = None
    perm: Optional[torch.Tensor] = None  # int64 [K]: kernel channel j reads input perm[j]

    @property
    def nbytes(self) -> int:
        extra = self.outlier_w.nbytes if self.outlier_w is not None else 0
        return self.packed.nbytes + self.scales.nbytes + extra

    def codes(self, ids: torch.Tensor) -> torch.Tensor:
        """Output columns ``ids`` ``[T]``: their ``q`` (0..15) as uint8 ``[T, K]``, in the
        kernel's channel order."""
        panel, col = ids // PANEL, ids % PANEL
        raw = self.packed[panel, :, :, col // LANES, col % LANES, :]  # [T, K/32, 4, 4]
        halves = torch.stack([raw & 15, raw >> 4], dim=2)  # [T, K/32, 2, 4, 4]
        return halves.reshape(ids.shape[0], self.in_features)

    def affine(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``d`` and ``m`` of output columns ``ids``, float32 ``[T, K/G]`` each."""
        panel, col = ids // PANEL, ids % PANEL
        found = self.scales[panel, :, :, col].float()  # [T, K/G, 2]
        return found[..., 0], found[..., 1]

    def columns(self, ids: torch.Tensor) -> torch.Tensor:
        """Output columns ``ids`` dequantized, float32 ``[T, K]`` in the kernel's order."""
        q = self.codes(ids).float().view(ids.shape[0], -1, self.group)
        d, m = self.affine(ids)
        return (q * d[..., None] + m[..., None]).view(ids.shape[0], self.in_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the dequantized weight in the input's channel order, float32
        ``[*ids.shape, K]`` (a tied embedding's lookups)."""
        flat = ids.reshape(-1)
        if kernels.load():  # the compiled reader: the same values
            found = torch.ops.slipstream_cpu.q4_rows(
                self.packed,
                self.scales,
                self.group,
                self.out_features,
                self.in_features,
                flat.to(torch.int64).contiguous(),
                self.perm,
            )
            return found.reshape(*ids.shape, self.in_features)
        values = self.columns(flat)
        if self.perm is not None:
            values = torch.empty_like(values).index_copy_(1, self.perm, values)
        return values.reshape(*ids.shape, self.in_features)

    def dequantized(self) -> torch.Tensor:
        """The whole weight in float32 ``[N, K]``, input channel order (tests, references)."""
        return self.rows(torch.arange(self.out_features))

    def with_outliers(self, channels: torch.Tensor) -> "Int4Weight":
        """The same weight with input ``channels`` (int64, input order) multiplied apart in
        float32; their values stay in the blocks too (the activations there are zero)."""
        if channels.numel() == 0:
            return replace(self, outliers=None, outlier_w=None)
        kernel_channels = channels.to(torch.int64)
        if self.perm is not None:  # the kernel channel that reads each input channel
            inverse = torch.empty_like(self.perm).index_copy_(
                0, self.perm, torch.arange(self.in_features)
            )
            kernel_channels = inverse[kernel_channels]
        kernel_channels = kernel_channels.sort().values.contiguous()
        values = self.columns(torch.arange(self.out_features))[:, kernel_channels]
        return replace(self, outliers=kernel_channels, outlier_w=panel_layout.per_column(values))


def supports(out_features: int, in_features: int, group: int) -> bool:
    return (
        out_features > 0
        and in_features > 0
        and group > 0
        and group % BLOCK == 0
        and in_features % group == 0
    )


def pack(
    q: torch.Tensor,
    d: torch.Tensor,
    m: torch.Tensor,
    group: int,
    perm: Optional[torch.Tensor] = None,
) -> Int4Weight:
    """``q`` uint8 ``[N, K]`` (0..15) with ``d``, ``m`` ``[N, K/G]`` (float16 or float32,
    both the same) in the kernel's layout; ``perm``: see ``Int4Weight.perm``."""
    n, k = q.shape
    if not supports(n, k, group):
        raise ValueError(
            f"4-bit groups need K a multiple of the group and the group a multiple of {BLOCK}, "
            f"got {tuple(q.shape)} with group {group}"
        )
    if d.shape != (n, k // group) or m.shape != d.shape or d.dtype != m.dtype:
        raise ValueError(f"d and m must both be [{n}, {k // group}] of one dtype")
    if d.dtype not in (torch.float16, torch.float32):
        raise ValueError(f"d and m must be float16 or float32, got {d.dtype}")
    padded = panel_layout.padded(n)
    q = q.to(torch.uint8)
    if padded != n:
        q = torch.cat([q, q.new_zeros(padded - n, k)])
    # k = b*32 + half*16 + 4j + i  ->  byte [P, b, j, c, l, i] = low | high << 4
    cells = q.view(padded // PANEL, 2, LANES, k // BLOCK, 2, 4, 4)
    nibbles = cells[:, :, :, :, 0] | (cells[:, :, :, :, 1] << 4)  # [P, c, l, b, j, i]
    packed = nibbles.permute(0, 3, 4, 1, 2, 5).contiguous()
    scales = torch.stack(
        [panel_layout.per_column(d), panel_layout.per_column(m)], dim=2
    ).contiguous()  # [P, K/G, 2, 32]
    if perm is not None:
        perm = perm.to(torch.int64).contiguous()
    return Int4Weight(packed, scales, group, n, k, perm=perm)


def stack(weights: Sequence[Int4Weight]) -> Optional[Int4Weight]:
    """Weights sharing an input as one, by output columns (q, k, v or gate, up); None where
    one's columns do not fill its last panel or the layouts differ."""
    first = weights[0]
    k, group, dtype = first.in_features, first.group, first.scales.dtype
    if any(
        w.in_features != k
        or w.group != group
        or w.scales.dtype != dtype
        or w.out_features % PANEL
        or not panel_layout.same(w.outliers, first.outliers)
        or not panel_layout.same(w.perm, first.perm)
        for w in weights
    ):
        return None
    outlier_w = None
    if first.outliers is not None:
        outlier_w = torch.cat([w.outlier_w for w in weights if w.outlier_w is not None])
    return Int4Weight(
        torch.cat([w.packed for w in weights]),
        torch.cat([w.scales for w in weights]),
        group,
        sum(w.out_features for w in weights),
        k,
        first.outliers,
        outlier_w,
        first.perm,
    )


def product(
    weight: Int4Weight, x: torch.Tensor, bias: Optional[torch.Tensor], kernel: bool
) -> torch.Tensor:
    """As ``int8.product``, for the 4-bit weight."""
    x = kernel_rows(x)
    if not kernel:
        return torch_product(weight, x, bias)
    return torch.ops.slipstream_cpu.q4_gemm(
        x,
        weight.packed,
        weight.scales,
        weight.group,
        weight.out_features,
        bias,
        weight.outliers,
        weight.outlier_w,
        weight.perm,
    )


def torch_product(
    weight: Int4Weight, x: torch.Tensor, bias: Optional[torch.Tensor], dtype=torch.float32
) -> torch.Tensor:
    """The kernel's arithmetic in torch (in ``dtype``): the activations in int8 blocks, each
    block's integer sums scaled by its activation scale, each group's by ``d``, plus
    ``m`` times the group's activation sums."""
    if weight.perm is not None:
        x = x[:, weight.perm]
    idx = weight.outliers
    blocked = x if idx is None else x.index_fill(1, idx, 0.0)
    qa, sa = block_quantize(blocked)
    rows, blocks = x.shape[0], x.shape[1] // BLOCK
    ids = torch.arange(weight.out_features)
    qw = weight.codes(ids).to(dtype).view(-1, blocks, BLOCK).permute(1, 2, 0)  # [B, 32, N]
    a = qa.to(dtype).view(rows, blocks, BLOCK).transpose(0, 1)  # [B, M, 32]
    sums = torch.bmm(a, qw) * sa.t().to(dtype)[..., None]  # [B, M, N]
    a_sums = a.sum(-1) * sa.t().to(dtype)  # [B, M]
    per_group = weight.group // BLOCK
    t = sums.view(-1, per_group, rows, weight.out_features).sum(1)  # [Gs, M, N]
    s = a_sums.view(-1, per_group, rows).sum(1)  # [Gs, M]
    d, m = weight.affine(ids)  # [N, Gs]
    y = (t * d.t().to(dtype)[:, None, :] + s[..., None] * m.t().to(dtype)[:, None, :]).sum(0)
    if idx is not None and weight.outlier_w is not None:
        n = weight.out_features
        columns = weight.outlier_w.permute(0, 2, 1).reshape(-1, idx.numel())[:n]  # [N, k]
        y = y + x[:, idx].to(dtype) @ columns.t().to(dtype)
    return y if bias is None else y + bias.to(dtype)
