"""The OpenAI Triton kernels against the torch reference: run by the Triton interpreter on CPU
(the cpu tier; tests/conftest.py sets TRITON_INTERPRET before this module imports the
kernels), compiled on the GPU in the cuda tier (``pytest --device cuda``).

Small shapes on purpose (the interpreter runs one program at a time), with tiny tiles
(block_size 4, BLOCK_N 8/16) so that a few dozen tokens still cross page, tile and split
boundaries.
"""

import pytest
import torch

pytest.importorskip("triton")

from slipstream.worker.attention import (  # noqa: E402
    torch_backend as ref,
    triton_backend as tk,
)
from slipstream.worker.attention.layer import AttentionLayer  # noqa: E402
from slipstream.worker.attention.metadata import AttentionMetadata  # noqa: E402

BLOCK_SIZE = 4
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def make_cache(num_blocks, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, BLOCK_SIZE, hkv, d, generator=g).to(dtype)
    v = torch.randn(num_blocks, BLOCK_SIZE, hkv, d, generator=g).to(dtype)
    return k, v


def make_block_tables(seq_lens, num_blocks, width=None, seed=0):
    """Each sequence gets its own pages, shuffled over the pool; rows padded with -1."""
    need = [-(-n // BLOCK_SIZE) for n in seq_lens]
    width = width or max(need)
    assert sum(need) <= num_blocks
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed + 1))
    bt = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        bt[i, :n] = perm[at : at + n].to(torch.int32)
        at += n
    return bt


def to(device, *tensors):
    return [t.to(device) for t in tensors]


def check(out, expect, dtype):
    assert out.dtype == expect.dtype and out.shape == expect.shape
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), expect.float(), **TOL[dtype])


# ----------------------------------------------------------------------------- store_kv


@pytest.mark.parametrize(
    "src_dtype,cache_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.float32, torch.float16),
        (torch.float32, torch.bfloat16),
    ],
)
def test_store_kv_matches_reference_and_skips_minus_one(src_dtype, cache_dtype, tier_device):
    t, hkv, d, nb = 7, 3, 80, 6
    g = torch.Generator().manual_seed(3)
    # Non-contiguous key/value rows (views of a packed qkv-like tensor).
    packed = torch.randn(t, 2 * hkv + 1, d, generator=g).to(src_dtype)
    key, value = packed[:, :hkv], packed[:, hkv : 2 * hkv]
    slots = torch.tensor([5, -1, 0, 23, 12, -1, 8], dtype=torch.int64)
    kc_ref, vc_ref = make_cache(nb, hkv, d, cache_dtype, seed=4)
    kc, vc = to(tier_device, kc_ref.clone(), vc_ref.clone())
    ref.store_kv(key, value, AttentionLayer(kc_ref, vc_ref, d**-0.5), slots)
    on_device = packed.to(tier_device)  # still non-contiguous views there
    dev_key, dev_value = on_device[:, :hkv], on_device[:, hkv : 2 * hkv]
    tk.store_kv(dev_key, dev_value, AttentionLayer(kc, vc, d**-0.5), slots.to(tier_device))
    kc, vc = kc.cpu(), vc.cpu()
    if src_dtype == torch.float32 and cache_dtype == torch.bfloat16:
        # The interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even): 1 ulp.
        torch.testing.assert_close(kc, kc_ref, atol=0, rtol=2**-7)
        torch.testing.assert_close(vc, vc_ref, atol=0, rtol=2**-7)
    else:
        assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    # Slots -1 wrote nothing: every other slot keeps its old contents.
    before_k, _ = make_cache(nb, hkv, d, cache_dtype, seed=4)
    written = {5, 0, 23, 12, 8}
    flat_before, flat_after = before_k.view(-1, hkv, d), kc.view(-1, hkv, d)
    for s in range(nb * BLOCK_SIZE):
        if s not in written:
            assert torch.equal(flat_before[s], flat_after[s])


# ----------------------------------------------------------------------------- decode

