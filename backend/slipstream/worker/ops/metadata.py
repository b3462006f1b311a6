"""What one ragged forward step tells the attention operators."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
    query_lens_host: list
    seq_lens_host: list
    # verify_host[i]: sequence i's new tokens are its last decoded token and its drafts
    # (speculative verification), not a prompt chunk; empty = none are.
    verify_host: list = field(default_factory=list)
    # prompt_host[i]: sequence i's new tokens start inside its prompt (a prompt chunk, of any
    # length, one token included); empty = unknown: chunks of more than one token that are
    # not verification chunks count as prompt chunks.
    prompt_host: list = field(default_factory=list)
    # Per-step values an operator derives once and reuses in every layer (the torch path's
    # length groups and masks); a new metadata object comes with every step.
    scratch: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def decode_only(self) -> bool:
        return self.max_seqlen_q == 1
