"""Paged attention in plain torch: the CPU path and the reference the kernels are tested against.

Cache layout, per layer: ``key_cache`` and ``value_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``.

A step's layout (which rows decode, how decode sequences group by length, each prefill
chunk's causal mask) is the same in every layer, so it is worked out once per step as a
``StepPlan`` (``plan``, which the model runner calls) kept on the step's metadata; each
layer then only gathers its K/V and runs the fused attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from slipstream.worker.attention.layer import AttentionLayer
from slipstream.worker.attention.metadata import AttentionMetadata, AttentionPlan


# ---------------------------------------------------------------------------- the step plan
@dataclass
class _Masks:
    """Causal (and sliding-window) masks of one attention call, by window: models such as
    Gemma2 alternate windowed and global layers within one step."""

    q_pos: torch.Tensor  # broadcasts against k_pos
    k_pos: torch.Tensor
    seq_len: torch.Tensor
    by_window: dict = field(default_factory=dict)
    additive_by_key: dict = field(default_factory=dict)

    def get(self, sliding_window: Optional[int]) -> torch.Tensor:
        window = sliding_window or 0
        mask = self.by_window.get(window)
        if mask is None:
            mask = _allowed(self.q_pos, self.k_pos, self.seq_len, sliding_window)
            self.by_window[window] = mask
        return mask

    def additive(self, sliding_window: Optional[int], dtype: torch.dtype) -> torch.Tensor:
        """The mask as SDPA adds it (0 or -inf): SDPA converts a boolean mask so in every
        call, i.e. in every layer (~30 ms of a 2,048-token prefill step); once a step here."""
        key = (sliding_window or 0, dtype)
        mask = self.additive_by_key.get(key)
        if mask is None:
            allowed = self.get(sliding_window)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            mask.masked_fill_(~allowed, float("-inf"))
            self.additive_by_key[key] = mask
        return mask


@dataclass
class _DecodeGroup:
    """Decode sequences of similar length, padded together to their table's width."""

    rows: Optional[torch.Tensor]  # their rows in the caller's query; None = all, in order
    tables: torch.Tensor  # [g, num_blocks]
    masks: _Masks


@dataclass
class _PrefillChunk:
    """One sequence's multi-token chunk: query rows ``start:start+q_len`` attend to its
    ``seq_len`` context tokens (cached prefix, earlier chunks and the chunk itself)."""

    start: int
    q_len: int
    seq_len: int
    table: torch.Tensor  # [1, num_blocks]
    masks: _Masks


@dataclass
class StepPlan(AttentionPlan):
    decode: list[_DecodeGroup]
    prefill: list[_PrefillChunk]


def _allowed(
    q_pos: torch.Tensor, k_pos: torch.Tensor, seq_len: torch.Tensor, sliding_window: Optional[int]
) -> torch.Tensor:
    ok = (k_pos <= q_pos) & (k_pos < seq_len)
    if sliding_window:
        ok &= k_pos > q_pos - sliding_window
    return ok


# A decode group gathers its K (and V) into one buffer of at most this many bytes. glibc
# serves requests over 32 MiB with fresh mmap'd pages, page-faulted in on every layer: a
# SmolLM2 decode step at batch 48 and ~1000 tokens of context (one 36 MiB group) took 1.1 s,
# in groups of at most 8 MiB 0.47 s; smaller groups gained nothing more (2 MiB: 0.5 s).
MAX_GATHER_BYTES = 8 << 20


