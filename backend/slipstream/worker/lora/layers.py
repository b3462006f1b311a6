"""Applying many LoRA adapters inside one ragged batch (the punica idea, in plain torch).

Each targeted linear keeps its own (possibly oneDNN-packed) forward for the base product of all
tokens, then adds the low-rank deltas: shrink ``x @ A.T`` to the rank, expand
``@ (scale * B).T`` back, accumulate in place. The runner lays each step's batch out grouped by
adapter (base-model rows first), so the adapters' rows are one slice of the batch
(``LoraMapping``), and:

* with one adapter in the step, its rows run its own A and B (two small matmuls per linear);
* with several, their rows run every adapter's A stacked (``[in, n * r]``), a 0/1 mask keeps
  each row's own adapter's columns, and the stacked B expands: still two matmuls and a
  multiply per linear, however many adapters share the step (a loop over adapters cost
  three ops per adapter per linear, and at 210 linears the op count is what a CPU step pays).

Rows without an adapter cost nothing, and a step without any costs one Python check per linear.
Wrapping the modules (rather than the forward) serves both model paths: the lean Llama
forward (``model/lean_forward.py``) and the transformers forward call the same modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from slipstream.worker.lora.adapter import LoraAdapter, load_adapter
from slipstream.worker.transfer import to_device


@dataclass
class LoraMapping:
    """One step's adapter rows: ``rows`` (a slice of the batch), and either the one ``slot``
    they all use or, with several adapters, ``mask`` [rows, n * rank] selecting each row's
    adapter in the stacked weights. ``rows`` None: no row uses an adapter."""

    rows: Optional[slice] = None
    slot: Optional[int] = None
    mask: Optional[torch.Tensor] = None


class _LoraLinear:
    """The replacement forward of one targeted linear."""

    def __init__(self, owner: "LoraLayers", base_forward, pairs: list, rank: int) -> None:
        self.owner, self.base_forward = owner, base_forward
        # per slot: (A.T [in, r], (scale*B).T [r, out]), or None where that adapter skips it
        self.pairs = pairs
        # every slot's A.T / B.T side by side, zero-padded to ``rank`` columns each
        present = next(p for p in pairs if p is not None)
        n, dtype, device = len(pairs), present[0].dtype, present[0].device
        self.a_all = torch.zeros(present[0].shape[0], n * rank, dtype=dtype, device=device)
        self.b_all = torch.zeros(n * rank, present[1].shape[1], dtype=dtype, device=device)
        for slot, pair in enumerate(pairs):
            if pair is not None:
                r = pair[0].shape[1]
                self.a_all[:, slot * rank : slot * rank + r] = pair[0]
                self.b_all[slot * rank : slot * rank + r] = pair[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_forward(x)
        step = self.owner.mapping
        if step.rows is None:
            return y
        xs = x.reshape(-1, x.shape[-1])[step.rows]
        ys = y.view(-1, y.shape[-1])[step.rows]
        if step.mask is not None:
            ys.addmm_((xs @ self.a_all).mul_(step.mask), self.b_all)
            return y
        assert step.slot is not None  # rows without a mask all use one slot
        if self.pairs[step.slot] is not None:
            a_t, b_t = self.pairs[step.slot]
            ys.addmm_(xs @ a_t, b_t)
        return y


class LoraLayers:
    """Every loaded adapter, installed into the model's linears; ``activate`` sets the
    step's rows before a forward."""

    def __init__(self, model: torch.nn.Module, adapters: list[LoraAdapter]) -> None:
        self.adapters = adapters
        self.slots = {a.name: i for i, a in enumerate(adapters)}
        self.rank = max((a.rank for a in adapters), default=0)
        self.dtype = next((w[0].dtype for a in adapters for w in a.weights.values()), None)
        self.mapping = LoraMapping()
        for name in sorted({m for a in adapters for m in a.weights}):
            module = model.get_submodule(name)
            pairs = [
                None
                if name not in a.weights
                else (a.weights[name][0].t().contiguous(), a.weights[name][1].t().contiguous())
                for a in adapters
            ]
            # An instance attribute shadows Linear.forward (as cpu_linear's packing does);
            # the forward in place now (stock or packed) computes the base product.
            module.forward = _LoraLinear(self, module.forward, pairs, self.rank)

    @property
    def names(self) -> list[str]:
        return [a.name for a in self.adapters]

    def slot_of(self, name: Optional[str]) -> Optional[int]:
        return None if name is None else self.slots[name]

    def mapping_for(
        self, spans: list[tuple[Optional[int], int, int]], device: torch.device
    ) -> LoraMapping:
        """``spans``: (slot or None, first row, row count) per request, in batch order, the
        rows with adapters contiguous (the runner's layout)."""
        used = [
            (slot, start, count) for slot, start, count in spans if slot is not None and count > 0
        ]
        if not used:
            return LoraMapping()
        first, last = used[0][1], used[-1][1] + used[-1][2]
        if sum(count for _, _, count in used) != last - first:
            raise ValueError("the rows of LoRA requests must be contiguous in the batch")
        slots = {slot for slot, _, _ in used}
        if len(slots) == 1:
            return LoraMapping(slice(first, last), slot=used[0][0])
        mask = torch.zeros(last - first, len(self.adapters) * self.rank, dtype=self.dtype)
        for slot, start, count in used:
            mask[
                start - first : start - first + count, slot * self.rank : (slot + 1) * self.rank
            ] = 1
        return LoraMapping(slice(first, last), mask=to_device(mask, device))

    def activate(self, mapping: LoraMapping) -> None:
        self.mapping = mapping

    def deactivate(self) -> None:
        self.mapping = LoraMapping()


def load_lora_layers(
    adapters: dict[str, str],
    model: torch.nn.Module,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
) -> LoraLayers:
    """``adapters``: name -> PEFT directory (``lora_modules`` / ``multi_lora.json``)."""
    loaded = [
        load_adapter(name, Path(path), model, max_rank, dtype, device)
        for name, path in adapters.items()
    ]
    return LoraLayers(model, loaded)
