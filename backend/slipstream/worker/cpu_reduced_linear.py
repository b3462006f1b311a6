"""Linear layers with bf16 or int8 weights on CPU; the residual stream, norms and attention
stay fp32.

``dtype=bfloat16`` and ``quantization=int8`` change how the linear layers' weights are held
and multiplied. The residual stream, norms, rotary, attention and the logits stay float32:
the inputs of a product are rounded to bf16 where the product runs in bf16, and every sum
accumulates in float32. In the lean forward a packed (AMX) bf16 product hands its output on
in bf16 where the consumer takes bf16 (the MLP's activation and down projection, the
residual add, the KV cache), as vLLM's bf16 model does: widening every product's output to
fp32 and rounding it again for the next product cost a 2,002-token prefill step (14 prompts)
~14 of its ~570 ms. A
decode step reads every weight once and is bound by that read, so its speed follows the
weights' bytes (fp32 4, bf16 2, int8 1 per weight). The KV cache is bf16 with reduced
weights unless ``kv_cache_dtype`` says otherwise.

One copy of each weight is resident: the fp32 weight is dropped once converted, and the layout
the products read is the only one kept (`WeightPlan`):

* bf16 where the CPU has AMX (Sapphire Rapids and later Xeons): oneDNN's own packing of the
  bf16 weight, which it runs on AMX tiles at every row count (a decode step's GEMMs at 8-64
  rows in 0.3-0.5x the fp32 kernel's time on one thread; at 1 row as fast as the bf16 kernel).
* bf16 elsewhere, and int8 everywhere: the plain ``[N, K]`` weight. Up to ``kernel_rows`` rows
  (decode steps) ``ops/cpu_weight_gemm.cpp`` streams it (AVX512-BF16 ``vdpbf16ps`` where the CPU
  has it, else widened to fp32 a tile at a time); more rows (prompt chunks) run oneDNN's bf16
  GEMM on it (int8 widened to bf16 exactly for the call, its scales applied to the output), or
  on a CPU with neither AVX512-BF16 nor AMX oneDNN's fp32 GEMM on a widened copy.

int8 is weight-only (like vLLM's W8A16 schemes): symmetric, one fp32 scale per output row
(``scale = max|w| / 127``), activations not quantized. The LM head is not quantized: it is
held as bf16 (``HEAD_FORMAT``), and a tied input embedding keeps an int8 table of its own
(rows dequantized on lookup). With bf16 weights a tied embedding reads the head's plain table,
so tying costs no second copy, except with the AMX layout, where the embedding keeps its own
plain bf16 table (oneDNN's packing cannot be gathered).
"""

from __future__ import annotations

import enum
import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from slipstream.worker.cpu_linear import padded_product
from slipstream.worker.ops import cpu_kernels

log = logging.getLogger("slipstream")


