"""How the model's linear layers multiply on CPU: the weight layout and the GEMM library.

``auto`` (the default) runs every fp32 product, decode rows and prompt chunks alike, on the compiled
kernel (``kernels/csrc/cpu_small_gemm.cpp``) over one packed copy of the weight: at a few rows the
product is bound by reading the weight from memory, which oneDNN does at ~20 GB/s on the AMD EPYC
VMs here against the kernel's ~30; at many rows it is bound by the FMAs, where the kernel's wide
tiles run at oneDNN's speed (0.99-1.02x a decoder layer's time from 128 to 2,048 rows); and at any
row count its threads take work from a shared counter, so one the OS preempts does not hold the
other up (docs/benchmarks.md). A tied LM head's packed copy also serves the embedding's lookups, so
each weight is held once. The kernel's fast paths need AVX-512: elsewhere ``auto`` is ``onednn``.
``onednn`` packs every ``nn.Linear`` weight once into oneDNN's blocked layout and runs the layer
through oneDNN's inner product, as vLLM's CPU backend does; torch's own fp32 ``linear`` calls MKL's
sgemm, which on the AMD EPYC (Zen 4) VMs here ran the model's shapes at 30-130 GFLOP/s against
oneDNN's 110-210, and the 49k-row LM head at a third of oneDNN's speed. ``transposed`` keeps torch's
linear on a column-major copy of the weight (faster than the stock layout for small batches on Intel
Xeons); ``stock`` changes nothing. Outputs differ from the stock layout by float rounding only
(relative 1e-6).
"""

from __future__ import annotations

import enum
import functools
import logging
import threading
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from slipstream.worker import kernels
from slipstream.worker.layers.memory import own_storage, storage_less, tied_embedding

log = logging.getLogger("slipstream")


class CpuLinear(str, enum.Enum):
    AUTO = "auto"
    ONEDNN = "onednn"
    TRANSPOSED = "transposed"
    STOCK = "stock"


# oneDNN picks its blocked weight format for a typical row count; any count works with it.
_PACK_ROWS_HINT = 64
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def kernel_serves_fp32() -> bool:
    """The compiled kernel runs every fp32 product here (``auto``): it has AVX-512, and the
    kernels compile."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and kernels.load()


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def bucketed_rows(rows: int) -> int:
    """The row count a oneDNN product of ``rows`` rows runs at: rounded up to a multiple of
    16, or above 128 of an eighth of its power of two (under 12.5% padding). oneDNN builds
    and caches a primitive per distinct shape, ~0.5 MB each for this model's layers: with
    every prompt length its own shape, a server's heap grew by megabytes per wave of requests
    until the 1024-entry cache filled (~500 MB), and each new shape paid the build. Bucketed,
    a 2048-token budget has 40 shapes per layer; the padded rows are memory-bound work on
    weights already read (200 mixed-length products of this model's layer shapes ran in 3.0 s
    against 3.5)."""
    grain = max(16, 1 << max(0, rows.bit_length() - 4))
    return -(-rows // grain) * grain


# Per thread, per (width, dtype, size class): a staging buffer that padded inputs are written
# into. Sized once for its class (a decode step's rows, a prompt step's default budget) so a
# server's heap does not step up as longer prompts arrive; larger products grow it once.
_staging = threading.local()
STAGING_ROWS = (256, 2048)


def _staged(x2: torch.Tensor, padded: int, dtype: torch.dtype) -> torch.Tensor:
    """``x2`` in ``dtype`` in the first rows of a reused ``[padded, width]`` buffer, zeros
    after: one pass that converts and pads, into memory already faulted in (a fresh padded
    copy per product cost a 2,002-token bf16 prefill step ~90 of its ~560 ms)."""
    bufs: dict = getattr(_staging, "bufs", None) or {}
    _staging.bufs = bufs
    small = padded <= STAGING_ROWS[0]
    key = (x2.shape[1], dtype, small)
    buf = bufs.get(key)
    if buf is None or buf.shape[0] < padded:
        rows = STAGING_ROWS[0] if small else max(STAGING_ROWS[1], padded)
        # a normal tensor (not an inference one): written in and out of inference mode
        with torch.inference_mode(False):
            buf = bufs[key] = torch.empty(rows, x2.shape[1], dtype=dtype)
    view = buf[:padded]
    rows = x2.shape[0]
    view[:rows].copy_(x2)
    view[rows:].zero_()
    return view


def padded_product(
    x2: torch.Tensor,
    product: Callable[[torch.Tensor], torch.Tensor],
    dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``product`` of the 2-D ``x2`` (converted to ``dtype`` when given) run at
    ``bucketed_rows`` rows; the padding is sliced off. ``product`` must return a new tensor
    (the padded input is a reused buffer)."""
    rows = x2.shape[0]
    padded = bucketed_rows(rows)
    target = dtype or x2.dtype
    if padded == rows:
        return product(x2 if x2.dtype == target else x2.to(target))
    return product(_staged(x2, padded, target))[:rows]


def _onednn_forward(
    packed: torch.Tensor, bias: Optional[torch.Tensor], x: torch.Tensor
) -> torch.Tensor:
    width = x.shape[-1]
    x2 = x.reshape(-1, width)
    y = padded_product(
        x2, lambda rows: torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    )
    return y.view(*x.shape[:-1], y.shape[-1])


def _auto_forward(
    small: torch.Tensor, n: int, bias: Optional[torch.Tensor], x: torch.Tensor
) -> torch.Tensor:
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    out = torch.ops.slipstream_cpu.small_gemm(x.reshape(rows, width), small, n, bias)
    return out.view(*x.shape[:-1], n)


