"""Every decoder layer of a decode step in one compiled call
(``kernels/csrc/cpu_decode_stack.cpp``).

The lean forward (``lean_forward``) runs a layer as ~25 operator calls and module hops from
Python; with int8 weights at a few rows that Python is ~4 ms of a ~12 ms step, beside ~6 ms of
streaming weights. The compiled stack computes the same arithmetic, on the same tensors, in
the same order, from C++ (a step of a few rows as one parallel region: the kernel's header
says how): the hidden state it hands back is bit for bit the Python loop's. It serves the
layers whose products are the compiled reduced kernels (int8, int4 and bf16 panels) and norms
the compiled RMSNorm, on steps where every row is a decode-kernel row
(``AttentionPlan.decode_step``) and every row's logits are kept; other steps, models and
formats run the Python loop.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from slipstream.worker import kernels
from slipstream.worker.attention.metadata import DecodeStep
from slipstream.worker.layers.norm import kernel_norm
from slipstream.worker.layers.reduced_linear import WeightPlan

_NONE = torch.empty(0)  # an absent optional tensor (the native lists hold no None)


@dataclass(frozen=True)
class StackLayer:
    """One decoder layer as the lean forward runs it, in the stack's terms."""

    norm_in: torch.nn.Module
    norm_post: torch.nn.Module
    qkv: WeightPlan
    qkv_sizes: Sequence[int]
    o: WeightPlan
    gate_up: WeightPlan
    down: WeightPlan
    scaling: float
    window: Optional[int]


class ProductKind(enum.IntEnum):
    """Which compiled product a layer runs (``cpu_decode_stack.cpp`` reads the number)."""

    BF16_PANELS = 0
    INT8 = 1
    INT4 = 2


def _optional(t: Optional[torch.Tensor]) -> torch.Tensor:
    return _NONE if t is None else t


def _product(plan: WeightPlan) -> Optional[tuple[list[torch.Tensor], list[int]]]:
    """The product's tensors and ints for ``add_layer``; None where it is not a compiled
    int8, int4 or bf16-panel product."""
    bias = _optional(plan.bias)
    q8, q4, panels = plan.q8, plan.q4, plan.panels
    if q8 is not None and plan.kernel:
        outliers = [_optional(q8.outliers), _optional(q8.outlier_w)]
        tensors = [q8.packed, q8.scales, bias, *outliers, _NONE]
        return tensors, [ProductKind.INT8, q8.out_features, 0, 0]
    if q4 is not None and plan.kernel:
        outliers = [_optional(q4.outliers), _optional(q4.outlier_w)]
        tensors = [q4.packed, q4.scales, bias, *outliers, _optional(q4.perm)]
        return tensors, [ProductKind.INT4, q4.out_features, 0, q4.group]
    if panels is not None:
        tensors = [panels.packed, _NONE, bias, _NONE, _NONE, _NONE]
        return tensors, [ProductKind.BF16_PANELS, panels.out_features, int(plan.bf16_out), 0]
    return None


def _layer_args(
    layer: StackLayer,
) -> Optional[tuple[list[torch.Tensor], list[int], list[float]]]:
    """``add_layer``'s arguments for ``layer`` (the order ``cpu_decode_stack.cpp`` reads)."""
    norm_in, norm_post = kernel_norm(layer.norm_in), kernel_norm(layer.norm_post)
    sizes = list(layer.qkv_sizes)
    if norm_in is None or norm_post is None or len(sizes) != 3 or sizes[1] != sizes[2]:
        return None
    tensors, ints = [norm_in[0], norm_post[0]], []
    for plan in (layer.qkv, layer.o, layer.gate_up, layer.down):
        product = _product(plan)
        if product is None:
            return None
        tensors += product[0]
        ints += product[1]
    ints += [sizes[0], sizes[1], int(layer.window or 0)]
    return tensors, ints, [norm_in[1], norm_post[1], float(layer.scaling)]


# What ``phase_times`` reports, in the kernel's order (cpu_decode_stack.cpp's Timed).
PHASES = (
    "prepare",  # the norms, and the products' inputs quantized (or rounded to bf16)
    "qkv",
    "rotary_store",
    "attention",
    "o",
    "gate_up",
    "activation",
    "down",
)


class DecodeStack:
    """``run(hidden [T, H], cos, sin, key_caches, value_caches, rows)`` -> hidden after the
    last layer (updated in place)."""

    def __init__(self, native: Any) -> None:
        self.native = native
        # the cache lists bound to the native stack (an engine's are one list for its life)
        self._bound: Optional[tuple[list, list]] = None

    def tune(self, tasks_per_thread: int = 4, prefetch_lines: int = 8, spins: int = 20_000) -> None:
        """How a step's region splits its products and waits (benchmarks; the defaults are the
        kernel's)."""
        self.native.tune(tasks_per_thread, prefetch_lines, spins)

    def time_phases(self, on: bool) -> None:
        """Sum where a step's time goes (``phase_times``) from now on (benchmarks)."""
        self.native.time_phases(on)

    def phase_times(self) -> dict[str, float]:
        """Seconds spent in each kind of phase of the steps run as one region since the last
        call (the region's first thread's view, its waits included)."""
        return dict(zip(PHASES, self.native.phase_times()))

    @classmethod
    def build(
        cls, layers: Sequence[StackLayer], heads: int, kv_heads: int, head_dim: int
    ) -> Optional["DecodeStack"]:
        """The stack for ``layers``, or None where one of them is not the kind it runs (or
        the compiled kernels are not loaded)."""
        if not layers or not kernels.load():
            return None
        args = [_layer_args(layer) for layer in layers]
        if any(a is None for a in args):
            return None
        native = torch.classes.slipstream_cpu.DecodeStack(heads, kv_heads, head_dim)
        for a in args:
            assert a is not None  # excluded above
            native.add_layer(*a)
        return cls(native)

    def run(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        key_caches: list[torch.Tensor],
        value_caches: list[torch.Tensor],
        rows: DecodeStep,
    ) -> torch.Tensor:
        store_rows = _NONE if rows.store_rows is None else rows.store_rows
        d = rows.decode
        bound = self._bound
        if bound is None or bound[0] is not key_caches or bound[1] is not value_caches:
            self.native.bind_caches(key_caches, value_caches)
            self._bound = (key_caches, value_caches)
        torch.ops.slipstream_cpu.decode_stack_run(
            self.native,
            hidden,
            cos,
            sin,
            [],  # the bound caches
            [],
            store_rows,
            rows.store_slots,
            d.tables,
            d.seq_lens,
            d.rows,
        )
        return hidden
