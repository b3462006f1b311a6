"""The GPU check's kernel part: the device's copy bandwidth (the roofline's), and paged decode
attention's bytes per second against it, batch by context.

Times on CUDA come from ``triton.testing.do_bench`` (median; the L2 cache is flushed between
repetitions, so a small working set is not served from L2); on CPU (``--smoke``) from the best
of a few wall-clock runs.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch


def seconds(fn: Callable[[], object], device: torch.device, repeat: int = 3) -> float:
    """One call's time: do_bench's median on CUDA, the best of ``repeat`` on CPU."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") / 1e3
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy (read + write) of ``nbytes``."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    t = seconds(lambda: dst.copy_(src), device)
    return 2 * src.numel() * src.element_size() / t


@dataclass
class DecodeRow:
    shape: str
    batch: int
    context: int
    microseconds: float
    gb_per_s: float
    share_of_copy: float

    def row(self) -> dict:
        return asdict(self)


def decode_attention_sweep(
    device: torch.device,
    shape: str,
    heads: int,
    kv_heads: int,
    head_dim: int,
    batches: list[int],
    contexts: list[int],
    copy_bw: float,
    max_cache_bytes: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
) -> list[DecodeRow]:
    """Decode attention over every (batch, context) whose K and V fit ``max_cache_bytes``: one
    cache for the largest, each case's sequences on their own shuffled pages of it."""
    from slipstream.worker.attention import triton_backend as tk
    from slipstream.worker.attention.layer import AttentionLayer

    itemsize = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * kv_heads * head_dim * itemsize
    cases = [(b, c) for b in batches for c in contexts if b * c * per_token <= max_cache_bytes]
    if not cases:
        return []
    most = max(b * -(-c // block_size) for b, c in cases)
    shape_kv = (most + 1, block_size, kv_heads, head_dim)
    key_cache = torch.randn(shape_kv, dtype=dtype, device=device)
    value_cache = torch.randn(shape_kv, dtype=dtype, device=device)
    layer = AttentionLayer(key_cache, value_cache, head_dim**-0.5)
    rows = []
    for batch, context in cases:
        pages = -(-context // block_size)
        order = torch.randperm(most, device=device)[: batch * pages] + 1
        tables = order.view(batch, pages).to(torch.int32)
        lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
        query = torch.randn(batch, heads, head_dim, dtype=dtype, device=device)

        def call() -> None:
            tk.paged_decode_attention(query, layer, tables, lengths)

        t = seconds(call, device)
        nbytes = batch * context * per_token + 2 * query.numel() * itemsize
        rows.append(
            DecodeRow(shape, batch, context, t * 1e6, nbytes / t / 1e9, nbytes / t / copy_bw)
        )
    return rows
