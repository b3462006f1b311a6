"""The torch attention path: grouping decode sequences by length changes nothing but speed."""

import pytest
import torch

from slipstream.worker.attention import torch_backend as torch_ops
from slipstream.worker.attention.layer import AttentionLayer
from attention_support import mixed_step, paged_cache, reference_attention


def test_length_groups_bound_padding_and_cover_every_sequence():
    lens = [5, 300, 17, 16, 280, 33, 1, 64, 65, 299]
    groups = torch_ops.length_groups(lens, block_size=16)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    assert len(groups) > 1  # 1-block and 19-block sequences are not padded together
    for g in groups:
        nbs = [-(-lens[i] // 16) for i in g]
        assert nbs == sorted(nbs)
        assert len(g) * max(nbs) <= 1.25 * sum(nbs) + 2


def test_length_groups_keep_each_gather_under_the_cap():
    lens = [300 + i for i in range(40)]  # alike: one group without a cap
    assert len(torch_ops.length_groups(lens, block_size=16)) == 1
    groups = torch_ops.length_groups(lens, block_size=16, max_group_blocks=60)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    assert all(len(g) * -(-lens[g[-1]] // 16) <= 60 for g in groups)
    # a sequence larger than the cap still gets a group of its own
    assert torch_ops.length_groups([5000, 10], block_size=16, max_group_blocks=60) == [[1], [0]]


def test_grouped_decode_equals_padded_decode():
    torch.manual_seed(0)
    bs, hkv, h, d = 4, 2, 6, 8
    lens = [1, 3, 40, 41, 7, 90, 2, 88]
    tables, kc, vc = paged_cache(lens, bs, hkv, d)
    q = torch.randn(len(lens), h, d)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    for kw in ({}, {"sliding_window": 9}, {"softcap": 5.0}):
        layer = AttentionLayer(kc, vc, 0.3, **kw)
        padded = torch_ops.paged_decode_attention(q, layer, tables, seq_lens)
        grouped = torch_ops.paged_decode_attention(q, layer, tables, seq_lens, seq_lens_host=lens)
        torch.testing.assert_close(grouped, padded, rtol=1e-5, atol=1e-6)
        small = kc[0].numel() * kc.element_size() * 30  # gathers of at most 30 blocks
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch_ops, "MAX_GATHER_BYTES", small)
            capped = torch_ops.paged_decode_attention(
                q, layer, tables, seq_lens, seq_lens_host=lens
            )
        torch.testing.assert_close(capped, padded, rtol=1e-5, atol=1e-6)
        # and both equal a per-sequence softmax over exactly the visible keys
        for i, n in enumerate(lens):
            blocks = tables[i, : -(-n // bs)].long()
            k = kc[blocks].reshape(-1, hkv, d)[:n].repeat_interleave(h // hkv, 1)
            v = vc[blocks].reshape(-1, hkv, d)[:n].repeat_interleave(h // hkv, 1)
            s = torch.einsum("hd,lhd->hl", q[i], k) * 0.3
            if "softcap" in kw:
                s = torch.tanh(s / 5.0) * 5.0
            if "sliding_window" in kw:
                s[:, : max(n - 9, 0)] = float("-inf")
            ref = torch.einsum("hl,lhd->hd", s.softmax(-1), v)
            torch.testing.assert_close(grouped[i], ref, rtol=1e-5, atol=1e-5)


def test_one_step_plan_serves_every_layer_of_a_mixed_step():
    """Decode rows of different lengths (several length groups) and prefill chunks with
    cached context share one plan; layers with and without a window or softcap (Gemma2
    alternates them) each get their own masks from it."""
    torch.manual_seed(1)
    bs, hkv, h, d = 4, 2, 6, 8
    q_lens = [1, 5, 1, 1, 9, 1]
    seq_lens = [3, 12, 60, 2, 9, 33]
    tables, kc, vc, meta = mixed_step(q_lens, seq_lens, bs, hkv, d)
    for layer, kw in enumerate(
        ({}, {"sliding_window": 7}, {}, {"softcap": 3.0}, {"sliding_window": 7, "softcap": 3.0})
    ):
        q = torch.randn(sum(q_lens), h, d)
        got = torch_ops.paged_attention(q, AttentionLayer(kc, vc, 0.4, **kw), meta)
        want = reference_attention(
            q, kc, vc, tables, q_lens, seq_lens, 0.4, kw.get("sliding_window"), kw.get("softcap")
        )
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"layer {layer} {kw}")
    plan = meta.plan
    assert len(plan.decode) > 1 and len(plan.prefill) == 2