def length_groups(
    seq_lens: list[int],
    block_size: int,
    slack: float = 1.25,
    max_group_blocks: Optional[int] = None,
) -> list[list[int]]:
    """Split decode sequences into groups of similar length (indices sorted by length), so
    that padding every sequence of a group to its longest wastes at most ``slack``, and a
    group's padded size stays within ``max_group_blocks`` blocks where one is given."""
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    groups: list = []
    current: list = []
    blocks_sum = 0
    for i in order:
        nb = -(-seq_lens[i] // block_size)
        padded = (len(current) + 1) * nb
        # +2 blocks per group: tiny groups cost more in per-call overhead than in padding.
        too_padded = padded > slack * (blocks_sum + nb) + 2
        too_big = max_group_blocks is not None and padded > max_group_blocks
        if current and (too_padded or too_big):
            groups.append(current)
            current, blocks_sum = [], 0
        current.append(i)
        blocks_sum += nb
    if current:
        groups.append(current)
    return groups


def _decode_groups(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_host: list,
    block_size: int,
    block_bytes: int,
    rows: Optional[list] = None,
) -> list:
    """Groups of the decode sequences ``0..len(seq_lens_host)-1`` of ``block_tables``;
    ``rows[i]`` is sequence i's query row (default: row i); ``block_bytes``: one cache block's
    size in one of K or V."""
    device = block_tables.device
    cap = max(1, MAX_GATHER_BYTES // block_bytes)
    groups = (
        length_groups(seq_lens_host, block_size, max_group_blocks=cap) if seq_lens_host else [None]
    )
    out = []
    for group in groups:
        if group is None or (len(groups) == 1 and rows is None):
            idx, tables, lens = None, block_tables, seq_lens
            longest = max(seq_lens_host) if seq_lens_host else int(seq_lens.max())
        else:
            seqs = torch.tensor(group, device=device)
            tables, lens = block_tables[seqs], seq_lens[seqs]
            idx = seqs if rows is None else torch.tensor([rows[i] for i in group], device=device)
            longest = seq_lens_host[group[-1]]
        nb = -(-longest // block_size)
        lens4 = lens.view(-1, 1, 1, 1).long()
        k_pos = torch.arange(nb * block_size, device=device).view(1, 1, 1, -1)
        out.append(_DecodeGroup(idx, tables[:, :nb], _Masks(lens4 - 1, k_pos, lens4)))
    return out


def prefill_chunk(
    start: int, q_len: int, seq_len: int, table: torch.Tensor, group: int, block_size: int
) -> _PrefillChunk:
    device = table.device
    # query rows are ordered (query head of the KV head, token): positions repeat per head
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device).repeat(group).view(1, 1, -1, 1)
    k_pos = torch.arange(seq_len, device=device).view(1, 1, 1, -1)
    nb = -(-seq_len // block_size)
    return _PrefillChunk(
        start,
        q_len,
        seq_len,
        table[:, :nb],
        _Masks(q_pos, k_pos, torch.tensor(seq_len, device=device)),
    )


def _block_bytes(cache: torch.Tensor) -> int:
    return cache[0].numel() * cache.element_size()


def build_plan(meta: AttentionMetadata, key_cache: torch.Tensor, group: int) -> StepPlan:
    """``group``: query heads per KV head."""
    q_lens, seq_lens = meta.query_lens_host, meta.seq_lens_host
    block_size, block_bytes = key_cache.shape[1], _block_bytes(key_cache)
    store_rows, store_slots = _valid_rows(meta.slot_mapping)
    if meta.decode_only:
        return StepPlan(
            store_rows,
            store_slots,
            _decode_groups(meta.block_tables, meta.seq_lens, seq_lens, block_size, block_bytes),
            [],
        )
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    dec = [i for i, n in enumerate(q_lens) if n == 1]
    decode = []
    if dec:
        seqs = torch.tensor(dec, device=meta.block_tables.device)
        decode = _decode_groups(
            meta.block_tables[seqs],
            meta.seq_lens[seqs],
            [seq_lens[i] for i in dec],
            block_size,
            block_bytes,
            rows=[starts[i] for i in dec],
        )
    prefill = [
        prefill_chunk(starts[i], n, seq_lens[i], meta.block_tables[i : i + 1], group, block_size)
        for i, n in enumerate(q_lens)
        if n > 1
    ]
    return StepPlan(store_rows, store_slots, decode, prefill)


def plan(meta: AttentionMetadata, key_cache: torch.Tensor, num_query_heads: int) -> StepPlan:
    """``AttentionOps.plan``: the decode length groups, prefill chunks and stored rows."""
    return build_plan(meta, key_cache, num_query_heads // key_cache.shape[2])


def plan_for(meta: AttentionMetadata, key_cache: torch.Tensor, group: int) -> StepPlan:
    """The step's plan: the runner's, or for a caller that planned none (tests, tools) one
    made now and kept for the step's other layers."""
    if meta.plan is None:
        meta.plan = build_plan(meta, key_cache, group)
    if isinstance(meta.plan, StepPlan):
        return meta.plan
    return build_plan(meta, key_cache, group)  # another module's plan: not ours to replace


def stored_rows(meta: AttentionMetadata) -> tuple:
    """(rows with a slot or None for all, their slots): from the step's plan when made."""
    if meta.plan is not None:
        return meta.plan.store_rows, meta.plan.store_slots
    return _valid_rows(meta.slot_mapping)


# ---------------------------------------------------------------------------- the operators
def _valid_rows(slot_mapping: torch.Tensor) -> tuple:
    """(rows with a slot, their slots); rows is None when every row has one."""
    keep = slot_mapping >= 0
    if bool(keep.all()):
        return None, slot_mapping
    rows = keep.nonzero().flatten()
    return rows, slot_mapping[rows]


def store_kv(
    key: torch.Tensor, value: torch.Tensor, layer: AttentionLayer, slot_mapping: torch.Tensor
) -> None:
    """Write new ``[T, Hkv, D]`` keys/values into their cache slots; slot -1 is skipped."""
    rows, slots = _valid_rows(slot_mapping)
    _write_kv(key, value, layer, rows, slots)


def _write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    layer: AttentionLayer,
    rows: Optional[torch.Tensor],
    slots: torch.Tensor,
) -> None:
    """Rows ``rows`` of key/value (None: every row) into cache slots ``slots``."""
    key_cache, value_cache = layer.key_cache, layer.value_cache
    num_blocks, block_size = key_cache.shape[:2]
    flat_k = key_cache.view(num_blocks * block_size, *key_cache.shape[2:])
    flat_v = value_cache.view(num_blocks * block_size, *value_cache.shape[2:])
    if rows is not None:
        key, value = key[rows], value[rows]
    flat_k.index_copy_(0, slots, key.to(flat_k.dtype))
    flat_v.index_copy_(0, slots, value.to(flat_v.dtype))


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masks: _Masks, layer: AttentionLayer
) -> torch.Tensor:
    """q [B, Hkv, R, D] (R rows: the query heads of a KV head, times the tokens) against
    k/v [B, Hkv, L, D] of any strides; ``masks`` broadcast to the [B, Hkv, R, L] scores."""
    if not layer.softcap:
        # The fused CPU kernel reads the gathered K/V in place and never materialises the
        # scores: ~3x faster than matmul + softmax here. It has no softcap, hence the fallback.
        k, v = k.to(q.dtype), v.to(q.dtype)
        mask = masks.additive(layer.sliding_window, q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scale)
    allowed = masks.get(layer.sliding_window)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * layer.scale
    scores = torch.tanh(scores / layer.softcap) * layer.softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """[B, nb] block ids -> [B, nb*block_size, Hkv, D] (invalid ids read block 0, masked later)."""
    b, nb = blocks.shape
    # index_select copies whole blocks ~3x faster than advanced indexing on CPU.
    picked = cache.index_select(0, blocks.clamp(min=0).reshape(-1).long())
    return picked.view(b, nb * cache.shape[1], *cache.shape[2:])


def _run_decode_group(
    query: torch.Tensor, layer: AttentionLayer, grp: _DecodeGroup
) -> torch.Tensor:
    """``query`` [g, H, D], the group's rows -> [g, H, D]."""
    b, h, d = query.shape
    hkv = layer.key_cache.shape[2]
    # Views, not copies: [B, L, Hkv, D] gathered -> [B, Hkv, L, D] strided.
    k = _gather(layer.key_cache, grp.tables).transpose(1, 2)
    v = _gather(layer.value_cache, grp.tables).transpose(1, 2)
    q = query.view(b, hkv, h // hkv, d)  # the G query heads of a KV head as G query rows
    out = _attend(q, k, v, grp.masks, layer)
    return out.reshape(b, h, d).to(query.dtype)


def _run_decode(
    query: torch.Tensor, layer: AttentionLayer, groups: list, out: torch.Tensor
) -> None:
    """Decode rows of ``query`` ([T, H, D]) into the same rows of ``out``."""
    for grp in groups:
        if grp.rows is None:
            out[:] = _run_decode_group(query, layer, grp)
        else:
            out[grp.rows] = _run_decode_group(query[grp.rows], layer, grp)


def run_prefill(
    query: torch.Tensor, layer: AttentionLayer, chunk: _PrefillChunk, out: torch.Tensor
) -> None:
    h, d = query.shape[1:]
    hkv = layer.key_cache.shape[2]
    s, n, seq_len = chunk.start, chunk.q_len, chunk.seq_len
    k = _gather(layer.key_cache, chunk.table)[:, :seq_len].transpose(1, 2)
    v = _gather(layer.value_cache, chunk.table)[:, :seq_len].transpose(1, 2)
    q = query[s : s + n].view(n, hkv, h // hkv, d).permute(1, 2, 0, 3)
    q = q.reshape(1, hkv, -1, d)  # rows ordered (group, token)
    o = _attend(q, k, v, chunk.masks, layer)  # [1, Hkv, G*n, D]
    out[s : s + n] = o.view(hkv, h // hkv, n, d).permute(2, 0, 1, 3).reshape(n, h, d).to(out.dtype)


def paged_decode_attention(
    query: torch.Tensor,
    layer: AttentionLayer,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_host: Optional[list] = None,
) -> torch.Tensor:
    """One query token per sequence: query ``[B, H, D]`` -> ``[B, H, D]``. With host lengths,
    sequences of very different lengths run in groups instead of all padded to the longest."""
    key_cache = layer.key_cache
    groups = _decode_groups(
        block_tables, seq_lens, seq_lens_host or [], key_cache.shape[1], _block_bytes(key_cache)
    )
    out = torch.empty_like(query)
    _run_decode(query, layer, groups, out)
    return out


def paged_prefill_attention(
    query: torch.Tensor, layer: AttentionLayer, meta: AttentionMetadata
) -> torch.Tensor:
    """Ragged causal attention, every sequence as a prefill chunk: query ``[T, H, D]``;
    sequence i's rows attend to its cached context (prefix-cache hits and earlier chunks) and
    to its own new tokens, causally."""
    group = query.shape[1] // layer.key_cache.shape[2]
    out = torch.empty_like(query)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        table = meta.block_tables[i : i + 1]
        chunk = prefill_chunk(start, q_len, seq_len, table, group, layer.key_cache.shape[1])
        run_prefill(query, layer, chunk, out)
        start += q_len
    return out


def paged_attention(
    query: torch.Tensor, layer: AttentionLayer, meta: AttentionMetadata
) -> torch.Tensor:
    """A ragged step: the single-token (decode) sequences run batched, in length groups;
    each multi-token (prefill) chunk runs on its own."""
    step_plan = plan_for(meta, layer.key_cache, query.shape[1] // layer.key_cache.shape[2])
    return run_plan(query, layer, step_plan)


def run_plan(query: torch.Tensor, layer: AttentionLayer, step_plan: StepPlan) -> torch.Tensor:
    """``paged_attention`` with the step's plan in hand."""
    out = torch.empty_like(query)
    _run_decode(query, layer, step_plan.decode, out)
    for chunk in step_plan.prefill:
        run_prefill(query, layer, chunk, out)
    return out


def store_step_kv(
    key: torch.Tensor, value: torch.Tensor, layer: AttentionLayer, meta: AttentionMetadata
) -> None:
    """``store_kv`` with the step's valid rows (slot != -1) worked out once for all layers (a
    check per layer was 30 host round trips a step)."""
    rows, slots = stored_rows(meta)
    _write_kv(key, value, layer, rows, slots)
