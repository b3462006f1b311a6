"""The compiled CPU attention kernels (decode and prefill) compute what the torch reference
computes, and a row's result never depends on the rows computed beside it."""

import pytest
import torch

from slipstream.worker import kernels
from slipstream.worker.attention import cpu_backend, torch_backend
from slipstream.worker.attention.layer import AttentionLayer
from attention_support import mixed_step, paged_cache, reference_attention

pytestmark = pytest.mark.skipif(
    not kernels.load(), reason=f"no CPU kernel: {kernels.unavailable_reason()}"
)


@pytest.mark.parametrize(
    "lens", [[37], [1, 3, 40, 41, 7, 90, 2, 88]]
)  # fewer/more seqs than threads
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 9}, {"softcap": 5.0}])
def test_decode_kernel_equals_the_torch_path(lens, kw):
    torch.manual_seed(0)
    bs, hkv, h, d = 4, 2, 6, 8
    tables, kc, vc = paged_cache(lens, bs, hkv, d)
    q = torch.randn(len(lens), h, d)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    layer = AttentionLayer(kc, vc, 0.3, **kw)
    want = torch_backend.paged_decode_attention(q, layer, tables, seq_lens)
    got = cpu_backend.paged_decode_attention(q, layer, tables, seq_lens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("d", [16, 64, 128, 24])  # 24: no 16-wide path, the generic one
@pytest.mark.parametrize("bs", [16, 5])  # 5: tiles of 16 tokens cross blocks
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 21}, {"softcap": 5.0}])
def test_decode_kernel_tiles_equal_the_torch_path_at_every_head_size(d, bs, kw):
    """Lengths around the kernel's 16-token tiles (a partial tile, exactly one, one more),
    more sequences than threads (whole rows) and fewer (one KV head an item)."""
    torch.manual_seed(3)
    hkv, h = 3, 9
    for lens in ([1, 15, 16, 17, 40, 300, 33, 2], [70]):
        tables, kc, vc = paged_cache(lens, bs, hkv, d)
        q = torch.randn(len(lens), h, d)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        layer = AttentionLayer(kc, vc, d**-0.5, **kw)
        want = torch_backend.paged_decode_attention(q, layer, tables, seq_lens)
        got = cpu_backend.paged_decode_attention(q, layer, tables, seq_lens)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_bf16_caches_give_what_the_same_values_in_fp32_give():
    """The kernels widen bf16 exactly and sum in fp32: a bf16 cache's result is the fp32
    kernel's on the same values, bit for bit, for prompt chunks, and for decode rows unless
    the CPU has AVX512-BF16: there a decode row's q.k runs on vdpbf16ps with q rounded to
    bf16 (as vLLM's bf16 model computes it), the fp32 result on that rounded q."""
    torch.manual_seed(4)
    hkv, h, d, bs = 3, 9, 64, 16
    q_lens = [1, 1, 40, 1, 7]
    seq_lens = [33, 300, 40, 17, 90]
    tables, kc, vc, meta = mixed_step(q_lens, seq_lens, bs, hkv, d)
    kb, vb = kc.to(torch.bfloat16), vc.to(torch.bfloat16)
    q = torch.randn(sum(q_lens), h, d)
    got = cpu_backend.paged_attention(q, AttentionLayer(kb, vb, 0.125), meta)
    assert meta.plan.torch_plan is None  # the kernels ran, not the torch path
    decode = torch.tensor([0, 1, 42])  # the decode rows (q_lens 1)
    prompt = torch.ones(len(q), dtype=torch.bool)
    prompt[decode] = False
    meta.plan = None
    wide = AttentionLayer(kb.float(), vb.float(), 0.125)
    want = cpu_backend.paged_attention(q, wide, meta)
    assert torch.equal(got[prompt], want[prompt])
    if torch.ops.slipstream_cpu.decode_rounds_query_bf16():
        meta.plan = None
        rounded = cpu_backend.paged_attention(q.bfloat16().float(), wide, meta)
        assert not torch.equal(got[decode], want[decode])
        torch.testing.assert_close(got[decode], rounded[decode], rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(got[decode], want[decode])
    reference = reference_attention(q, kb.float(), vb.float(), tables, q_lens, seq_lens, 0.125)
    torch.testing.assert_close(got, reference, rtol=1e-2, atol=1e-2)


def test_mixed_step_decode_rows_by_the_decode_kernel_prompt_chunks_by_the_prefill_kernel():
    torch.manual_seed(1)
    bs, hkv, h, d = 4, 3, 9, 16
    q_lens = [1, 5, 1, 1, 9, 1]
    seq_lens = [3, 12, 60, 2, 9, 33]
    tables, kc, vc, meta = mixed_step(q_lens, seq_lens, bs, hkv, d)
    for kw in ({}, {"sliding_window": 7}, {"softcap": 3.0}):
        q = torch.randn(sum(q_lens), h, d)
        got = cpu_backend.paged_attention(q, AttentionLayer(kc, vc, 0.4, **kw), meta)
        want = reference_attention(
            q, kc, vc, tables, q_lens, seq_lens, 0.4, kw.get("sliding_window"), kw.get("softcap")
        )
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=str(kw))
    plan = meta.plan
    assert plan.decode.rows.tolist() == [0, 6, 7, 17]
    assert plan.prompts.chunks.tolist() == [[1, 5, 12], [8, 9, 9]]
    assert plan.torch_chunks is not None  # the softcapped layer's way


