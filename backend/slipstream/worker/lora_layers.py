"""Applying many LoRA adapters inside one ragged batch (the punica idea, in plain torch).

Each targeted linear keeps its own (possibly oneDNN-packed) forward for the base product of all
tokens, then adds each adapter's low-rank delta to that adapter's rows only: shrink
``x_rows @ A.T`` to the rank, expand ``@ (scale * B).T`` back, accumulate in place. The runner
lays each step's batch out grouped by adapter (a request's tokens are contiguous anyway), so
each adapter's rows are one slice (``LoraMapping``): no gather or scatter. Rows without an
adapter cost nothing, and a step without any costs one Python check per linear.

Wrapping the modules (rather than the forward) serves both model paths: the lean Llama
forward (``fast_forward.py``) and the transformers forward call the same modules.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from slipstream.worker.lora_adapter import LoraAdapter


@dataclass
class LoraMapping:
    """One step's rows per adapter slot (slot i is ``LoraLayers.adapters[i]``): one slice each,
    since the runner lays the batch out grouped by adapter."""

    groups: list[tuple[int, slice]] = field(default_factory=list)

    @classmethod
    def from_spans(cls, spans: list[tuple[Optional[int], int, int]]) -> "LoraMapping":
        """``spans``: (slot or None, first row, row count) per scheduled request."""
        runs: dict[int, list[int]] = {}
        for slot, start, count in spans:
            if slot is None or count == 0:
                continue
            run = runs.get(slot)
            if run is None:
                runs[slot] = [start, start + count]
            elif run[1] == start:
                run[1] = start + count
            else:
                raise ValueError("a LoRA adapter's rows must be contiguous in the batch")
        return cls([(slot, slice(a, b)) for slot, (a, b) in runs.items()])


class _LoraLinear:
    """The replacement forward of one targeted linear."""

    def __init__(self, owner: "LoraLayers", base_forward, weights: list) -> None:
        self.owner, self.base_forward = owner, base_forward
        # per slot: (A.T [in, r], (scale*B).T [r, out]) or None where that adapter skips it
        self.weights = weights

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_forward(x)
        groups = self.owner.mapping.groups
        if not groups:
            return y
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.view(-1, y.shape[-1])
        for slot, rows in groups:
            pair = self.weights[slot]
            if pair is None:
                continue
            a_t, b_t = pair
            y2[rows].addmm_(x2[rows] @ a_t, b_t)
        return y


class LoraLayers:
    """Every loaded adapter, installed into the model's linears; ``activate`` sets the
    step's rows per adapter before a forward."""

    def __init__(self, model: torch.nn.Module, adapters: list[LoraAdapter]) -> None:
        self.adapters = adapters
        self.slots = {a.name: i for i, a in enumerate(adapters)}
        self.mapping = LoraMapping()
        targets = sorted({m for a in adapters for m in a.weights})
        for name in targets:
            module = model.get_submodule(name)
            weights = [None if name not in a.weights else
                       (a.weights[name][0].t().contiguous(), a.weights[name][1].t().contiguous())
                       for a in adapters]
            # An instance attribute shadows Linear.forward (as cpu_linear's packing does);
            # the forward in place now (stock or packed) computes the base product.
            module.forward = _LoraLinear(self, module.forward, weights)

    @property
    def names(self) -> list[str]:
        return [a.name for a in self.adapters]

    def slot_of(self, name: Optional[str]) -> Optional[int]:
        return None if name is None else self.slots[name]

    def activate(self, mapping: LoraMapping) -> None:
        self.mapping = mapping

    def deactivate(self) -> None:
        self.mapping = LoraMapping()


def load_lora_layers(adapters: dict[str, str], model: torch.nn.Module, max_rank: int,
                     dtype: torch.dtype, device: torch.device) -> LoraLayers:
    """``adapters``: name -> PEFT directory (``lora_modules`` / ``multi_lora.json``)."""
    from pathlib import Path

    from slipstream.worker.lora_adapter import load_adapter

    loaded = [load_adapter(name, Path(path), model, max_rank, dtype, device)
              for name, path in adapters.items()]
    return LoraLayers(model, loaded)
