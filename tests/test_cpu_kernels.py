"""The compiled CPU decode kernel computes what the torch reference computes."""
import pytest
import torch

from slipstream.worker.ops import cpu_kernels, torch_ops
from test_torch_ops import _reference, mixed_step, paged_cache

pytestmark = pytest.mark.skipif(not cpu_kernels.load(),
                                reason=f"no CPU kernel: {cpu_kernels.unavailable_reason()}")


@pytest.mark.parametrize("lens", [[37], [1, 3, 40, 41, 7, 90, 2, 88]])  # fewer/more seqs than threads
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 9}, {"softcap": 5.0}])
def test_decode_kernel_equals_the_torch_path(lens, kw):
    torch.manual_seed(0)
    bs, hkv, h, d = 4, 2, 6, 8
    tables, kc, vc = paged_cache(lens, bs, hkv, d)
    q = torch.randn(len(lens), h, d)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    want = torch_ops.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.3, **kw)
    got = cpu_kernels.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.3, **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_mixed_step_decode_rows_by_kernel_prefill_by_torch():
    torch.manual_seed(1)
    bs, hkv, h, d = 4, 3, 9, 16
    q_lens = [1, 5, 1, 1, 9, 1]
    seq_lens = [3, 12, 60, 2, 9, 33]
    tables, kc, vc, meta = mixed_step(q_lens, seq_lens, bs, hkv, d)
    for kw in ({}, {"sliding_window": 7}, {"softcap": 3.0}):
        q = torch.randn(sum(q_lens), h, d)
        got = cpu_kernels.paged_attention(q, kc, vc, meta, 0.4, **kw)
        want = _reference(q, kc, vc, tables, q_lens, seq_lens, 0.4, kw.get("sliding_window"),
                          kw.get("softcap"))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=str(kw))
    plan = meta.scratch["cpu_plan"]
    assert plan.decode.rows.tolist() == [0, 6, 7, 17] and len(plan.prefill) == 2


@pytest.mark.parametrize("kw", [{}, {"sliding_window": 6}, {"softcap": 4.0}])
def test_a_verification_chunk_runs_every_token_on_the_kernel_causally(kw):
    """Speculative verification: a sequence computes its last token and its drafts at the end
    of its context; token j sees the context up to itself, not the drafts after it. A prompt
    chunk of the same length stays on the torch path."""
    torch.manual_seed(3)
    bs, hkv, h, d = 4, 3, 9, 16
    q_lens = [5, 3, 1, 5, 9]
    seq_lens = [40, 7, 19, 70, 30]
    tables, kc, vc, meta = mixed_step(q_lens, seq_lens, bs, hkv, d)
    meta.verify_host = [True, True, False, False, True]
    q = torch.randn(sum(q_lens), h, d)
    got = cpu_kernels.paged_attention(q, kc, vc, meta, 0.4, **kw)
    want = _reference(q, kc, vc, tables, q_lens, seq_lens, 0.4, kw.get("sliding_window"),
                      kw.get("softcap"))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plan = meta.scratch["cpu_plan"]
    assert [(c.start, c.q_len) for c in plan.prefill] == [(9, 5)]  # the prompt chunk
    assert plan.decode.rows.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8] + list(range(14, 23))
    assert plan.decode.seq_lens.tolist() == [36, 37, 38, 39, 40, 5, 6, 7, 19] + list(range(22, 31))


def test_a_verification_row_equals_the_decode_row_it_stands_for():
    """Batch invariance: the kernel row of draft j is computed exactly as the decode step
    that would have produced it alone computes it, bit for bit."""
    torch.manual_seed(4)
    bs, hkv, h, d = 4, 3, 9, 16
    tables, kc, vc, meta = mixed_step([4], [23], bs, hkv, d)
    meta.verify_host = [True]
    q = torch.randn(4, h, d)
    verified = cpu_kernels.paged_attention(q, kc, vc, meta, 0.4)
    for j in range(4):
        alone = cpu_kernels.paged_decode_attention(q[j:j + 1], kc, vc, tables[:1],
                                                   torch.tensor([20 + j], dtype=torch.int32), 0.4)
        assert torch.equal(verified[j], alone[0])


def test_other_dtypes_use_the_torch_path():
    torch.manual_seed(2)
    _, kc, vc, meta = mixed_step([1, 1], [5, 9], 4, 1, 8)
    kc, vc = kc.to(torch.bfloat16), vc.to(torch.bfloat16)
    q = torch.randn(2, 2, 8, dtype=torch.bfloat16)
    got = cpu_kernels.paged_attention(q, kc, vc, meta, 0.3)
    assert got.dtype == torch.bfloat16 and "cpu_plan" not in meta.scratch
