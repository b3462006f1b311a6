"""Linear layers with bf16 or int8 weights on CPU; the residual stream, norms and attention
stay fp32.

``dtype=bfloat16`` and ``quantization=int8`` change how the linear layers' weights are held
and multiplied. The residual stream, norms, rotary, attention and the logits stay float32:
the inputs of a product are rounded to bf16 (bf16) or quantized per block (int8) where the
product runs, and every sum accumulates exactly (int8) or in float32. In the lean forward a
packed bf16 product hands its output on in bf16 where the consumer takes bf16 (the MLP's
activation and down projection, the residual add, the KV cache), as vLLM's bf16 model does:
widening every product's output to fp32 and rounding it again for the next product cost a
2,002-token prefill step (14 prompts) ~14 of its ~570 ms. A decode step reads every weight
once, so at a few rows its speed follows the weights' bytes (fp32 4, bf16 2, int8 ~1.1 per
weight); at many rows it follows the arithmetic rate, which int8 doubles against bf16. The KV
cache is bf16 with reduced weights unless ``kv_cache_dtype`` says otherwise.

One copy of each weight is resident: the fp32 weight is dropped once converted, and the layout
the products read is the only one kept (``WeightPlan``):

* bf16 where the CPU has AMX (Sapphire Rapids and later Xeons): oneDNN's own packing of the
  bf16 weight, run on AMX tiles at every row count.
* bf16 where the CPU has AVX512-BF16 and no AMX (Zen 4, Cooper Lake): the weight in panels
  (``bf16_weight``) for ``kernels/csrc/cpu_bf16_gemm.cpp``. A decode step streams the weights from
  memory: oneDNN's packed bf16 GEMM read them at ~13 GB/s on Zen 4, the panel kernel at
  1.3-2x that speed at 1-8 rows; at 64 rows both run at ~300 GFLOP/s, at prompt sizes oneDNN
  is ~10-20% ahead. The panels are also the only copy of the head: a tied embedding reads
  them, where oneDNN's packing would need a table of its own.
* bf16 elsewhere: the plain ``[N, K]`` weight; decode rows (up to ``BF16_KERNEL_ROWS``) on
  ``kernels/csrc/cpu_weight_gemm.cpp`` (weights widened to fp32 in registers), prompt rows on
  oneDNN's fp32 GEMM on a widened copy.
* int8: weights and activations in blocks of 32 along K (``q8_weight``, llama.cpp's Q8_0 x
  Q8_0), multiplied by ``kernels/csrc/cpu_q8_gemm.cpp`` (AVX512-VNNI, else a portable loop), each
  layer's 8 outlier input channels apart in float32 (``int8_outliers``). The LM head
  too: a tied input embedding looks its rows up in the head's packed weight.
* int4: a 4-bit checkpoint's weights as it shipped them (GGUF Q4_0 / Q4_1 / Q4_K, AWQ,
  GPTQ; ``q4_weight``), multiplied with int8 activation blocks by ``kernels/csrc/cpu_q4_gemm.cpp``.
  The plans are made at load, from the checkpoint's blocks (``model/gguf_checkpoint``,
  ``model/int4_checkpoint``): no float copy of a weight is made. A GGUF's Q8_0 tensors (the
  embedding and head of a Q4_0 / Q4_1 file) are int8 blocks as they are; only a checkpoint's
  other tensors are converted at load (to int8 blocks).
"""

from __future__ import annotations

import enum
import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, TypeVar

import torch
import torch.nn.functional as F

from slipstream.worker import kernels
from slipstream.worker.kernels.cpu_features import CpuFeatures
from slipstream.worker.layers.linear import padded_product
from slipstream.worker.layers.memory import (
    own_storage,
    storage_less,
    tied_embedding,
)
from slipstream.worker.layers.quantization import (
    bf16 as bf16_weight,
    int4 as q4_weight,
    int8 as q8_weight,
    int8_outliers as activation_outliers,
)

log = logging.getLogger("slipstream")


