"""Paged attention in plain torch: the CPU path and the reference the kernels are tested against.

Cache layout, per layer: ``key_cache`` and ``value_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new ``[T, Hkv, D]`` keys/values into their cache slots; slot -1 is skipped."""
    num_blocks, block_size = key_cache.shape[:2]
    flat_k = key_cache.view(num_blocks * block_size, *key_cache.shape[2:])
    flat_v = value_cache.view(num_blocks * block_size, *value_cache.shape[2:])
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    flat_k.index_copy_(0, slot_mapping, key.to(flat_k.dtype))
    flat_v.index_copy_(0, slot_mapping, value.to(flat_v.dtype))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
            scale: float, softcap: Optional[float]) -> torch.Tensor:
    """q [B, Hkv, R, D] (R rows: the query heads of a KV head, times the tokens) against
    k/v [B, Hkv, L, D] of any strides; ``allowed`` broadcasts to the [B, Hkv, R, L] scores."""
    if not softcap:
        # The fused CPU kernel reads the gathered K/V in place and never materialises the
        # scores: ~3x faster than matmul + softmax here. It has no softcap, hence the fallback.
        k, v = k.to(q.dtype), v.to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """[B, nb] block ids -> [B, nb*block_size, Hkv, D] (invalid ids read block 0, masked later)."""
    b, nb = blocks.shape
    # index_select copies whole blocks ~3x faster than advanced indexing on CPU.
    picked = cache.index_select(0, blocks.clamp(min=0).reshape(-1).long())
    return picked.view(b, nb * cache.shape[1], *cache.shape[2:])


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, seq_len: torch.Tensor,
             sliding_window: Optional[int]) -> torch.Tensor:
    ok = (k_pos <= q_pos) & (k_pos < seq_len)
    if sliding_window:
        ok &= k_pos > q_pos - sliding_window
    return ok


