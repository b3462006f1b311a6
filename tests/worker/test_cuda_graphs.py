"""The CPU-testable half of the CUDA-graph decode runner: buckets, padding, eager fallback,
and that padding rows are inert for the Triton decode path (run by the interpreter on CPU,
compiled in the cuda tier; capture and replay themselves: tests/engine/test_cuda_tier.py)."""

import pytest
import torch

from slipstream.worker.cuda_graphs import (
    DecodeGraphRunner,
    StaticDecodeInputs,
    bucket_for,
    capture_sizes,
)


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert capture_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert capture_sizes(64, (1, 2, 4, 8, 16, 32, 64, 128, 256)) == [1, 2, 4, 8, 16, 32, 64]
    assert capture_sizes(100, (8, 1, 64, 8)) == [1, 8, 64, 100]
    assert capture_sizes(0) == []


def test_bucket_for():
    sizes = [1, 2, 4, 8, 16, 32]
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 31, 32)] == [1, 2, 4, 8, 8, 16, 32, 32]
    assert bucket_for(33, sizes) is None
    assert bucket_for(0, sizes) is None


def test_static_inputs_load_pads_and_clears_stale_rows():
    buf = StaticDecodeInputs(8, 5)
    # A larger batch first leaves real values in rows that a later, smaller batch pads.
    big = (
        torch.arange(7),
        torch.arange(7) + 100,
        torch.arange(7) + 40,
        torch.arange(21, dtype=torch.int32).view(7, 3),
        torch.full((7,), 9, dtype=torch.int32),
    )
    buf.load(8, *big)
    assert buf.slot_mapping.tolist() == [40, 41, 42, 43, 44, 45, 46, -1]
    assert buf.block_tables[6].tolist() == [18, 19, 20, -1, -1]

    ids = torch.tensor([5, 6, 7])
    bt = torch.tensor([[3, 4], [5, -1], [6, 7]], dtype=torch.int32)
    buf.load(
        4,
        ids,
        torch.tensor([17, 3, 20]),
        torch.tensor([52, 21, 99]),
        bt,
        torch.tensor([18, 4, 21], dtype=torch.int32),
    )
    ids4, pos4, slots4, bt4, lens4 = buf.view(4)
    assert ids4.tolist() == [5, 6, 7, 0]
    assert pos4.tolist() == [17, 3, 20, 0]
    assert slots4.tolist() == [52, 21, 99, -1]  # the padding row cannot write the cache
    assert lens4.tolist() == [18, 4, 21, 1]
    assert bt4.tolist() == [
        [3, 4, -1, -1, -1],
        [5, -1, -1, -1, -1],
        [6, 7, -1, -1, -1],
        [-1, -1, -1, -1, -1],
    ]  # stale columns 2.. of the big batch cleared
    # Rows past the bucket are not read by its graph and keep whatever they held.
    assert buf.slot_mapping[4:7].tolist() == [44, 45, 46]

    with pytest.raises(ValueError):
        buf.load(2, ids, ids, ids, bt, ids)  # 3 rows into a bucket of 2
    with pytest.raises(ValueError):
        buf.load(4, ids, ids, ids, torch.zeros(3, 6, dtype=torch.int32), ids)  # too wide


def test_runner_falls_back_to_eager_off_cuda():
    calls = []

    def forward(*args):
        calls.append(args)
        return torch.ones(args[0].shape[0], 11)

    runner = DecodeGraphRunner(forward, max_batch_size=8, max_blocks_per_seq=4, device="cpu")
    runner.capture()  # no-op off CUDA
    assert not runner.enabled and not runner.captured
    ids = torch.tensor([1, 2, 3])
    out = runner(ids, ids, ids, torch.zeros(3, 2, dtype=torch.int32), ids.int())
    assert out.shape == (3, 11) and calls and calls[0][0] is ids  # the caller's own tensors
    assert runner.sizes == [1, 2, 4, 8]


def test_padding_rows_are_inert_for_triton_decode(tier_device):
    """Load a 3-row batch into a bucket of 4, then store_kv + decode attention on the padded
    view: the padding row writes no slot and yields zeros, the real rows match the reference."""
    pytest.importorskip("triton")
    from slipstream.worker.attention import torch_backend as ref, triton_backend as tk
    from slipstream.worker.attention.layer import AttentionLayer

    g = torch.Generator().manual_seed(0)
    nb, bs, hkv, h, d = 10, 4, 3, 9, 32
    kc = torch.randn(nb, bs, hkv, d, generator=g)
    vc = torch.randn(nb, bs, hkv, d, generator=g)
    bt = torch.tensor([[2, 5, -1], [7, -1, -1], [0, 1, 3]], dtype=torch.int32)
    lens = torch.tensor([6, 3, 12], dtype=torch.int32)
    slots = torch.tensor(
        [int(bt[i, (n - 1) // bs]) * bs + (n - 1) % bs for i, n in enumerate(lens.tolist())]
    )
    kc, vc, bt, lens, slots = (t.to(tier_device) for t in (kc, vc, bt, lens, slots))
    buf = StaticDecodeInputs(8, 4, tier_device)
    buf.load(4, torch.tensor([1, 2, 3], device=tier_device), lens.long() - 1, slots, bt, lens)
    _, _, slots4, bt4, lens4 = buf.view(4)

    k_new = torch.randn(4, hkv, d, generator=g).to(tier_device)
    v_new = torch.randn(4, hkv, d, generator=g).to(tier_device)
    kc_t, vc_t = kc.clone(), vc.clone()
    graphed, eager = AttentionLayer(kc_t, vc_t, d**-0.5), AttentionLayer(kc, vc, d**-0.5)
    tk.store_kv(k_new, v_new, graphed, slots4)
    ref.store_kv(k_new[:3], v_new[:3], eager, slots)
    assert torch.equal(kc_t, kc) and torch.equal(vc_t, vc)

    q = torch.randn(4, h, d, generator=g).to(tier_device)
    out = tk.paged_decode_attention(q, graphed, bt4, lens4, block_n=8)
    expect = ref.paged_decode_attention(q[:3], eager, bt, lens)
    assert torch.isfinite(out).all()
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    torch.testing.assert_close(out[:3], expect, atol=2e-5, rtol=1e-5)