class WeightFormat(str, enum.Enum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    INT8 = "int8"


@dataclass(frozen=True)
class CpuFeatures:
    """What the reduced paths need from the CPU (read once from /proc/cpuinfo)."""

    avx512_bf16: bool
    amx_bf16: bool
    avx512_vnni: bool

    @classmethod
    def detect(cls) -> "CpuFeatures":
        flags = set(cpu_kernels._cpu_flags().split())
        return cls("avx512_bf16" in flags, "amx_bf16" in flags, "avx512_vnni" in flags)


@dataclass
class WeightPlan:
    """One linear layer's weight as its products read it (exactly one of plain / packed).
    A plan to be packed for oneDNN keeps its plain weight until its first product, so that
    layers sharing an input can be stacked first (``fused_reduced``)."""

    out_features: int
    plain: Optional[torch.Tensor]  # [N, K] bf16 or int8, rows contiguous
    scales: Optional[torch.Tensor]  # [N] fp32: int8's per-row scales
    bias: Optional[torch.Tensor]  # [N] fp32
    kernel_rows: int  # up to this many rows the compiled kernel runs the product
    # many rows in bf16 (the CPU has AVX512-BF16 or AMX), else in fp32 on a widened copy
    bf16_gemm: bool = True
    pack: bool = False  # bf16 on AMX: oneDNN's packing replaces the plain weight
    packed: Optional[torch.Tensor] = None  # oneDNN's packing of the bf16 weight
    # The packed product's bf16 output as it is (the lean forward's inner layers, whose
    # consumers take bf16: vLLM's bf16 MLP), else widened to fp32.
    bf16_out: bool = False


# Up to this many rows the compiled kernel streams a plain weight; above, oneDNN's bf16 GEMM.
# One thread, one decode step's GEMMs (SmolLM2-135M, Xeon with AMX, CPU time, noisy shared
# machine): int8 kernel 0.54x the fp32 kernel at 1 row, 0.78x at 8, 1.18x at 32; bf16 kernel
# 0.68x at 1 row and 1.26x at 8 (it is bound by vdpbf16ps's rate past a few rows, where
# oneDNN's blocked kernels keep more products in flight).
KERNEL_ROWS = {WeightFormat.BFLOAT16: 4, WeightFormat.INT8: 16}
# A weight this large (an LM head) costs more to widen for one call than the kernel's product
# at up to 64 rows: a fresh 57 MB bf16 copy page-faults in. SmolLM2's int8 LM head, one thread:
# kernel 13.6 / 22.0 / 41.5 ms at 16 / 32 / 64 rows against 42.8 / 42.4 / 51.7 widened.
LARGE_WEIGHT = 1 << 23
LARGE_KERNEL_ROWS = 64


# The LM head is not quantized (held as bf16 under quantization=int8), as quantization
# schemes commonly leave it: vLLM's compressed-tensors configs list it under "ignore", and
# llama.cpp's Q4/Q5 mixes keep output.weight at 6 bits or more. A decode step's int8 head past
# 16 rows was 22 ms of a 109 ms batch-64 step (the kernel) against 2 ms packed bf16 on AMX.
HEAD_FORMAT = {WeightFormat.INT8: WeightFormat.BFLOAT16}


def _bf16_gemm_ok(features: CpuFeatures) -> bool:
    """oneDNN runs bf16 products at speed (AVX512-BF16 or AMX); elsewhere it emulates them."""
    return features.avx512_bf16 or features.amx_bf16


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``weight ~= q * scale[:, None]``."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def _wide_product(plan: WeightPlan, x: torch.Tensor) -> torch.Tensor:
    """Many rows (a prompt chunk): oneDNN's GEMM on the plain weight, in bf16 where the CPU
    runs bf16 products natively, else in fp32 on a widened copy made for the call."""
    plain = plan.plain
    assert plain is not None  # a plan not packed (packing is the only thing that drops it)
    if plan.bf16_gemm:
        weight = plain if plain.dtype == torch.bfloat16 else plain.bfloat16()
        y = F.linear(x.to(torch.bfloat16), weight).float()
    else:
        y = F.linear(x, plain.float())
    if plan.scales is not None:
        y.mul_(plan.scales)
    if plan.bias is not None:
        y.add_(plan.bias)
    return y


def _reduced_forward(plan: WeightPlan, x: torch.Tensor) -> torch.Tensor:
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    x2 = x.reshape(rows, width)
    if plan.pack and plan.packed is None:
        plan.packed = torch.ops.mkldnn._reorder_linear_weight(plan.plain, 64)
        plan.plain = None
    if plan.packed is not None:
        packed = plan.packed
        y = padded_product(
            x2,
            lambda rows: torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], ""),
            torch.bfloat16,
        )
        if not plan.bf16_out:
            y = y.float()
        if plan.bias is not None:
            y.add_(plan.bias)
    elif 0 < rows <= plan.kernel_rows:
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = torch.ops.slipstream_cpu.weight_gemm(x2, plan.plain, plan.scales, plan.bias)
    else:
        y = padded_product(x2, lambda rows: _wide_product(plan, rows))
    return y.view(*x.shape[:-1], plan.out_features)


def _plan(
    weight: torch.Tensor,
    scales: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    fmt: WeightFormat,
    features: CpuFeatures,
    kernel: bool,
) -> WeightPlan:
    """``weight`` is already in ``fmt`` (bf16, or int8 with ``scales``)."""
    n, k = weight.shape
    bias = None if bias is None else bias.detach().float().contiguous()
    if fmt is WeightFormat.BFLOAT16 and features.amx_bf16 and _onednn_ok():
        return WeightPlan(n, weight.contiguous(), None, bias, 0, pack=True)
    rows = KERNEL_ROWS[fmt] if kernel and k % 32 == 0 else 0
    if rows and fmt is WeightFormat.INT8 and weight.numel() >= LARGE_WEIGHT:
        rows = LARGE_KERNEL_ROWS
    return WeightPlan(n, weight.contiguous(), scales, bias, rows, _bf16_gemm_ok(features))


