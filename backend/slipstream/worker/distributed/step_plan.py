"""What rank 0 tells the other ranks once per step: the packed batch its runner made (token
ids, positions, the attention metadata, the logits rows it keeps) and the KV block copies
made since the last step, as one msgpack message (msgspec).

The other ranks hold no requests and no scheduler: each rebuilds the same ``StepBatch`` from
the plan and runs it through its share of the model, its KV cache laid out by the same block
tables (every rank has as many blocks as the others, each holding its own KV heads).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Optional

import msgspec
import numpy as np
import torch

from slipstream.worker.attention.metadata import AttentionMetadata
from slipstream.worker.model_runner import StepBatch


class PlanKind(enum.IntEnum):
    STEP = 1  # run this batch
    STOP = 2  # the group is shutting down: exit
    PING = 3  # rank 0 is alive (sent while it has no step to run)
    JOIN = 4  # every rank has said hello: join the process group now


class WireArray(msgspec.Struct, array_like=True):
    """A host tensor as its dtype, shape and bytes: how a tensor travels (``_to_wire``)."""

    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "WireArray":
        array = np.ascontiguousarray(tensor.detach().cpu().numpy())
        return cls(array.dtype.str, list(array.shape), array.tobytes())

    def tensor(self) -> torch.Tensor:
        array = np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)
        return torch.from_numpy(array.copy())


def _to_wire(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return WireArray.of(obj)
    raise NotImplementedError(f"a step plan cannot carry a {type(obj).__name__}")


def _from_wire(kind: type, obj: Any) -> Any:
    if kind is torch.Tensor:
        return msgspec.convert(obj, WireArray).tensor()
    raise NotImplementedError(f"a step plan cannot carry a {kind.__name__}")


def _on(device: torch.device, meta: AttentionMetadata) -> AttentionMetadata:
    """``meta`` with its tensors on ``device``."""
    moved = {
        f.name: getattr(meta, f.name).to(device)
        for f in dataclasses.fields(meta)
        if isinstance(getattr(meta, f.name), torch.Tensor)
    }
    return dataclasses.replace(meta, **moved)


class StepPlan(msgspec.Struct, array_like=True):
    kind: PlanKind
    input_ids: Optional[torch.Tensor] = None
    positions: Optional[torch.Tensor] = None
    meta: Optional[AttentionMetadata] = None  # without its plan: each rank plans its own
    rows: list[int] = []  # the logits rows rank 0 keeps (sampled, then prompt-logprob rows)
    # (source, destination) KV blocks to copy before this step's forward, in order
    block_copies: list[tuple[int, int]] = []

    @classmethod
    def bare(cls, kind: PlanKind) -> "StepPlan":
        """A plan without a batch (STOP, PING)."""
        return cls(kind)

    @classmethod
    def of_batch(cls, batch: StepBatch, block_copies: list[tuple[int, int]]) -> "StepPlan":
        rows = [r for rows in batch.sample_rows for r in rows]
        rows += [r for rows in batch.prompt_rows or [] for r in rows]
        meta = dataclasses.replace(batch.meta, plan=None)
        return cls(PlanKind.STEP, batch.input_ids, batch.positions, meta, rows, block_copies)

    def batch(self, device: torch.device) -> StepBatch:
        """The batch rank 0 runs, on ``device``: its rows kept as one request's."""
        if self.input_ids is None or self.positions is None or self.meta is None:
            raise ValueError("a step plan without its batch")
        ids, pos = self.input_ids.to(device), self.positions.to(device)
        keep = torch.tensor(self.rows or [0], dtype=torch.long, device=device)
        return StepBatch(ids, pos, _on(device, self.meta), [self.rows], keep)


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_to_wire)
_DECODER = msgspec.msgpack.Decoder(StepPlan, dec_hook=_from_wire)


def encode(plan: StepPlan) -> bytes:
    return _ENCODER.encode(plan)


def decode(message: bytes) -> StepPlan:
    return _DECODER.decode(message)
