"""What rank 0 tells the other ranks once per step: the packed batch its runner made (token
ids, positions, the attention metadata, the logits rows it keeps) and the KV block copies
made since the last step, as one msgpack message (msgspec).

The other ranks hold no requests and no scheduler: each rebuilds the same ``StepBatch`` from
the plan and runs it through its share of the model, its KV cache laid out by the same block
tables (every rank has as many blocks as the others, each holding its own KV heads).
"""

from __future__ import annotations

import enum
from typing import Optional

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
    """A host tensor as its dtype, shape and bytes."""

    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "WireArray":
        array = np.ascontiguousarray(tensor.detach().cpu().numpy())
        return cls(array.dtype.str, list(array.shape), array.tobytes())

    def tensor(self, device: torch.device) -> torch.Tensor:
        array = np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)
        return torch.from_numpy(array.copy()).to(device)


class StepPlan(msgspec.Struct, array_like=True):
    kind: PlanKind
    input_ids: Optional[WireArray] = None
    positions: Optional[WireArray] = None
    slot_mapping: Optional[WireArray] = None
    cu_seqlens_q: Optional[WireArray] = None
    seq_lens: Optional[WireArray] = None
    block_tables: Optional[WireArray] = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    block_size: int = 0
    query_lens: list[int] = []
    seq_lens_host: list[int] = []
    verify: list[bool] = []
    prompt: list[bool] = []
    rows: list[int] = []  # the logits rows rank 0 keeps (sampled, then prompt-logprob rows)
    # (source, destination) KV blocks to copy before this step's forward, in order
    block_copies: list[tuple[int, int]] = []

    @classmethod
    def bare(cls, kind: PlanKind) -> "StepPlan":
        """A plan without a batch (STOP, PING)."""
        return cls(kind)

    @classmethod
    def of_batch(cls, batch: StepBatch, block_copies: list[tuple[int, int]]) -> "StepPlan":
        meta = batch.meta
        rows = [r for rows in batch.sample_rows for r in rows]
        rows += [r for rows in batch.prompt_rows or [] for r in rows]
        return cls(
            PlanKind.STEP,
            WireArray.of(batch.input_ids),
            WireArray.of(batch.positions),
            WireArray.of(meta.slot_mapping),
            WireArray.of(meta.cu_seqlens_q),
            WireArray.of(meta.seq_lens),
            WireArray.of(meta.block_tables),
            meta.max_seqlen_q,
            meta.max_seqlen_k,
            meta.block_size,
            list(meta.query_lens_host),
            list(meta.seq_lens_host),
            list(meta.verify_host),
            list(meta.prompt_host),
            rows,
            block_copies,
        )

    def batch(self, device: torch.device) -> StepBatch:
        """The batch rank 0 runs, on ``device``: its rows kept as one request's."""
        arrays = (
            self.input_ids,
            self.positions,
            self.slot_mapping,
            self.cu_seqlens_q,
            self.seq_lens,
            self.block_tables,
        )
        if any(a is None for a in arrays):
            raise ValueError("a step plan without its batch")
        ids, pos, slots, cu, lens, tables = (a.tensor(device) for a in arrays if a is not None)
        meta = AttentionMetadata(
            slot_mapping=slots,
            cu_seqlens_q=cu,
            seq_lens=lens,
            block_tables=tables,
            max_seqlen_q=self.max_seqlen_q,
            max_seqlen_k=self.max_seqlen_k,
            block_size=self.block_size,
            query_lens_host=self.query_lens,
            seq_lens_host=self.seq_lens_host,
            verify_host=self.verify,
            prompt_host=self.prompt,
        )
        keep = torch.tensor(self.rows or [0], dtype=torch.long, device=device)
        return StepBatch(ids, pos, meta, [self.rows], keep)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(StepPlan)


def encode(plan: StepPlan) -> bytes:
    return _ENCODER.encode(plan)


def decode(message: bytes) -> StepPlan:
    return _DECODER.decode(message)
