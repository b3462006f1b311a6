"""What one ragged forward step tells the attention operators."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class DecodeRows:
    """A step's decode-kernel rows (same in every layer): decode rows and every token of a
    verification chunk, each attending to its sequence's context up to and including itself."""

    rows: torch.Tensor  # [n] int64: their rows in the step's query
    tables: torch.Tensor  # [n, max_blocks] int32
    seq_lens: torch.Tensor  # [n] int32: the context each row sees


@dataclass(frozen=True)
class DecodeStep:
    """A step whose every row is a decode-kernel row (no prompt chunk): what the compiled
    decode stack (``model/decode_stack``) reads besides the hidden state."""

    decode: DecodeRows
    store_rows: Optional[torch.Tensor]  # the rows whose K/V is stored (None: every row)
    store_slots: torch.Tensor


@dataclass
class AttentionPlan:
    """What an ops module works out once per step from its metadata (each module extends
    it with its own layout: length groups, masks, kernel rows)."""

    store_rows: Optional[torch.Tensor]  # the rows whose K/V is stored (None: every row)
    store_slots: torch.Tensor  # their slots

    def decode_step(self) -> Optional[DecodeStep]:
        """The step as the compiled CPU decode stack runs it, where the backend has one and
        every row is a decode row; None here (the torch and Triton backends)."""
        return None


@dataclass
class AttentionMetadata:
    """A step packs B sequences' new tokens into one flat batch of T tokens.

    Sequence i owns query rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``; after this step its
    context holds ``seq_lens[i]`` tokens, the last ``q_len`` of which are the new ones,
    stored at ``slot_mapping`` (flat slot = block * block_size + offset, -1 = skip).
    """

    slot_mapping: torch.Tensor  # [T] int64
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with -1
    max_seqlen_q: int
    max_seqlen_k: int
    block_size: int
    # Host copies used by the torch path to split work without device syncs.
    query_lens_host: list[int]
    seq_lens_host: list[int]
    # verify_host[i]: sequence i's new tokens are its last decoded token and its drafts
    # (speculative verification), not a prompt chunk; empty = none are.
    verify_host: list[bool] = field(default_factory=list)
    # prompt_host[i]: sequence i's new tokens start inside its prompt (a prompt chunk, of any
    # length, one token included); empty = unknown: chunks of more than one token that are
    # not verification chunks count as prompt chunks.
    prompt_host: list[bool] = field(default_factory=list)
    # What the ops module worked out for this step (``AttentionOps.plan``, called once per
    # step by the model runner) and every layer reuses; a new metadata comes with every step.
    plan: Optional[AttentionPlan] = field(default=None, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def decode_only(self) -> bool:
        return self.max_seqlen_q == 1
