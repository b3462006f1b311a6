"""The packed layout the compiled int8 and bf16 products read (``kernels/csrc/cpu_q8_gemm.cpp``,
``kernels/csrc/cpu_bf16_gemm.cpp``): a weight ``[N, K]`` in panels of 32 output columns, two vectors
of 16 lanes, each lane ``group`` consecutive k (4 int8 for vpdpbusd, 2 bf16 for vdpbf16ps): ``[N/32,
K/group, 2, 16, group]``, N padded to 32 with zero columns. A panel's weights are one contiguous run
of memory, read front to back.
"""

from __future__ import annotations

from typing import Optional

import torch

PANEL = 32  # output columns per panel
LANES = 16


def padded(n: int) -> int:
    return -(-n // PANEL) * PANEL


def pack(values: torch.Tensor, group: int) -> torch.Tensor:
    """``values`` ``[N, K]`` in panels (``K % group == 0``), zero columns padding N."""
    n, k = values.shape
    if padded(n) != n:
        values = torch.cat([values, values.new_zeros(padded(n) - n, k)])
    panels = values.view(padded(n) // PANEL, 2, LANES, k // group, group)
    return panels.permute(0, 3, 1, 2, 4).contiguous()


def columns(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Output columns ``ids`` ``[T]`` of a packed weight, as stored: ``[T, K]``."""
    panel, col = ids // PANEL, ids % PANEL
    return packed[panel, :, col // LANES, col % LANES].reshape(ids.shape[0], -1)


def per_column(values: torch.Tensor) -> torch.Tensor:
    """``[N, c]`` values of each output column (scales, outlier columns) as the panels hold
    them, ``[N/32, c, 32]``, zero columns padding N."""
    n, c = values.shape
    if padded(n) != n:
        values = torch.cat([values, values.new_zeros(padded(n) - n, c)])
    return values.view(-1, PANEL, c).permute(0, 2, 1).contiguous()


def same(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    """Both absent, or equal (stacked layouts must share their outliers / permutation)."""
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)
