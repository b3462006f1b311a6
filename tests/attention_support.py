"""Paged-attention inputs and the explicit-math reference the attention backends are checked
against (torch, the compiled CPU kernels)."""

import torch


def paged_cache(lens: list, bs: int, hkv: int, d: int) -> tuple:
    """Block tables giving each sequence its own consecutive blocks (-1 padded), and random
    K/V caches with exactly those blocks after the scratch block 0."""
    width = max(-(-n // bs) for n in lens) + 1
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)
    nxt = 1
    for i, n in enumerate(lens):
        for j in range(-(-n // bs)):
            tables[i, j], nxt = nxt, nxt + 1
    kc, vc = torch.randn(2, nxt, bs, hkv, d)
    return tables, kc, vc


def mixed_step(q_lens: list, seq_lens: list, bs: int, hkv: int, d: int) -> tuple:
    """A paged cache and the attention metadata of one step whose rows compute ``q_lens``
    tokens each at the end of ``seq_lens`` (1 = decode, more = a prefill chunk)."""
    from slipstream.worker.attention.metadata import AttentionMetadata

    tables, kc, vc = paged_cache(seq_lens, bs, hkv, d)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.long),
        cu_seqlens_q=cu,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(seq_lens),
        block_size=bs,
        query_lens_host=q_lens,
        seq_lens_host=seq_lens,
    )
    return tables, kc, vc, meta


def reference_attention(q, kc, vc, tables, q_lens, seq_lens, scale, window=None, softcap=None):
    """Per sequence, explicit math: each query row sees its context causally."""
    bs, hkv, d = kc.shape[1], kc.shape[2], kc.shape[3]
    h = q.shape[1]
    out, start = [], 0
    for i, (n, total) in enumerate(zip(q_lens, seq_lens)):
        blocks = tables[i, : -(-total // bs)].long()
        k = kc[blocks].reshape(-1, hkv, d)[:total].repeat_interleave(h // hkv, 1)
        v = vc[blocks].reshape(-1, hkv, d)[:total].repeat_interleave(h // hkv, 1)
        s = torch.einsum("thd,lhd->htl", q[start : start + n], k) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        q_pos = torch.arange(total - n, total).view(1, -1, 1)
        k_pos = torch.arange(total).view(1, 1, -1)
        ok = k_pos <= q_pos
        if window:
            ok &= k_pos > q_pos - window
        s = s.masked_fill(~ok, float("-inf"))
        out.append(torch.einsum("htl,lhd->thd", s.softmax(-1), v))
        start += n
    return torch.cat(out)