def _onednn_ok() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def _convert(weight: torch.Tensor, fmt: WeightFormat):
    if fmt is WeightFormat.INT8:
        return quantize_int8(weight)
    return weight.detach().to(torch.bfloat16).contiguous(), None


def _meta_like(t: torch.Tensor) -> torch.nn.Parameter:
    """A stand-in with the weight's shape and dtype and no storage: the layer's own copy goes."""
    return torch.nn.Parameter(
        torch.empty(t.shape, dtype=t.dtype, device="meta"), requires_grad=False
    )


@dataclass
class _Context:
    fmt: WeightFormat
    features: CpuFeatures
    kernel: bool


def _prepare_embedding(
    embedding: torch.nn.Module, plain: torch.Tensor, scales: Optional[torch.Tensor]
) -> None:
    """The embedding looks its rows up in ``plain`` and returns them as fp32."""

    def forward(ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, plain).float()
        if scales is not None:
            rows.mul_(scales[ids].unsqueeze(-1))
        return rows

    embedding.weight = _meta_like(plain)
    embedding.forward = forward


def _prepare_one(
    module: torch.nn.Linear,
    ctx: _Context,
    tied_embedding: Optional[torch.nn.Module],
    fmt: Optional[WeightFormat] = None,
) -> None:
    """``module`` in ``fmt`` (default: the model's, ``ctx.fmt``)."""
    fmt = fmt or ctx.fmt
    weight, scales = _convert(module.weight, fmt)
    plan = _plan(weight, scales, module.bias, fmt, ctx.features, ctx.kernel)
    if tied_embedding is not None and fmt is not ctx.fmt:
        # an unquantized head: the embedding keeps the model's format in a table of its own
        _prepare_embedding(tied_embedding, *_convert(module.weight, ctx.fmt))
    elif tied_embedding is not None:
        _prepare_embedding(tied_embedding, weight, scales)
    module.weight = _meta_like(weight)
    if module.bias is not None:
        module.register_parameter("bias", None)  # the plan holds it as fp32
    setattr(module, "forward", functools.partial(_reduced_forward, plan))


def prepare_reduced_linears(model: torch.nn.Module, fmt: WeightFormat) -> str:
    """Convert every ``nn.Linear`` of an fp32 CPU model to ``fmt`` (one copy of each weight);
    returns what runs the products, for the start-up log."""
    features = CpuFeatures.detect()
    kernel = cpu_kernels.load()
    ctx = _Context(fmt, features, kernel)
    embedding = _tied_embedding(model)
    head = getattr(model, "lm_head", None)
    for module in [m for m in model.modules() if isinstance(m, torch.nn.Linear)]:
        if module is head:
            _prepare_one(module, ctx, embedding, HEAD_FORMAT.get(fmt, fmt))
        else:
            _prepare_one(module, ctx, None)
    _own_storage(model)
    return describe(fmt, features, kernel)


def _own_storage(model: torch.nn.Module) -> None:
    """Give what is left (norms, rotary tables) storage of its own. Loaded from safetensors,
    every tensor is a view of the file's one memory map: a single norm weight left in it
    keeps the whole file mapped, and the pages the conversion read (all of the fp32
    weights) resident."""
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            if tensor.device.type == "cpu":
                tensor.data = tensor.data.clone()