class WeightFormat(str, enum.Enum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    INT8 = "int8"
    INT4 = "int4"  # a 4-bit checkpoint's own blocks (quantization=gguf / awq / gptq)


@dataclass
class WeightPlan:
    """One linear layer's weight as its products read it (exactly one of plain / packed /
    panels / q8). A plan to be packed for oneDNN keeps its plain weight until its first product, so
    that layers sharing an input can be stacked first (``fused_reduced``)."""

    out_features: int
    plain: Optional[torch.Tensor]  # [N, K] bf16, rows contiguous
    bias: Optional[torch.Tensor]  # [N] fp32
    kernel_rows: int  # up to this many rows the compiled kernel runs a plain product
    # many rows of a plain weight in bf16 (the CPU has AVX512-BF16 or AMX), else in fp32
    bf16_gemm: bool = True
    pack: bool = False  # bf16 with AMX: oneDNN's packing replaces the plain weight
    packed: Optional[torch.Tensor] = None  # oneDNN's packing of the bf16 weight
    panels: Optional[bf16_weight.Bf16Weight] = None  # bf16 with AVX512-BF16, no AMX
    # A bf16 product's output (packed or panels) as it is (the lean forward's inner layers,
    # whose consumers take bf16: vLLM's bf16 MLP), else widened to fp32.
    bf16_out: bool = False
    q8: Optional[q8_weight.Q8Weight] = None  # int8: the packed blocks
    q4: Optional[q4_weight.Int4Weight] = None  # int4: the checkpoint's nibbles
    kernel: bool = False  # the compiled kernels are loaded (int8's and int4's products)

    def held(self) -> Optional[torch.Tensor]:
        """The tensor that holds the weight (None once stacked into a fused plan)."""
        for layout in (self.q8, self.q4, self.panels):
            if layout is not None:
                return layout.packed
        return self.packed if self.packed is not None else self.plain


# Up to this many rows the compiled kernel streams a plain bf16 weight (a CPU without
# AVX512-BF16 or AMX, where oneDNN would only emulate bf16); above, oneDNN's fp32 GEMM on a
# widened copy.
BF16_KERNEL_ROWS = 4


def _bf16_gemm_ok(features: CpuFeatures) -> bool:
    """oneDNN runs bf16 products at speed (AVX512-BF16 or AMX); elsewhere it emulates them."""
    return features.avx512_bf16 or features.amx_bf16


def _wide_product(plan: WeightPlan, x: torch.Tensor) -> torch.Tensor:
    """Many rows of a plain weight (a prompt chunk, or no compiled kernel): oneDNN's GEMM, in
    bf16 where the CPU runs bf16 products natively, else in fp32 on a widened copy."""
    plain = plan.plain
    assert plain is not None  # a plan not packed (packing is the only thing that drops it)
    if plan.bf16_gemm:
        y = F.linear(x.to(torch.bfloat16), plain).float()
    else:
        y = F.linear(x, plain.float())
    if plan.bias is not None:
        y.add_(plan.bias)
    return y


def _packed_product(plan: WeightPlan, x2: torch.Tensor) -> torch.Tensor:
    if plan.packed is None:
        plan.packed = torch.ops.mkldnn._reorder_linear_weight(plan.plain, 64)
        plan.plain = None
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
    return y


def _reduced_forward(plan: WeightPlan, x: torch.Tensor) -> torch.Tensor:
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    x2 = x.reshape(rows, width)
    if plan.q8 is not None:
        y = q8_weight.product(plan.q8, x2, plan.bias, plan.kernel)
    elif plan.q4 is not None:
        y = q4_weight.product(plan.q4, x2, plan.bias, plan.kernel)
    elif plan.panels is not None:
        y = bf16_weight.product(plan.panels, x2, plan.bias, plan.bf16_out)
    elif plan.pack:
        y = _packed_product(plan, x2)
    elif 0 < rows <= plan.kernel_rows:
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = torch.ops.slipstream_cpu.weight_gemm(x2, plan.plain, plan.bias)
    else:
        y = padded_product(x2, lambda rows: _wide_product(plan, rows))
    return y.view(*x.shape[:-1], plan.out_features)


def _bf16_plan(
    weight: torch.Tensor, bias: Optional[torch.Tensor], features: CpuFeatures, kernel: bool
) -> WeightPlan:
    n, k = weight.shape
    if features.amx_bf16 and _onednn_ok():
        return WeightPlan(n, weight, bias, 0, pack=True)
    if features.avx512_bf16 and kernel and bf16_weight.supports(weight):
        return WeightPlan(n, None, bias, 0, panels=bf16_weight.pack(weight))
    rows = BF16_KERNEL_ROWS if kernel and k % 32 == 0 else 0
    return WeightPlan(n, weight, bias, rows, _bf16_gemm_ok(features))


def _plan(
    module: torch.nn.Linear,
    fmt: WeightFormat,
    features: CpuFeatures,
    kernel: bool,
    outliers: Optional[torch.Tensor] = None,
) -> WeightPlan:
    weight = module.weight.detach()
    bias = None if module.bias is None else module.bias.detach().float().contiguous()
    if fmt is WeightFormat.INT8 and q8_weight.supports(weight):
        q8 = q8_weight.quantize(weight, outliers)
        return WeightPlan(q8.out_features, None, bias, 0, q8=q8, kernel=kernel)
    return _bf16_plan(weight.to(torch.bfloat16).contiguous(), bias, features, kernel)


def _onednn_ok() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def read_rows_from(embedding: torch.nn.Module, plan: WeightPlan) -> None:
    """A tied embedding looks its rows up in the head's weight and returns them as fp32:
    int8 and bf16 panels read the head's packed weight; a plain bf16 head's table, or, where
    oneDNN packs the head (AMX), a plain bf16 table of its own (oneDNN's packing cannot be
    gathered)."""
    panels = next((p for p in (plan.q8, plan.q4, plan.panels) if p is not None), None)
    if panels is not None:
        rows = panels.rows

        def forward(ids: torch.Tensor) -> torch.Tensor:
            return rows(ids)

        embedding.weight = storage_less(panels.packed)
    else:
        assert plan.plain is not None  # a bf16 plan keeps it until its first product
        table = plan.plain.clone() if plan.pack else plan.plain

        def forward(ids: torch.Tensor) -> torch.Tensor:
            return F.embedding(ids, table).float()

        embedding.weight = storage_less(table)
    embedding.forward = forward


def apply_plan(
    module: torch.nn.Module, plan: WeightPlan, embedding: Optional[torch.nn.Embedding] = None
) -> None:
    """``module``'s products run ``plan`` (its own weight and bias go); ``embedding``, a tied
    input embedding, looks its rows up in the plan's weight."""
    held = plan.held()
    assert held is not None  # a new plan holds its weight
    module.weight = storage_less(held)
    if getattr(module, "bias", None) is not None:
        module.register_parameter("bias", None)  # the plan holds it as fp32
    setattr(module, "forward", functools.partial(_reduced_forward, plan))
    if embedding is not None:
        read_rows_from(embedding, plan)


def loaded_plan(
    layout: "q4_weight.Int4Weight | q8_weight.Q8Weight", bias: Optional[torch.Tensor] = None
) -> WeightPlan:
    """The plan of a layer whose weight a checkpoint shipped in a kernel's layout (its 4-bit
    or Q8_0 blocks)."""
    bias = None if bias is None else bias.detach().float().contiguous()
    kernel = kernels.load()
    if isinstance(layout, q4_weight.Int4Weight):
        return WeightPlan(layout.out_features, None, bias, 0, q4=layout, kernel=kernel)
    return WeightPlan(layout.out_features, None, bias, 0, q8=layout, kernel=kernel)


def prepare_reduced_linears(model: torch.nn.Module, fmt: WeightFormat) -> str:
    """Convert every ``nn.Linear`` of an fp32 CPU model to ``fmt`` (one copy of each weight);
    returns what runs the products, for the start-up log. ``int4``: the checkpoint's blocks
    were planned at load; the outlier channels are found and set apart here."""
    features = CpuFeatures.detect()
    kernel = kernels.load()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if fmt is WeightFormat.INT4:
        _set_outliers_apart(model, linears)
        own_storage(model)
        return describe(fmt, features, kernel)
    embedding = tied_embedding(model)
    head = getattr(model, "lm_head", None)
    outliers = activation_outliers.find(model, linears) if fmt is WeightFormat.INT8 else {}
    for module in linears:
        plan = _plan(module, fmt, features, kernel, outliers.get(module))
        apply_plan(module, plan)
        if module is head and embedding is not None:
            read_rows_from(embedding, plan)
    own_storage(model)
    return describe(fmt, features, kernel)


def _set_outliers_apart(model: torch.nn.Module, linears: Sequence[torch.nn.Module]) -> None:
    """The outlier input channels of layers planned from a checkpoint's blocks, found by a
    calibration forward through those blocks (the channels are the model's, not the
    products'), multiplied apart in float32 as int8's are."""
    outliers = activation_outliers.find(model, linears)
    for module in linears:
        plan, channels = applied_plan(module), outliers.get(module)
        if plan is None or channels is None:
            continue
        if plan.q4 is not None:
            plan.q4 = plan.q4.with_outliers(channels)
        elif plan.q8 is not None:
            plan.q8 = plan.q8.with_outliers(channels)


def describe(fmt: WeightFormat, features: CpuFeatures, kernel: bool) -> str:
    if fmt is WeightFormat.INT4:
        path = torch.ops.slipstream_cpu.q4_gemm_path() if kernel else None
        how = f"compiled kernel ({path})" if path else "torch (no compiled kernel: slow)"
        return (
            "4-bit weights as the checkpoint shipped them, int8 activations in blocks of 32; "
            f"products: {how}"
        )
    if fmt is WeightFormat.INT8:
        path = torch.ops.slipstream_cpu.q8_gemm_path() if kernel else None
        how = f"compiled kernel ({path})" if path else "torch (no compiled kernel: slow)"
        return f"int8 weights and activations in blocks of 32 (Q8_0 x Q8_0); products: {how}"
    if features.amx_bf16 and _onednn_ok():
        return "bf16 weights packed for oneDNN (AMX), fp32 activations"
    if features.avx512_bf16 and kernel:
        path = torch.ops.slipstream_cpu.bf16_gemm_path()
        return f"bf16 weights in panels, fp32 activations; products: compiled kernel ({path})"
    path = torch.ops.slipstream_cpu.weight_gemm_path() if kernel else None
    decode = f"compiled kernel ({path})" if path else "oneDNN (no compiled kernel)"
    return (
        f"bf16 weights, fp32 activations; decode rows: {decode}; prompt rows: oneDNN fp32 on "
        "a widened copy (no AVX512-BF16 or AMX: slower prompts)"
    )


def applied_plan_of(product: Optional[Callable]) -> Optional[WeightPlan]:
    """The plan a reduced product (``fused_reduced``'s, or a layer's forward) runs."""
    if isinstance(product, functools.partial) and product.func is _reduced_forward:
        return product.args[0]
    return None


def applied_plan(module: torch.nn.Module) -> Optional[WeightPlan]:
    return applied_plan_of(module.__dict__.get("forward"))


def product_of(plan: WeightPlan) -> Callable[[torch.Tensor], torch.Tensor]:
    """``plan``'s product as the forward runs it (``x [..., K] -> [..., N]``)."""
    return functools.partial(_reduced_forward, plan)


def serving_plan(module: torch.nn.Module) -> Optional[WeightPlan]:
    """The plan that runs ``module``'s products: its own, or the fused plan (q/k/v, gate/up)
    whose slice it has become (``fused_reduced``)."""
    forward = module.__dict__.get("forward")
    if isinstance(forward, functools.partial) and forward.func is _slice_of:
        return applied_plan_of(forward.args[0])
    return applied_plan_of(forward)


def fused_reduced(modules: Sequence[torch.nn.Module], bf16_out: bool = False) -> Optional[Callable]:
    """One product over reduced layers that share an input (q, k, v or gate, up): their
    weights stacked into one plan; each layer's own copy goes (its forward becomes a slice of
    the fused product, which the lean forward does not call). None where they cannot fuse.
    ``bf16_out``: a packed bf16 product returns bf16 (see ``WeightPlan.bf16_out``)."""
    found = [applied_plan(m) for m in modules]
    plans = [p for p in found if p is not None and _unpacked(p)]
    if len(plans) != len(found) or len({_kind(p) for p in plans}) != 1:
        return None
    fused = _stack_plans(plans)
    if fused is None:
        return None
    fused.bf16_out = bf16_out and _bf16_product(fused)
    gemm = functools.partial(_reduced_forward, fused)
    sizes = [p.out_features for p in plans]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    for m, start, size in zip(modules, offsets, sizes):
        m.forward = functools.partial(_slice_of, gemm, start, size)
    return gemm


def _unpacked(plan: WeightPlan) -> bool:
    """Its weight is still whole (not stacked into a fused plan, not packed by oneDNN)."""
    return any(t is not None for t in (plan.plain, plan.panels, plan.q8, plan.q4))


def _kind(plan: WeightPlan) -> tuple[bool, bool, bool, bool]:
    return plan.pack, plan.panels is not None, plan.q8 is not None, plan.q4 is not None


def _bf16_product(plan: WeightPlan) -> bool:
    """Its product can hand out bf16 (oneDNN's packing, or the panels)."""
    return plan.pack or plan.panels is not None


def keep_bf16_output(module: torch.nn.Module) -> None:
    """A bf16 layer (packed or panels) returns its product in bf16 (``WeightPlan.bf16_out``)."""
    plan = applied_plan(module)
    if plan is not None and _bf16_product(plan):
        plan.bf16_out = True


def _slice_of(gemm: Callable, start: int, size: int, x: torch.Tensor) -> torch.Tensor:
    return gemm(x).narrow(-1, start, size)


# The packed layouts that stack by their own module's ``stack``: the plan's attribute, that
# function, and whether the stacked plan keeps ``kernel`` (only the quantized products read it).
_STACKABLE_LAYOUTS: tuple[tuple[str, Callable[[list], Any], bool], ...] = (
    ("panels", bf16_weight.stack, False),
    ("q8", q8_weight.stack, True),
    ("q4", q4_weight.stack, True),
)


def _stack_plans(plans: Sequence[WeightPlan]) -> Optional[WeightPlan]:
    n = sum(p.out_features for p in plans)
    bias = None
    if any(p.bias is not None for p in plans):
        bias = torch.cat(
            [p.bias if p.bias is not None else torch.zeros(p.out_features) for p in plans]
        )
    first = plans[0]
    for attr, stack, keeps_kernel in _STACKABLE_LAYOUTS:
        if getattr(first, attr) is None:
            continue
        layout = stack(_all_set([getattr(p, attr) for p in plans]))
        if layout is None:
            return None
        for p in plans:
            setattr(p, attr, None)  # the stacked plan holds the only copy
        kernel = first.kernel if keeps_kernel else False
        return WeightPlan(n, None, bias, 0, kernel=kernel, **{attr: layout})
    stacked = torch.cat(_all_set([p.plain for p in plans])).contiguous()  # not packed yet
    for p in plans:
        p.plain = None
    return WeightPlan(n, stacked, bias, first.kernel_rows, first.bf16_gemm, first.pack)


T = TypeVar("T")


def _all_set(items: list[Optional[T]]) -> list[T]:
    """``items``, which the caller knows are all set."""
    present = [t for t in items if t is not None]
    assert len(present) == len(items)
    return present