DECODE_CASES = [
    # (H, Hkv, D, kwargs)
    (9, 3, 64, {}),  # SmolLM2 grouping
    (4, 4, 64, {}),  # MHA
    (9, 3, 64, dict(sliding_window=6)),
    (4, 4, 80, dict(softcap=1.5)),  # head_dim padded to 128
    (8, 2, 32, dict(sliding_window=9, softcap=2.0)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,hkv,d,kw", DECODE_CASES)
def test_decode_matches_reference(h, hkv, d, kw, dtype, tier_device):
    seq_lens_list = [1, 4, 5, 17, 31]  # page/tile boundaries, a single-token context
    nb = 24
    kc, vc = make_cache(nb, hkv, d, dtype, seed=h + d)
    bt = make_block_tables(seq_lens_list, nb, width=10)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32)
    q = torch.randn(len(seq_lens_list), h, d, generator=torch.Generator().manual_seed(7)).to(dtype)
    kc, vc, bt, seq_lens, q = to(tier_device, kc, vc, bt, seq_lens, q)
    layer = AttentionLayer(kc, vc, d**-0.5, **kw)
    expect = ref.paged_decode_attention(q, layer, bt, seq_lens)
    for splits in (1, 3):  # direct store, and flash-decoding split + log-sum-exp reduce
        out = tk.paged_decode_attention(q, layer, bt, seq_lens, num_splits=splits, block_n=8)
        check(out, expect, dtype)


def test_decode_default_tiles_and_splits(tier_device):
    """The wrapper's own heuristics (no overrides) on a longer context."""
    h, hkv, d, nb = 9, 3, 64, 60
    kc, vc = make_cache(nb, hkv, d, torch.float32, seed=1)
    lens = [70, 150]
    bt = make_block_tables(lens, nb)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(2, h, d)
    kc, vc, bt, seq_lens, q = to(tier_device, kc, vc, bt, seq_lens, q)
    layer = AttentionLayer(kc, vc, 0.125)
    expect = ref.paged_decode_attention(q, layer, bt, seq_lens)
    check(tk.paged_decode_attention(q, layer, bt, seq_lens), expect, torch.float32)


def test_decode_padding_rows_are_zero_not_nan(tier_device):
    """CUDA-graph padding rows (seq_len 1, block table of -1) must give finite output even
    when the cache holds NaN garbage, and must not disturb the real rows."""
    h, hkv, d, nb = 4, 2, 32, 8
    kc, vc = make_cache(nb, hkv, d, torch.float32)
    bt = make_block_tables([6], nb, width=4)
    bt = torch.cat([bt, torch.full((2, 4), -1, dtype=torch.int32)])
    used = set(bt[0, :2].tolist())
    for blk in range(nb):  # garbage everywhere except the real sequence's pages
        if blk not in used:
            kc[blk] = float("nan")
            vc[blk] = float("nan")
    seq_lens = torch.tensor([6, 1, 1], dtype=torch.int32)
    q = torch.randn(3, h, d)
    kc, vc, bt, seq_lens, q = to(tier_device, kc, vc, bt, seq_lens, q)
    layer = AttentionLayer(kc, vc, 0.2)
    for splits in (1, 2):
        out = tk.paged_decode_attention(q, layer, bt, seq_lens, num_splits=splits, block_n=8)
        assert torch.isfinite(out).all()
        assert torch.equal(out[1:], torch.zeros_like(out[1:]))
        expect = ref.paged_decode_attention(q[:1], layer, bt[:1], seq_lens[:1])
        check(out[:1], expect, torch.float32)


# ----------------------------------------------------------------------------- prefill

# (cached prefix, new tokens): prefix-cache hits / earlier chunks, fresh prompts, a decode row.
RAGGED = [(6, 5), (0, 7), (12, 1), (3, 9), (0, 1)]
PREFILL_CASES = [
    (9, 3, 64, {}),
    (4, 4, 64, {}),
    (9, 3, 64, dict(sliding_window=4)),
    (4, 4, 80, dict(softcap=1.5)),
    (8, 2, 32, dict(sliding_window=5, softcap=2.0)),
]


def ragged_batch(h, d, dtype, seed=11):
    q_lens = [n for _, n in RAGGED]
    seq_lens_list = [c + n for c, n in RAGGED]
    q = torch.randn(sum(q_lens), h, d, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return q, q_lens, seq_lens_list


def ragged_meta(q_lens, lens, bt):
    """The step's metadata (no slots: nothing is stored) with ``bt`` as its block tables."""
    return _meta(q_lens, lens, bt, torch.zeros(sum(q_lens), dtype=torch.int64, device=bt.device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,hkv,d,kw", PREFILL_CASES)
def test_prefill_matches_reference(h, hkv, d, kw, dtype, tier_device):
    nb = 24
    kc, vc = make_cache(nb, hkv, d, dtype, seed=h * d)
    q, q_lens, lens = ragged_batch(h, d, dtype)
    bt = make_block_tables(lens, nb, width=6)
    kc, vc, q, bt = to(tier_device, kc, vc, q, bt)
    layer, meta = AttentionLayer(kc, vc, d**-0.5, **kw), ragged_meta(q_lens, lens, bt)
    expect = ref.paged_prefill_attention(q, layer, meta)
    # Tiles of 16 flattened (token, head) rows and 8 keys: several query and KV tiles per seq.
    out = tk.paged_prefill_attention(q, layer, meta, block_m=16, block_n=8)
    check(out, expect, dtype)


def test_prefill_default_tiles(tier_device):
    """The wrapper's own tile sizes (no overrides)."""
    h, hkv, d, nb = 9, 3, 64, 24
    kc, vc = make_cache(nb, hkv, d, torch.float32, seed=5)
    q, q_lens, lens = ragged_batch(h, d, torch.float32)
    bt = make_block_tables(lens, nb)
    kc, vc, q, bt = to(tier_device, kc, vc, q, bt)
    layer, meta = AttentionLayer(kc, vc, 0.125), ragged_meta(q_lens, lens, bt)
    expect = ref.paged_prefill_attention(q, layer, meta)
    check(tk.paged_prefill_attention(q, layer, meta), expect, torch.float32)


# ----------------------------------------------------------------------------- end to end


def _meta(q_lens, lens, bt, slots):
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=slots,
        cu_seqlens_q=cu.to(bt.device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=bt.device),
        block_tables=bt,
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(lens),
        block_size=BLOCK_SIZE,
        query_lens_host=list(q_lens),
        seq_lens_host=list(lens),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_then_paged_attention_steps(dtype, tier_device):
    """A mixed (chunked-prefill + decode) step, then a decode-only step, through
    ``paged_attention`` on both paths, each path writing its own cache with its own store_kv."""
    h, hkv, d, nb = 9, 3, 64, 20
    g = torch.Generator().manual_seed(21)
    caches = {
        name: to(tier_device, *make_cache(nb, hkv, d, dtype, seed=2)) for name in ("ref", "tk")
    }
    ops = {"ref": ref, "tk": tk}
    # Step 1: seq0 has 5 cached tokens and appends 6; seq1 has 9 cached and decodes 1.
    q_lens, lens = [6, 1], [11, 10]
    bt = make_block_tables(lens + [0], nb, width=5)[:2]
    slots = []
    for i, (n, total) in enumerate(zip(q_lens, lens)):
        for pos in range(total - n, total):
            slots.append(int(bt[i, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
    slots = torch.tensor(slots, dtype=torch.int64, device=tier_device)
    bt = bt.to(tier_device)
    steps = [(_meta(q_lens, lens, bt, slots), sum(q_lens))]
    # Step 2: decode-only, one new token each (seq0 crosses into its third page).
    lens2 = [12, 11]
    slots2 = torch.tensor(
        [
            int(bt[i, (n - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
            for i, n in enumerate(lens2)
        ],
        dtype=torch.int64,
        device=tier_device,
    )
    steps.append((_meta([1, 1], lens2, bt, slots2), 2))
    for meta, t in steps:
        q, k, v = to(
            tier_device,
            torch.randn(t, h, d, generator=g).to(dtype),
            torch.randn(t, hkv, d, generator=g).to(dtype),
            torch.randn(t, hkv, d, generator=g).to(dtype),
        )
        outs = {}
        for name in ("ref", "tk"):
            layer = AttentionLayer(*caches[name], d**-0.5, sliding_window=8)
            ops[name].store_kv(k, v, layer, meta.slot_mapping)
            outs[name] = ops[name].paged_attention(q, layer, meta)
        assert torch.equal(caches["tk"][0], caches["ref"][0])
        check(outs["tk"], outs["ref"], dtype)


def test_dispatch_selects_by_device(monkeypatch):
    from slipstream.worker import kernels
    from slipstream.worker.attention import cpu_backend, dispatch

    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert dispatch.get_ops(torch.device("cpu")) is (cpu_backend if kernels.load() else ref)
    assert dispatch.get_ops(torch.device("cuda")) is tk  # triton imports here
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    assert dispatch.get_ops(torch.device("cuda")) is ref
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    assert dispatch.get_ops(torch.device("cpu")) is tk
    monkeypatch.setenv(dispatch.ENV_VAR, "bogus")
    with pytest.raises(ValueError):
        dispatch.get_ops("cpu")