def length_groups(seq_lens: list, block_size: int, slack: float = 1.25) -> list:
    """Split decode sequences into groups of similar length (indices sorted by length), so
    that padding every sequence of a group to its longest wastes at most ``slack``."""
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    groups: list = []
    current: list = []
    blocks_sum = 0
    for i in order:
        nb = -(-seq_lens[i] // block_size)
        # +2 blocks per group: tiny groups cost more in per-call overhead than in padding.
        if current and (len(current) + 1) * nb > slack * (blocks_sum + nb) + 2:
            groups.append(current)
            current, blocks_sum = [], 0
        current.append(i)
        blocks_sum += nb
    if current:
        groups.append(current)
    return groups


def _decode_padded(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int,
                   scale: float, sliding_window: Optional[int],
                   softcap: Optional[float]) -> torch.Tensor:
    """All sequences padded to ``num_blocks`` blocks; query ``[B, H, D]`` -> ``[B, H, D]``."""
    b, h, d = query.shape
    hkv = key_cache.shape[2]
    # Views, not copies: [B, L, Hkv, D] gathered -> [B, Hkv, L, D] strided.
    k = _gather(key_cache, block_tables[:, :num_blocks]).transpose(1, 2)
    v = _gather(value_cache, block_tables[:, :num_blocks]).transpose(1, 2)
    q = query.view(b, hkv, h // hkv, d)  # the G query heads of a KV head as G query rows
    k_pos = torch.arange(k.shape[2], device=query.device).view(1, 1, 1, -1)
    lens = seq_lens.view(b, 1, 1, 1).long()
    out = _attend(q, k, v, _allowed(lens - 1, k_pos, lens, sliding_window), scale, softcap)
    return out.reshape(b, h, d).to(query.dtype)


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           sliding_window: Optional[int] = None,
                           softcap: Optional[float] = None,
                           seq_lens_host: Optional[list] = None) -> torch.Tensor:
    """One query token per sequence: query ``[B, H, D]`` -> ``[B, H, D]``. With host lengths,
    sequences of very different lengths run in groups instead of all padded to the longest."""
    block_size = key_cache.shape[1]
    if not seq_lens_host:
        nb = -(-int(seq_lens.max()) // block_size)
        return _decode_padded(query, key_cache, value_cache, block_tables, seq_lens, nb, scale,
                              sliding_window, softcap)
    groups = length_groups(seq_lens_host, block_size)
    if len(groups) == 1:
        nb = -(-max(seq_lens_host) // block_size)
        return _decode_padded(query, key_cache, value_cache, block_tables, seq_lens, nb, scale,
                              sliding_window, softcap)
    out = torch.empty_like(query)
    for group in groups:
        idx = torch.tensor(group, device=query.device)
        nb = -(-seq_lens_host[group[-1]] // block_size)
        out[idx] = _decode_padded(query[idx], key_cache, value_cache, block_tables[idx],
                                  seq_lens[idx], nb, scale, sliding_window, softcap)
    return out


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float,
                            sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                            query_lens_host: Optional[list] = None,
                            seq_lens_host: Optional[list] = None) -> torch.Tensor:
    """Ragged causal attention: query ``[T, H, D]``; sequence i's rows attend to its cached
    context (prefix-cache hits and earlier chunks) and to its own new tokens, causally."""
    t, h, d = query.shape
    hkv = key_cache.shape[2]
    block_size = key_cache.shape[1]
    if query_lens_host is None:
        query_lens_host = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    if seq_lens_host is None:
        seq_lens_host = seq_lens.tolist()
    out = torch.empty_like(query)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(query_lens_host, seq_lens_host)):
        nb = -(-seq_len // block_size)
        k = _gather(key_cache, block_tables[i:i + 1, :nb])[:, :seq_len].transpose(1, 2)
        v = _gather(value_cache, block_tables[i:i + 1, :nb])[:, :seq_len].transpose(1, 2)
        q = query[start:start + q_len].view(q_len, hkv, h // hkv, d).permute(1, 2, 0, 3)
        q = q.reshape(1, hkv, -1, d)  # rows ordered (group, token)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        q_pos = q_pos.repeat(h // hkv).view(1, 1, -1, 1)
        k_pos = torch.arange(seq_len, device=query.device).view(1, 1, 1, -1)
        o = _attend(q, k, v, _allowed(q_pos, k_pos, torch.tensor(seq_len), sliding_window),
                    scale, softcap)  # [1, Hkv, G*q_len, D]
        o = o.view(hkv, h // hkv, q_len, d).permute(2, 0, 1, 3).reshape(q_len, h, d)
        out[start:start + q_len] = o.to(query.dtype)
        start += q_len
    return out


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, sliding_window: Optional[int] = None,
                    softcap: Optional[float] = None) -> torch.Tensor:
    """Dispatch a ragged step: single-token (decode) sequences run as one batch, the
    multi-token ones (prefill chunks) one by one; a mixed step does both."""
    if meta.decode_only:
        return paged_decode_attention(query, key_cache, value_cache, meta.block_tables,
                                      meta.seq_lens, scale, sliding_window, softcap,
                                      meta.seq_lens_host)
    q_lens = meta.query_lens_host
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    if len(decode) < 2:
        return paged_prefill_attention(query, key_cache, value_cache, meta.block_tables,
                                       meta.cu_seqlens_q, meta.seq_lens, scale, sliding_window,
                                       softcap, q_lens, meta.seq_lens_host)
    out = torch.empty_like(query)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    rows = torch.tensor([starts[i] for i in decode], device=query.device)
    seqs = torch.tensor(decode, device=query.device)
    out[rows] = paged_decode_attention(query[rows], key_cache, value_cache,
                                       meta.block_tables[seqs], meta.seq_lens[seqs], scale,
                                       sliding_window, softcap,
                                       [meta.seq_lens_host[i] for i in decode])
    for i, n in enumerate(q_lens):
        if n > 1:
            s = starts[i]
            out[s:s + n] = paged_prefill_attention(
                query[s:s + n], key_cache, value_cache, meta.block_tables[i:i + 1],
                torch.tensor([0, n], dtype=torch.int32, device=query.device), meta.seq_lens[i:i + 1], scale, sliding_window, softcap, [n],
                [meta.seq_lens_host[i]])
    return out