def _gemm(weight: torch.Tensor, bias: Optional[torch.Tensor], mode: CpuLinear) -> Callable:
    """The product with ``weight`` [N, K] in ``mode`` (ONEDNN or AUTO), packed once."""
    if mode is CpuLinear.AUTO:
        small = torch.ops.slipstream_cpu.pack_small_gemm_weight(weight)
        return functools.partial(_auto_forward, small, weight.shape[0], bias)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS_HINT)
    return functools.partial(_onednn_forward, packed, bias)


def _packed_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the weight ``pack_small_gemm_weight`` packed as [N/16, K, 16]."""
    lanes = packed.shape[2]
    return packed[ids // lanes, :, ids % lanes]


def _embedding_from_head(embedding: torch.nn.Embedding, head: torch.nn.Linear) -> None:
    """A tied embedding looks its rows up in the head's packed copy: its table (the same
    weight) need not stay for it."""
    forward = head.__dict__.get("forward")
    if not (isinstance(forward, functools.partial) and forward.func is _auto_forward):
        return
    packed = forward.args[0]

    def lookup(ids: torch.Tensor) -> torch.Tensor:
        return _packed_rows(packed, ids)

    setattr(embedding, "forward", lookup)
    embedding.weight = storage_less(embedding.weight)


def _pack(module: torch.nn.Linear, mode: CpuLinear) -> None:
    weight = module.weight.detach().contiguous()
    bias = None if module.bias is None else module.bias.detach().contiguous()
    # An instance attribute shadows Linear.forward; the stock weight stays for now (the lean
    # forward stacks fused layers from it, then drop_stock_weights lets it go).
    setattr(module, "forward", _gemm(weight, bias, mode))


def _stacked(modules: Sequence[torch.nn.Linear]) -> tuple:
    weight = torch.cat([m.weight.detach() for m in modules]).contiguous()
    if all(m.bias is None for m in modules):
        return weight, None
    bias = torch.cat(
        [
            m.bias.detach() if m.bias is not None else weight.new_zeros(m.out_features)
            for m in modules
        ]
    )
    return weight, bias


def fused_linear(
    modules: Sequence[torch.nn.Linear], mode: CpuLinear
) -> Callable[[torch.Tensor], torch.Tensor]:
    """One GEMM over ``modules`` stacked by output rows (q, k, v or gate, up share an input),
    in ``mode``'s library and layout: the GEMM reads the input once and is one call instead
    of several. Split, its output is each layer's own where the library computes an output
    column the same way at either width (the caller checks)."""
    weight, bias = _stacked(modules)
    if mode in (CpuLinear.ONEDNN, CpuLinear.AUTO):
        return _gemm(weight, bias, mode)
    if mode is CpuLinear.TRANSPOSED:
        weight = weight.t().contiguous().t()
    return lambda x: F.linear(x, weight, bias)


def applied_mode(module: torch.nn.Linear) -> Optional[CpuLinear]:
    """The layout ``prepare_linears`` gave ``module``; None where something else replaced its
    forward (a LoRA wrapper): its product is then not the weight's alone."""
    forward = module.__dict__.get("forward")
    if isinstance(forward, functools.partial) and forward.func is _onednn_forward:
        return CpuLinear.ONEDNN
    if isinstance(forward, functools.partial) and forward.func is _auto_forward:
        return CpuLinear.AUTO
    if forward is not None:
        return None
    if not module.weight.is_contiguous() and module.weight.t().is_contiguous():
        return CpuLinear.TRANSPOSED
    return CpuLinear.STOCK


def drop_stock_weights(model: torch.nn.Module, modules: Sequence[torch.nn.Linear]) -> None:
    """``modules``' products run on packed copies only (``prepare_linears``' oneDNN and
    small-GEMM packing, or a stacked copy of layers fused by the lean forward): their stock
    ``.weight`` becomes a stand-in, a copy fewer of each weight resident. A weight that an
    embedding shares (a tied LM head: the lookups read it) stays."""
    shared = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    dropped = [m for m in modules if id(m.weight) not in shared and m.weight.device.type == "cpu"]
    for module in dropped:
        module.weight = storage_less(module.weight)
    if dropped:
        own_storage(model)


def _transpose(module: torch.nn.Linear) -> None:
    if module.weight.is_contiguous():
        module.weight.data = module.weight.data.t().contiguous().t()


def prepare_linears(model: torch.nn.Module, mode: str) -> CpuLinear:
    """Apply ``mode`` to every linear layer of a CPU model; returns the mode applied
    (``auto`` is ``onednn`` where the kernel does not serve fp32; ``onednn`` falls back to
    ``transposed`` where oneDNN or the dtype is unsupported)."""
    choice = CpuLinear(mode)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    dtype = linears[0].weight.dtype if linears else torch.float32
    if choice is CpuLinear.AUTO and not (dtype == torch.float32 and kernel_serves_fp32()):
        choice = CpuLinear.ONEDNN
    if choice is CpuLinear.ONEDNN:
        if not onednn_available() or dtype not in _ONEDNN_DTYPES:
            log.warning("oneDNN linear unavailable for %s; using transposed weights", dtype)
            choice = CpuLinear.TRANSPOSED
    embedding = tied_embedding(model)
    for module in linears:
        if choice in (CpuLinear.ONEDNN, CpuLinear.AUTO):
            _pack(module, choice)
        elif choice is CpuLinear.TRANSPOSED:
            _transpose(module)
    if embedding is not None:
        _embedding_from_head(embedding, getattr(model, "lm_head"))
    return choice
