"""GPTQ checkpoints in Hugging Face format (``quant_method: gptq``, 4 bits) as 4-bit weights
(``int4``), without widening a weight.

A linear layer ``[N, K]`` ships ``qweight`` int32 ``[K/8, N]`` (eight consecutive input
channels per int32, channel ``8i + j`` at nibble ``j``), ``qzeros`` int32 ``[G, N/8]`` (eight
output columns per int32, in order), ``scales`` float16 ``[G, N]`` and ``g_idx`` int32 ``[K]``
(each input channel's group): ``w[n, k] = s[g, n] * (q[k, n] - z[g, n])``, ``g = g_idx[k]``.
GPTQ's own format (``checkpoint_format: gptq``, AutoGPTQ) stores each zero less one; v2
(``gptq_v2``) stores it as it is. As ``int4``'s ``d * q + m``: ``d = s``, ``m = -s * z``
(float32, exact). An act-order checkpoint (``desc_act``) numbers its groups out of channel
order: the channels are sorted by group (``Int4Weight.perm``), the activations read that way.
"""

from __future__ import annotations

from typing import Optional

import torch

from slipstream.worker.layers.quantization import int4

PACK = 8  # 4-bit values per int32


def unpack(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 with eight 4-bit values along ``dim`` (value ``j`` at nibble ``j``) -> uint8,
    that dimension eight times longer."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    if dim == 0:  # [R/8, C] -> [R, C]
        values = (packed.to(torch.int32)[:, None, :] >> shifts[None, :, None]) & 15
        return values.reshape(-1, packed.shape[1]).to(torch.uint8)
    values = (packed.to(torch.int32)[:, :, None] >> shifts) & 15  # [R, C/8] -> [R, C]
    return values.reshape(packed.shape[0], -1).to(torch.uint8)


def weight(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: Optional[torch.Tensor],
    group: int,
    zero_offset: int = 1,
) -> int4.Int4Weight:
    """One layer's GPTQ tensors as a 4-bit weight ``[N, K]``; ``zero_offset``: added to each
    stored zero (1 for GPTQ's own format, 0 for v2)."""
    q = unpack(qweight, 0).t().contiguous()  # [N, K]
    n, k = q.shape
    if group <= 0:
        group = k
    z = unpack(qzeros, 1)[:, :n].t().float() + zero_offset  # [N, G]
    s = scales.t().float()  # [N, G]
    groups = k // group
    if s.shape != (n, groups) or z.shape != s.shape or k % group:
        raise ValueError(
            f"GPTQ tensors disagree: qweight {tuple(qweight.shape)}, qzeros "
            f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)}, group {group}"
        )
    perm = None
    if g_idx is not None and not torch.equal(
        g_idx.to(torch.int64), torch.arange(k, dtype=torch.int64) // group
    ):
        g = g_idx.to(torch.int64)
        if g.shape != (k,) or not torch.equal(
            torch.bincount(g, minlength=groups), torch.full((groups,), group)
        ):
            raise ValueError("GPTQ g_idx must give every group exactly group_size channels")
        perm = torch.sort(g, stable=True).indices
        q = q[:, perm].contiguous()
    return int4.pack(q, s.contiguous(), (-(s * z)).contiguous(), group, perm)
