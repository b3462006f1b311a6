"""The torch attention path: grouping decode sequences by length changes nothing but speed."""
import torch

from slipstream.ops import torch_ops


def test_length_groups_bound_padding_and_cover_every_sequence():
    lens = [5, 300, 17, 16, 280, 33, 1, 64, 65, 299]
    groups = torch_ops.length_groups(lens, block_size=16)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    assert len(groups) > 1  # 1-block and 19-block sequences are not padded together
    for g in groups:
        nbs = [-(-lens[i] // 16) for i in g]
        assert nbs == sorted(nbs)
        assert len(g) * max(nbs) <= 1.25 * sum(nbs) + 2


def test_grouped_decode_equals_padded_decode():
    torch.manual_seed(0)
    bs, hkv, h, d = 4, 2, 6, 8
    lens = [1, 3, 40, 41, 7, 90, 2, 88]
    tables = torch.full((len(lens), 23), -1, dtype=torch.int32)
    nxt = 1
    for i, n in enumerate(lens):
        for j in range(-(-n // bs)):
            tables[i, j], nxt = nxt, nxt + 1
    kc, vc = torch.randn(2, nxt, bs, hkv, d)
    q = torch.randn(len(lens), h, d)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    for kw in ({}, {"sliding_window": 9}, {"softcap": 5.0}):
        padded = torch_ops.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.3, **kw)
        grouped = torch_ops.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.3, **kw,
                                                   seq_lens_host=lens)
        torch.testing.assert_close(grouped, padded, rtol=1e-5, atol=1e-6)
        # and both equal a per-sequence softmax over exactly the visible keys
        for i, n in enumerate(lens):
            blocks = tables[i, :-(-n // bs)].long()
            k = kc[blocks].reshape(-1, hkv, d)[:n].repeat_interleave(h // hkv, 1)
            v = vc[blocks].reshape(-1, hkv, d)[:n].repeat_interleave(h // hkv, 1)
            s = torch.einsum("hd,lhd->hl", q[i], k) * 0.3
            if "softcap" in kw:
                s = torch.tanh(s / 5.0) * 5.0
            if "sliding_window" in kw:
                s[:, :max(n - 9, 0)] = float("-inf")
            ref = torch.einsum("hl,lhd->hd", s.softmax(-1), v)
            torch.testing.assert_close(grouped[i], ref, rtol=1e-5, atol=1e-5)