@pytest.mark.parametrize("kw", [{}, {"sliding_window": 6}, {"softcap": 4.0}])
def test_a_verification_chunk_runs_every_token_on_the_kernel_causally(kw):
    """Speculative verification: a sequence computes its last token and its drafts at the end
    of its context; token j sees the context up to itself, not the drafts after it. A prompt
    chunk of the same length goes to the prefill kernel."""
    torch.manual_seed(3)
    bs, hkv, h, d = 4, 3, 9, 16
    q_lens = [5, 3, 1, 5, 9]
    seq_lens = [40, 7, 19, 70, 30]
    tables, kc, vc, meta = mixed_step(q_lens, seq_lens, bs, hkv, d)
    meta.verify_host = [True, True, False, False, True]
    q = torch.randn(sum(q_lens), h, d)
    got = cpu_backend.paged_attention(q, AttentionLayer(kc, vc, 0.4, **kw), meta)
    want = reference_attention(
        q, kc, vc, tables, q_lens, seq_lens, 0.4, kw.get("sliding_window"), kw.get("softcap")
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plan = meta.plan
    assert plan.prompts.chunks.tolist() == [[9, 5, 70]]  # the prompt chunk
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
    layer = AttentionLayer(kc, vc, 0.4)
    verified = cpu_backend.paged_attention(q, layer, meta)
    for j in range(4):
        alone = cpu_backend.paged_decode_attention(
            q[j : j + 1], layer, tables[:1], torch.tensor([20 + j], dtype=torch.int32)
        )
        assert torch.equal(verified[j], alone[0])


@pytest.mark.parametrize("d", [16, 32, 64, 128])
@pytest.mark.parametrize("window", [None, 5, 40])
def test_prefill_kernel_equals_the_reference(d, window):
    """Every head size the kernel has, chunks after cached context (prefix hits, earlier
    chunks), partial row tiles and a 200-row chunk over several work items."""
    torch.manual_seed(5)
    bs, hkv, h = 16, 3, 9
    q_lens = [7, 200, 2, 33, 16]
    seq_lens = [7, 230, 90, 33, 17]
    tables, kc, vc, meta = mixed_step(q_lens, seq_lens, bs, hkv, d)
    q = torch.randn(sum(q_lens), h, d)
    got = cpu_backend.paged_attention(q, AttentionLayer(kc, vc, d**-0.5, window), meta)
    want = reference_attention(q, kc, vc, tables, q_lens, seq_lens, d**-0.5, window)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    assert meta.plan.torch_chunks is None  # all on the kernel


@pytest.mark.parametrize("window", [None, 11])
def test_a_prompt_row_is_the_same_however_the_prompt_is_chunked(window):
    """Batch invariance: a prompt's rows are bit for bit the same whether the prompt runs as
    one chunk or in chunks the step budget (or a prefix-cache hit) cut, at any offset, one
    token long included, next to other chunks."""
    torch.manual_seed(6)
    bs, hkv, h, d, n = 16, 3, 9, 64, 70
    tables, kc, vc, meta = mixed_step([n], [n], bs, hkv, d)
    q = torch.randn(n, h, d)
    layer = AttentionLayer(kc, vc, 0.125, window)
    whole = cpu_backend.paged_attention(q, layer, meta)
    # the same sequence (same blocks) cut into chunks, each beside another sequence's chunk
    other_tables, okc, ovc, _ = mixed_step([9], [9], bs, hkv, d)
    for cut in ([5, 30, 35], [3, 64, 3], [17, 53], [1, 68, 1]):
        done = 0
        for size in cut:
            table = torch.cat([tables, torch.full((1, tables.shape[1]), -1, dtype=torch.int32)])
            table[1, : other_tables.shape[1]] = other_tables[0]
            _, _, _, step = mixed_step([size, 9], [done + size, 9], bs, hkv, d)
            step.block_tables = table
            step.seq_lens = torch.tensor([done + size, 9], dtype=torch.int32)
            step.prompt_host = [True, True]
            rows = torch.cat([q[done : done + size], torch.randn(9, h, d)])
            got = cpu_backend.paged_attention(rows, layer, step)
            assert torch.equal(got[:size], whole[done : done + size]), (cut, size)
            done += size


def test_a_nan_prompt_row_stays_nan_and_harms_no_other_row():
    """A row whose query is NaN (a broken model, an overflow) comes out NaN, so the sampler
    refuses that request; the chunk's other rows and the other chunks are unchanged."""
    torch.manual_seed(7)
    bs, hkv, h, d = 16, 3, 9, 64
    tables, kc, vc, meta = mixed_step([20, 12], [20, 30], bs, hkv, d)
    q = torch.randn(32, h, d)
    layer = AttentionLayer(kc, vc, 0.125)
    clean = cpu_backend.paged_attention(q, layer, meta)
    q[25, 4] = float("nan")  # one query head of row 5 of the second chunk
    meta.plan = None
    got = cpu_backend.paged_attention(q, layer, meta)
    assert torch.isnan(got[25, 4]).all()
    others = torch.ones(32, h, dtype=torch.bool)
    others[25, 4] = False
    assert torch.equal(got[others], clean[others])


def test_other_dtypes_use_the_torch_path():
    torch.manual_seed(2)
    _, kc, vc, meta = mixed_step([1, 1], [5, 9], 4, 1, 8)
    kc, vc = kc.to(torch.bfloat16), vc.to(torch.bfloat16)
    q = torch.randn(2, 2, 8, dtype=torch.bfloat16)
    got = cpu_backend.paged_attention(q, AttentionLayer(kc, vc, 0.3), meta)
    assert got.dtype == torch.bfloat16 and isinstance(meta.plan, torch_backend.StepPlan)
