"""GGUF's quantized blocks as the CPU kernels read them, without widening a weight:
Q4_0, Q4_1 and Q4_K as 4-bit weights (``int4``), Q8_0 as int8 blocks (``int8``).

A GGUF tensor of a linear layer ``[N, K]`` is N rows of blocks along K (ggml's order):

* Q4_0 (18 bytes / 32 weights): float16 ``d``, 16 bytes of nibbles; ``w = d * (q - 8)``.
* Q4_1 (20 bytes / 32): float16 ``d`` and ``m``, 16 bytes of nibbles; ``w = d * q + m``.
* Q4_K (144 bytes / 256): float16 ``d`` and ``dmin``, 12 bytes of 6-bit scales and mins for
  its eight blocks of 32, 128 bytes of nibbles; ``w = (d * scale) * q - dmin * min``.
* Q8_0 (34 bytes / 32): float16 ``d``, 32 int8; ``w = d * q``.

In a Q4_0 / Q4_1 block the low nibbles are its first 16 values and the high ones its last 16,
the order the 4-bit kernel reads; Q4_K stores two blocks of 32 in the low and high nibbles of
32 bytes, repacked here. ``d`` and ``m`` stay float16 where they are the file's values, and are
float32 where they are products of them (Q4_K's), so every weight is the file's value exactly.
Other types (F32, F16, BF16, Q5 / Q6_K ...) are not read here (``read`` returns None).
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import numpy as np
import torch

from slipstream.worker.layers.quantization import int4, int8

BLOCK = 32
SUPER_BLOCK = 256  # Q4_K
# ggml type name -> (values per block, bytes per block)
LAYOUTS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144), "Q8_0": (32, 34)}

Layout = Union[int4.Int4Weight, int8.Q8Weight]


def supported(type_name: str) -> bool:
    return type_name in LAYOUTS


def _blocks(data: np.ndarray, n: int, k: int, type_name: str) -> torch.Tensor:
    """The tensor's bytes as ``[N, blocks per row, bytes per block]`` uint8 (a copy of the
    file's bytes: the reader's memory map goes with the reader)."""
    values, size = LAYOUTS[type_name]
    if k % values:
        raise ValueError(f"{type_name} rows of {k} values are not whole blocks of {values}")
    raw = torch.from_numpy(np.array(data, dtype=np.uint8, copy=True)).reshape(-1)
    if raw.numel() != n * (k // values) * size:
        raise ValueError(f"{type_name} tensor of {raw.numel()} bytes is not [{n}, {k}]")
    return raw.view(n, k // values, size)


def _half(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at byte ``offset`` of every block: ``[N, blocks]``."""
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16)[..., 0]


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes a block -> 32 values (low nibbles first): ``[N, blocks, 32]`` uint8."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def q4_0(blocks: torch.Tensor) -> int4.Int4Weight:
    n, nb, _ = blocks.shape
    d = _half(blocks, 0)
    q = _nibbles(blocks[..., 2:18]).reshape(n, nb * BLOCK)
    return int4.pack(q, d, d * -8, BLOCK)  # -8 d: exact in float16


def q4_1(blocks: torch.Tensor) -> int4.Int4Weight:
    n, nb, _ = blocks.shape
    q = _nibbles(blocks[..., 4:20]).reshape(n, nb * BLOCK)
    return int4.pack(q, _half(blocks, 0), _half(blocks, 2), BLOCK)


def q4_k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins of each super-block from its 12 bytes: ``[..., 8]``
    each (bytes 0-3: scales 0-3 and the top bits of scales 4-7; 4-7: mins 0-3 and the top
    bits of mins 4-7; 8-11: the low bits of scales and mins 4-7)."""
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mins = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return scales, mins


def q4_k(blocks: torch.Tensor) -> int4.Int4Weight:
    n, nsb, _ = blocks.shape
    d, dmin = _half(blocks, 0).float(), _half(blocks, 2).float()
    scales, mins = q4_k_scales(blocks[..., 4:16])
    # 128 bytes: four runs of 32, each two blocks of 32 (low nibbles, then high)
    qs = blocks[..., 16:144].reshape(n, nsb, 4, 1, 32)
    q = torch.cat([qs & 15, qs >> 4], dim=3).reshape(n, nsb * SUPER_BLOCK)
    scale = (d[..., None] * scales.float()).reshape(n, -1)  # exact: 11 x 6 bits
    offset = -(dmin[..., None] * mins.float()).reshape(n, -1)
    return int4.pack(q, scale, offset, BLOCK)


def q8_0(blocks: torch.Tensor) -> int8.Q8Weight:
    n, nb, _ = blocks.shape
    q = blocks[..., 2:34].contiguous().view(torch.int8).reshape(n, nb * BLOCK)
    return int8.from_blocks(q, _half(blocks, 0))


_READERS: dict[str, Callable[[torch.Tensor], Layout]] = {
    "Q4_0": q4_0,
    "Q4_1": q4_1,
    "Q4_K": q4_k,
    "Q8_0": q8_0,
}


def read(
    data: np.ndarray, type_name: str, n: int, k: int, rows: Optional[torch.Tensor] = None
) -> Optional[Layout]:
    """A GGUF tensor's blocks (``data``: its bytes, ``type_name``: ggml's type) of a weight
    ``[N, K]`` in the kernels' layout, its rows reordered by ``rows`` where given (llama.cpp
    stores q and k with their rotary halves interleaved); None for a type not read here."""
    reader = _READERS.get(type_name)
    if reader is None:
        return None
    blocks = _blocks(data, n, k, type_name)
    if rows is not None:
        blocks = blocks[rows]
    return reader(blocks)
