"""AWQ checkpoints in Hugging Face format (``quant_method: awq``, AutoAWQ's GEMM packing) as
4-bit weights (``int4``), without widening a weight.

A linear layer ``[N, K]`` ships ``qweight`` int32 ``[K, N/8]`` (eight 4-bit values of eight
output columns per int32, in AWQ's interleaved order: the value of column ``8p + j`` sits at
nibble ``REVERSE_ORDER[j]``), ``qzeros`` int32 ``[K/G, N/8]`` packed alike, and ``scales``
float16 ``[K/G, N]``: ``w[n, k] = s[g, n] * (q[k, n] - z[g, n])`` with ``g = k / G``. As
``int4``'s ``d * q + m``: ``d = s`` and ``m = -s * z`` (float32, exact: 11 x 4 bits).
"""

from __future__ import annotations

import torch

from slipstream.worker.layers.quantization import int4

PACK = 8  # 4-bit values per int32
# nibble of output column 8p + j within its int32 (AutoAWQ packs column ORDER[i] at nibble i,
# ORDER = [0, 2, 4, 6, 1, 3, 5, 7]; this is its inverse)
REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, C/8]`` in AWQ's order -> uint8 ``[R, C]`` (0..15), columns in order."""
    shifts = torch.tensor([4 * s for s in REVERSE_ORDER], dtype=torch.int32)
    values = (packed.to(torch.int32)[:, :, None] >> shifts) & 15
    return values.reshape(packed.shape[0], -1).to(torch.uint8)


def weight(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int
) -> int4.Int4Weight:
    """One layer's AWQ tensors as a 4-bit weight ``[N, K]``."""
    k = qweight.shape[0]
    if group <= 0:
        group = k
    q = unpack_columns(qweight).t().contiguous()  # [N, K]
    z = unpack_columns(qzeros).t().float()  # [N, K/G]
    s = scales.t().float()  # [N, K/G]
    if z.shape != s.shape or q.shape[1] != k or s.shape[1] * group != k:
        raise ValueError(
            f"AWQ tensors disagree: qweight {tuple(qweight.shape)}, qzeros "
            f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)}, group {group}"
        )
    return int4.pack(q, s.contiguous(), (-(s * z)).contiguous(), group)
