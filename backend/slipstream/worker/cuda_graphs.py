"""CUDA graphs for decode steps.

A decode step of a small model is dominated by kernel-launch overhead (30 layers x a dozen
kernels). ``DecodeGraphRunner`` captures the whole decode forward once per batch-size bucket
(1, 2, 4, 8, ...) on static input buffers, pads a real batch up to the next bucket, replays,
and slices the logits.

Padding rows are inert: ``slot_mapping`` -1 (``store_kv`` writes nothing), ``seq_len`` 1 and a
block-table row of -1 (the Triton decode kernel masks pages with id -1 and returns 0 for a row
with no key left, so no NaN), token id 0 at position 0.

The wrapped ``forward(input_ids[B], positions[B], slot_mapping[B], block_tables[B, maxb],
seq_lens[B]) -> logits[B, V]`` must be capturable: no host synchronisation (no ``.item()``,
``.tolist()``, ``int(tensor)``), no data-dependent shapes, everything it reads that changes
between steps passed through these five tensors (or living at fixed addresses, like the KV
cache). The Triton backend's (``attention/triton_backend``) decode path qualifies; the
torch reference does not (it reads ``seq_lens.max()``), and capture then fails and the runner falls
back to eager with a warning.

Only the padding and bucket logic runs on CPU (tested); capture and replay need a GPU.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from slipstream.startup_log import Phase, PhaseProgress, phase

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)

PAD_TOKEN = 0
PAD_POSITION = 0
PAD_SLOT = -1
PAD_SEQ_LEN = 1
PAD_BLOCK = -1


def capture_sizes(max_batch_size: int, batch_sizes: Optional[Iterable[int]] = None) -> list[int]:
    """The sorted buckets to capture: ``batch_sizes`` (default powers of two) capped at
    ``max_batch_size``; ``max_batch_size`` itself is added when it is not a bucket, so every
    batch up to it has a graph."""
    if max_batch_size <= 0:
        return []
    if batch_sizes is None:
        batch_sizes = []
        s = 1
        while s < max_batch_size:
            batch_sizes.append(s)
            s *= 2
    sizes = sorted({int(s) for s in batch_sizes if 0 < int(s) <= max_batch_size})
    if not sizes or sizes[-1] < max_batch_size:
        sizes.append(int(max_batch_size))
    return sizes


def bucket_for(n: int, sizes: Sequence[int]) -> Optional[int]:
    """The smallest captured size holding ``n`` rows, or None (run eagerly)."""
    if n <= 0:
        return None
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class StaticDecodeInputs:
    """The fixed-address input buffers a captured graph reads, and how a batch is loaded
    into them (device-agnostic, so the padding logic is testable on CPU)."""

    def __init__(
        self, max_batch_size: int, max_blocks_per_seq: int, device: torch.device | str = "cpu"
    ):
        n, w = max_batch_size, max_blocks_per_seq
        self.max_batch_size, self.max_blocks_per_seq = n, w
        self.input_ids = torch.full((n,), PAD_TOKEN, dtype=torch.long, device=device)
        self.positions = torch.full((n,), PAD_POSITION, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), PAD_SLOT, dtype=torch.long, device=device)
        self.block_tables = torch.full((n, w), PAD_BLOCK, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((n,), PAD_SEQ_LEN, dtype=torch.int32, device=device)

    def view(self, size: int) -> tuple:
        """The first ``size`` rows of every buffer (views: same addresses on every call)."""
        return (
            self.input_ids[:size],
            self.positions[:size],
            self.slot_mapping[:size],
            self.block_tables[:size],
            self.seq_lens[:size],
        )

    def fits(self, n: int, width: int) -> bool:
        return n <= self.max_batch_size and width <= self.max_blocks_per_seq

    def load(
        self,
        size: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> None:
        """Copy the ``n`` real rows in and make rows ``n:size`` inert padding. Rows past
        ``size`` are not read by the ``size`` graph and are left alone."""
        n, width = input_ids.shape[0], block_tables.shape[1]
        if n > size or not self.fits(size, width):
            raise ValueError(f"batch of {n} rows x {width} blocks does not fit bucket {size}")
        nb = dict(non_blocking=True)
        self.input_ids[:n].copy_(input_ids, **nb)
        self.positions[:n].copy_(positions, **nb)
        self.slot_mapping[:n].copy_(slot_mapping, **nb)
        self.block_tables[:n, :width].copy_(block_tables, **nb)
        self.block_tables[:n, width:].fill_(PAD_BLOCK)
        self.seq_lens[:n].copy_(seq_lens, **nb)
        self.pad(n, size)

    def pad(self, start: int, stop: int) -> None:
        self.input_ids[start:stop].fill_(PAD_TOKEN)
        self.positions[start:stop].fill_(PAD_POSITION)
        self.slot_mapping[start:stop].fill_(PAD_SLOT)
        self.block_tables[start:stop].fill_(PAD_BLOCK)
        self.seq_lens[start:stop].fill_(PAD_SEQ_LEN)


class DecodeGraphRunner:
    """Capture ``forward`` per batch-size bucket; replay padded batches; else run eagerly.

    The returned logits of a replay are a view of the graph's static output: the next call
    overwrites them, so consume (or clone) them first.
    """

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        max_batch_size: int,
        max_blocks_per_seq: int,
        device: torch.device | str,
        batch_sizes: Optional[Iterable[int]] = None,
        enabled: bool = True,
        warmup_iters: int = 2,
    ):
        self.forward = forward
        self.device = torch.device(device)
        self.sizes = capture_sizes(max_batch_size, batch_sizes)
        self.enabled = bool(
            enabled and self.sizes and self.device.type == "cuda" and torch.cuda.is_available()
        )
        self.warmup_iters = warmup_iters
        self.graphs: dict = {}
        self.outputs: dict = {}
        self.inputs = (
            StaticDecodeInputs(self.sizes[-1], max_blocks_per_seq, self.device)
            if self.enabled
            else None
        )

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def capture(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse its memory pool).
        Warm-up runs (Triton JIT compilation, cuBLAS workspaces) happen outside capture on
        all-padding inputs, so neither warm-up nor capture writes the KV cache."""
        if not self.enabled or self.graphs:
            return
        inputs = self.inputs
        assert inputs is not None  # built when enabled
        inputs.pad(0, inputs.max_batch_size)
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=self.device)
        try:
            with phase(Phase.GRAPH_CAPTURE, total=len(self.sizes)) as progress:
                self._capture_all(inputs, pool, side, progress)
            torch.cuda.synchronize(self.device)
        except Exception as exc:  # e.g. a host sync inside forward
            logger.warning("CUDA graph capture failed, decoding eagerly: %s", exc)
            self.graphs.clear()
            self.outputs.clear()
            self.enabled = False

    def _capture_all(self, inputs: Any, pool: Any, side: Any, progress: PhaseProgress) -> None:
        for done, size in enumerate(reversed(self.sizes), 1):
            args = inputs.view(size)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(self.warmup_iters):
                    self.forward(*args)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.forward(*args)
            self.graphs[size] = graph
            self.outputs[size] = out
            progress.step(done)

    def bucket(self, n: int, width: int) -> Optional[int]:
        """The graph that would run a batch of ``n`` rows x ``width`` blocks, or None."""
        inputs = self.inputs  # None only when never enabled
        if not self.enabled or not self.graphs or inputs is None or not inputs.fits(n, width):
            return None
        size = bucket_for(n, self.sizes)
        return size if size in self.graphs else None

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        n = input_ids.shape[0]
        size = self.bucket(n, block_tables.shape[1])
        if size is None:
            return self.forward(input_ids, positions, slot_mapping, block_tables, seq_lens)
        assert self.inputs is not None  # a bucket implies the inputs
        self.inputs.load(size, input_ids, positions, slot_mapping, block_tables, seq_lens)
        self.graphs[size].replay()
        return self.outputs[size][:n]