def _tied_embedding(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    head = getattr(model, "lm_head", None)
    hf: Any = model  # a transformers model: torch types its methods as Tensor | Module
    embedding = hf.get_input_embeddings() if hasattr(hf, "get_input_embeddings") else None
    if head is None or embedding is None or embedding.weight is not head.weight:
        return None
    return embedding


def describe(fmt: WeightFormat, features: CpuFeatures, kernel: bool) -> str:
    if fmt is WeightFormat.BFLOAT16 and features.amx_bf16 and _onednn_ok():
        return "bf16 weights packed for oneDNN (AMX), fp32 activations"
    path = torch.ops.slipstream_cpu.weight_gemm_path() if kernel else None
    decode = f"compiled kernel ({path})" if path else "oneDNN (no compiled kernel)"
    prompt = (
        "oneDNN bf16"
        if _bf16_gemm_ok(features)
        else "oneDNN fp32 on a widened copy (no AVX512-BF16: slower prompts)"
    )
    return f"{fmt.value} weights, fp32 activations; decode rows: {decode}; prompt rows: {prompt}"


def applied_plan_of(product: Optional[Callable]) -> Optional[WeightPlan]:
    """The plan a reduced product (``fused_reduced``'s, or a layer's forward) runs."""
    if isinstance(product, functools.partial) and product.func is _reduced_forward:
        return product.args[0]
    return None


def applied_plan(module: torch.nn.Module) -> Optional[WeightPlan]:
    return applied_plan_of(module.__dict__.get("forward"))


def fused_reduced(modules: Sequence[torch.nn.Module], bf16_out: bool = False) -> Optional[Callable]:
    """One product over reduced layers that share an input (q, k, v or gate, up): their
    weights stacked into one plan; each layer's own copy goes (its forward becomes a slice of
    the fused product, which the lean forward does not call). None where they cannot fuse.
    ``bf16_out``: a packed (AMX) product returns bf16 (see ``WeightPlan.bf16_out``)."""
    found = [applied_plan(m) for m in modules]
    plans = [p for p in found if p is not None and p.plain is not None]
    if len(plans) != len(found) or len({p.pack for p in plans}) != 1:
        return None
    fused = _stack_plans(plans)
    fused.bf16_out = bf16_out and fused.pack
    gemm = functools.partial(_reduced_forward, fused)
    sizes = [p.out_features for p in plans]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    for m, start, size in zip(modules, offsets, sizes):
        m.forward = functools.partial(_slice_of, gemm, start, size)
    return gemm


def keep_bf16_output(module: torch.nn.Module) -> None:
    """A packed (AMX) bf16 layer returns its product in bf16 (``WeightPlan.bf16_out``)."""
    plan = applied_plan(module)
    if plan is not None and plan.pack:
        plan.bf16_out = True


def _slice_of(gemm: Callable, start: int, size: int, x: torch.Tensor) -> torch.Tensor:
    return gemm(x).narrow(-1, start, size)


def _stack_plans(plans: Sequence[WeightPlan]) -> WeightPlan:
    n = sum(p.out_features for p in plans)
    bias = None
    if any(p.bias is not None for p in plans):
        bias = torch.cat(
            [p.bias if p.bias is not None else torch.zeros(p.out_features) for p in plans]
        )
    stacked = torch.cat(_all_set([p.plain for p in plans])).contiguous()  # not packed yet
    scales = None
    if plans[0].scales is not None:  # int8: every plan has its scales
        scales = torch.cat(_all_set([p.scales for p in plans])).contiguous()
    for p in plans:
        p.plain = None
    return WeightPlan(
        n, stacked, scales, bias, plans[0].kernel_rows, plans[0].bf16_gemm, plans[0].pack
    )


def _all_set(tensors: list[Optional[torch.Tensor]]) -> list[torch.Tensor]:
    """``tensors``, which the caller knows are all set."""
    present = [t for t in tensors if t is not None]
    assert len(present) == len(tensors)
    return present


def release_freed_memory() -> None:
    """Hand the freed fp32 weights' pages back to the OS (glibc keeps freed heap memory,
    and raises its mmap threshold after large frees, so RSS would stay at the fp32 size)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name:
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


def prepare_cpu_model(model: torch.nn.Module, weights: str, cpu_linear: str) -> None:
    """The CPU engine's layers for a loaded fp32 model: its linear layers in ``weights``
    (``float32`` in ``cpu_linear``'s layout, or ``bfloat16`` / ``int8``), its norms on the
    compiled kernel. The quality gate prepares its candidate models the same way."""
    from slipstream.worker.cpu_linear import prepare_linears
    from slipstream.worker.cpu_norm import prepare_norms

    if weights == WeightFormat.FLOAT32.value:
        prepare_linears(model, cpu_linear)
    else:
        how = prepare_reduced_linears(model, WeightFormat(weights))
        release_freed_memory()
        log.info("CPU linear layers: %s (%s)", how, CpuFeatures.detect())
    prepare_norms(model)
