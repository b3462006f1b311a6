"""Paged attention as OpenAI Triton kernels: the CUDA path.

Same signatures and semantics as :mod:`slipstream.worker.attention.torch_backend` (the reference the
kernels are
tested against). Cache layout, per layer: ``key_cache`` / ``value_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``; slot = block * block_size + offset.

Kernels
-------
* ``_store_kv_kernel``: one program per new token writes its ``[Hkv, D]`` key and value rows
  into their slot (slot -1 = skip).
* ``_decode_kernel``: one program per (sequence, KV head[, split]) loads the whole GQA group of
  query heads as the M dimension of the dots, so every KV tile is read from HBM once per group.
  Online softmax over tiles of ``BLOCK_N`` tokens gathered across pages. When the batch has too
  few (sequence, KV head) pairs to fill the GPU, the context is split into ``NUM_SPLITS`` parts
  (flash-decoding) and ``_decode_reduce_kernel`` merges the partial results by their
  log-sum-exp. No host synchronisation: safe to capture in a CUDA graph.
* ``_prefill_kernel``: ragged, causal flash attention over the paged cache. One program per
  (query tile, sequence, KV head); the rows of a tile are the flattened (token, group head)
  pairs of that KV head, so GQA groups share KV loads here too. It reads the whole context
  (prefix-cache hits, earlier chunks and the new tokens, all already in the cache).

Every score and accumulator is fp32. For fp32 caches (and under ``TRITON_INTERPRET=1``, whose
bf16 arithmetic is unreliable) the tiles are converted to fp32 and the dots run in exact
("ieee") fp32; for fp16/bf16 caches on the GPU the dots take 16-bit inputs with fp32
accumulation, as flash attention does. Outputs are cast to the query dtype on store.

Masked keys (outside the context, before the sliding window, after the query position, or in a
page whose id is -1) get probability 0 and are loaded as 0, and a row with no key left (the
padding rows of a CUDA-graph batch: seq_len 1, block table of -1) yields 0, never NaN.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from slipstream.worker.attention.layer import AttentionLayer
from slipstream.worker.attention.metadata import AttentionMetadata, AttentionPlan

LOG2E = tl.constexpr(1.4426950408889634)
_NEG_INIT = tl.constexpr(
    -1.0e30
)  # finite running-max start: all-masked rows give exp2(0)*0, not NaN


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _check_caches(layer: AttentionLayer) -> None:
    # The kernels address both caches with the key cache's strides (as vLLM's do): the KV
    # cache allocates every layer's K and V as slices of one tensor.
    key_cache, value_cache = layer.key_cache, layer.value_cache
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(-1) == 1


def _check_heads(query: torch.Tensor, layer: AttentionLayer) -> None:
    assert query.shape[1] % layer.key_cache.shape[2] == 0, "query heads: a multiple of KV heads"
    _check_caches(layer)


def _scoring_and_strides(
    query: torch.Tensor, layer: AttentionLayer, block_tables: torch.Tensor, out: torch.Tensor
) -> tuple:
    """The run of arguments the decode and prefill kernels share, in their order: scale,
    softcap, window, then the strides of the query, the caches, the block table, the output."""
    return (
        float(layer.scale),
        layer.cap,
        layer.window,
        *query.stride()[:2],
        *layer.key_cache.stride()[:3],
        block_tables.stride(0),
        *out.stride()[:2],
    )


def _fp32_math(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.float32 or not cache.is_cuda or _interpreting()


@triton.jit
def _tanh(x):
    # tanh(x) = 2 * sigmoid(2x) - 1: saturates cleanly at +-1 for large |x|.
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _math_dtype(q, KC, FP32_MATH: tl.constexpr):
    """The query in the dots' input type: fp32 (exact math) or the cache's 16-bit type."""
    if FP32_MATH:
        return q.to(tl.float32)
    return q.to(KC.dtype.element_ty)


@triton.jit
def _load_kv_tile(
    KC, VC, bt_row, tok, in_seq, offs_d, d_mask, stride_cb, stride_co, BLOCK_SIZE: tl.constexpr
):
    """Keys and values of context tokens ``tok`` gathered across pages (``KC`` / ``VC`` point
    at one KV head); ``valid``: in the sequence (``in_seq``) and in a mapped page. Invalid rows
    load as 0."""
    blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=in_seq, other=-1)
    valid = in_seq & (blk >= 0)
    rows = tl.maximum(blk, 0).to(tl.int64) * stride_cb + (tok % BLOCK_SIZE) * stride_co
    kv_mask = valid[:, None] & d_mask[None, :]
    k = tl.load(KC + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(VC + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    return k, v, valid


@triton.jit
def _softmax_state(ROWS: tl.constexpr, D_PAD: tl.constexpr):
    """An online softmax's start: running max (finite, see ``_NEG_INIT``), sum and output."""
    m_i = tl.full([ROWS], _NEG_INIT, dtype=tl.float32)
    return m_i, tl.zeros([ROWS], dtype=tl.float32), tl.zeros([ROWS, D_PAD], dtype=tl.float32)


@triton.jit
def _scores(q, k, scale, softcap, USE_SOFTCAP: tl.constexpr, FP32_MATH: tl.constexpr):
    """Scaled (and soft-capped) ``q @ k^T`` in fp32."""
    if FP32_MATH:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scale
    if USE_SOFTCAP:
        s = softcap * _tanh(s / softcap)
    return s


@triton.jit
def _online_softmax_step(s, allowed, v, m_i, l_i, acc, FP32_MATH: tl.constexpr):
    """Fold one tile of scores ``s`` (masked by ``allowed``) and its values into the running
    max ``m_i`` (log2 units), denominator ``l_i`` and output ``acc``."""
    s = tl.where(allowed, s * LOG2E, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP32_MATH:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


# --------------------------------------------------------------------------------------------
# store_kv
# --------------------------------------------------------------------------------------------


@triton.jit
def _store_kv_kernel(
    K,
    V,
    KC,
    VC,
    Slots,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_co,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(Slots + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    t64 = t.to(tl.int64)
    k = tl.load(K + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    dst = blk * stride_cb + off * stride_co + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(KC + dst, k.to(KC.dtype.element_ty), mask=mask)  # no-op when the dtypes match
    tl.store(VC + dst, v.to(VC.dtype.element_ty), mask=mask)


def store_kv_config(hkv: int, d: int, block_size: int) -> dict:
    """Constexprs and launch options of ``_store_kv_kernel`` (shared with the compile test)."""
    return dict(
        NUM_KV_HEADS=hkv,
        HEAD_DIM=d,
        H_PAD=_next_pow2(hkv),
        D_PAD=_next_pow2(d),
        BLOCK_SIZE=block_size,
        num_warps=1 if hkv * d <= 512 else 4,
    )


def store_kv(
    key: torch.Tensor, value: torch.Tensor, layer: AttentionLayer, slot_mapping: torch.Tensor
) -> None:
    """Write new ``[T, Hkv, D]`` keys/values into their cache slots; slot -1 is skipped."""
    t, hkv, d = key.shape
    if t == 0:
        return
    _check_caches(layer)
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    slot_mapping = slot_mapping.contiguous()
    _store_kv_kernel[(t,)](
        key,
        value,
        layer.key_cache,
        layer.value_cache,
        slot_mapping,
        *key.stride()[:2],
        *value.stride()[:2],
        *layer.key_cache.stride()[:3],
        **store_kv_config(hkv, d, layer.key_cache.shape[1]),
    )


# --------------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------------


@triton.jit
def _decode_kernel(
    Q,
    KC,
    VC,
    BT,
    SeqLens,
    Out,
    MidO,
    MidLse,
    scale,
    softcap,
    window,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_co,
    stride_ch,
    stride_btb,
    stride_ob,
    stride_oh,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    FP32_MATH: tl.constexpr,
):
    b64 = tl.program_id(0).to(tl.int64)  # the sequence (int64: it scales strides)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b64)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < G
    d_mask = offs_d < HEAD_DIM
    heads = kvh * G + offs_g

    q = tl.load(
        Q + b64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    q = _math_dtype(q, KC, FP32_MATH)

    # Keys allowed for the query at position seq_len - 1: [lo, seq_len).
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    tile_lo = lo // BLOCK_N
    tile_hi = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(tl.maximum(tile_hi - tile_lo, 0), NUM_SPLITS)
    t_start = tile_lo + split * per_split
    t_end = tl.minimum(t_start + per_split, tile_hi)

    m_i, l_i, acc = _softmax_state(BLOCK_G, D_PAD)
    bt_row = BT + b64 * stride_btb
    kc_head, vc_head = KC + kvh * stride_ch, VC + kvh * stride_ch

    for tile in range(t_start, t_end):
        tok = tile * BLOCK_N + offs_n
        in_seq = (tok < seq_len) & (tok >= lo)
        k, v, valid = _load_kv_tile(
            kc_head, vc_head, bt_row, tok, in_seq, offs_d, d_mask, stride_cb, stride_co, BLOCK_SIZE
        )
        s = _scores(q, k, scale, softcap, USE_SOFTCAP, FP32_MATH)
        m_i, l_i, acc = _online_softmax_step(s, valid[None, :], v, m_i, l_i, acc, FP32_MATH)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            Out + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=o_mask,
        )
    else:
        tl.store(
            MidO
            + b64 * stride_mob
            + heads[:, None] * stride_moh
            + split * stride_mos
            + offs_d[None, :],
            out,
            mask=o_mask,
        )
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(MidLse + b64 * stride_mlb + heads * stride_mlh + split, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    MidO,
    MidLse,
    Out,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    S_PAD: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(
        MidLse + b * stride_mlb + h * stride_mlh + offs_s, mask=s_mask, other=float("-inf")
    )
    mx = tl.max(lse, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2(lse - mx)  # empty splits (lse -inf) weigh 0
    o = tl.load(
        MidO + b * stride_mob + h * stride_moh + offs_s[:, None] * stride_mos + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_mask
    )


def _head_pad(d: int) -> int:
    return _next_pow2(max(d, 16))  # tl.dot needs K >= 16


def _attention_constexprs(
    h: int, hkv: int, d: int, block_size: int, window: int, softcap: float, fp32_math: bool
) -> dict:
    """The constexprs the decode and prefill kernels share."""
    return dict(
        G=h // hkv,
        HEAD_DIM=d,
        D_PAD=_head_pad(d),
        BLOCK_SIZE=block_size,
        USE_SOFTCAP=softcap > 0,
        USE_WINDOW=window > 0,
        FP32_MATH=fp32_math,
    )


def decode_config(
    h: int,
    hkv: int,
    d: int,
    block_size: int,
    num_splits: int,
    window: int,
    softcap: float,
    fp32_math: bool,
    block_n: Optional[int] = None,
) -> dict:
    """Constexprs and launch options of ``_decode_kernel`` (shared with the compile test)."""
    shared = _attention_constexprs(h, hkv, d, block_size, window, softcap, fp32_math)
    if block_n is None:
        block_n = 64 if shared["D_PAD"] <= 128 else 32
    return dict(
        shared,
        BLOCK_G=max(16, _next_pow2(h // hkv)),  # tl.dot needs M >= 16 on the GPU
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        num_warps=4,
        num_stages=2,
    )


def decode_reduce_config(d: int, num_splits: int) -> dict:
    d_pad = _head_pad(d)
    return dict(
        HEAD_DIM=d,
        D_PAD=d_pad,
        NUM_SPLITS=num_splits,
        S_PAD=_next_pow2(num_splits),
        num_warps=1 if d_pad <= 64 else 2,
    )


def _pick_num_splits(programs: int, max_ctx: int, block_n: int, device: torch.device) -> int:
    """Split the context when (sequence, KV head) pairs alone leave SMs idle.

    Uses static shapes only (the block-table width bounds the context), so the choice is
    stable across CUDA-graph replays of one batch size.
    """
    if device.type != "cuda" or _interpreting():
        return 1
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    splits = min(triton.cdiv(sms, programs), triton.cdiv(max_ctx, 256), 16)
    return max(1, splits)


def paged_decode_attention(
    query: torch.Tensor,
    layer: AttentionLayer,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_splits: Optional[int] = None,
    block_n: Optional[int] = None,
) -> torch.Tensor:
    """One query token per sequence: query ``[B, H, D]`` -> ``[B, H, D]``.

    ``num_splits`` / ``block_n`` override the heuristics (tests). No host synchronisation.
    """
    b, h, d = query.shape
    _, block_size, hkv, _ = layer.key_cache.shape
    _check_heads(query, layer)
    out = torch.empty_like(query)
    if b == 0:
        return out
    query = _last_dim_contiguous(query)
    block_tables = block_tables.contiguous()
    fp32 = _fp32_math(layer.key_cache)
    cfg = decode_config(h, hkv, d, block_size, 1, layer.window, layer.cap, fp32, block_n)
    max_ctx = block_tables.shape[1] * block_size
    splits = num_splits or _pick_num_splits(b * hkv, max_ctx, cfg["BLOCK_N"], query.device)
    cfg["NUM_SPLITS"] = splits
    d_pad = cfg["D_PAD"]
    if splits > 1:
        mid_o = torch.empty((b, h, splits, d_pad), dtype=torch.float32, device=query.device)
        mid_lse = torch.empty((b, h, splits), dtype=torch.float32, device=query.device)
    else:
        mid_o = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=query.device)
        mid_lse = torch.empty((1, 1, 1), dtype=torch.float32, device=query.device)
    _decode_kernel[(b, hkv, splits)](
        query,
        layer.key_cache,
        layer.value_cache,
        block_tables,
        seq_lens.contiguous(),
        out,
        mid_o,
        mid_lse,
        *_scoring_and_strides(query, layer, block_tables, out),
        *mid_o.stride()[:3],
        *mid_lse.stride()[:2],
        **cfg,
    )
    if splits > 1:
        _decode_reduce_kernel[(b, h)](
            mid_o,
            mid_lse,
            out,
            *mid_o.stride()[:3],
            *mid_lse.stride()[:2],
            *out.stride()[:2],
            **decode_reduce_config(d, splits),
        )
    return out


# --------------------------------------------------------------------------------------------
# prefill (ragged, causal, over the paged context)
# --------------------------------------------------------------------------------------------


@triton.jit
def _prefill_kernel(
    Q,
    KC,
    VC,
    BT,
    CuQ,
    SeqLens,
    Out,
    scale,
    softcap,
    window,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_co,
    stride_ch,
    stride_btb,
    stride_ot,
    stride_oh,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    FP32_MATH: tl.constexpr,
):
    mt = tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2)
    q_begin = tl.load(CuQ + b)
    q_len = tl.load(CuQ + b + 1) - q_begin
    row0 = mt * BLOCK_M
    if row0 >= q_len * G:
        return
    seq_len = tl.load(SeqLens + b)
    ctx_len = seq_len - q_len  # tokens cached before this step's new ones

    offs_m = row0 + tl.arange(0, BLOCK_M)  # flattened (token, group head) rows
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    row_ok = offs_m < q_len * G
    tok_i = offs_m // G
    heads = kvh * G + offs_m % G
    q_pos = ctx_len + tok_i
    q_rows = (q_begin + tok_i).to(tl.int64)
    qo_mask = row_ok[:, None] & d_mask[None, :]

    q = tl.load(
        Q + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=qo_mask,
        other=0.0,
    )
    q = _math_dtype(q, KC, FP32_MATH)

    first_tok = row0 // G
    last_tok = tl.minimum((row0 + BLOCK_M - 1) // G, q_len - 1)
    hi = ctx_len + last_tok + 1  # causal: nothing past the tile's last query position
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(ctx_len + first_tok - window + 1, 0)
    start = (lo // BLOCK_N) * BLOCK_N

    m_i, l_i, acc = _softmax_state(BLOCK_M, D_PAD)
    bt_row = BT + b.to(tl.int64) * stride_btb
    kc_head, vc_head = KC + kvh * stride_ch, VC + kvh * stride_ch

    for s0 in range(start, hi, BLOCK_N):
        tok = s0 + offs_n
        in_seq = tok < hi
        k, v, valid = _load_kv_tile(
            kc_head, vc_head, bt_row, tok, in_seq, offs_d, d_mask, stride_cb, stride_co, BLOCK_SIZE
        )
        s = _scores(q, k, scale, softcap, USE_SOFTCAP, FP32_MATH)
        allowed = valid[None, :] & (tok[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (tok[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = _online_softmax_step(s, allowed, v, m_i, l_i, acc, FP32_MATH)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        Out + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=qo_mask,
    )


def prefill_config(
    h: int,
    hkv: int,
    d: int,
    block_size: int,
    window: int,
    softcap: float,
    fp32_math: bool,
    block_m: Optional[int] = None,
    block_n: Optional[int] = None,
) -> dict:
    """Constexprs and launch options of ``_prefill_kernel`` (shared with the compile test)."""
    shared = _attention_constexprs(h, hkv, d, block_size, window, softcap, fp32_math)
    block_m = block_m or 64
    block_n = block_n or (64 if shared["D_PAD"] <= 64 else 32)
    return dict(
        shared,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=4 if block_m * shared["D_PAD"] <= 64 * 64 else 8,
        num_stages=2,
    )


def paged_prefill_attention(
    query: torch.Tensor,
    layer: AttentionLayer,
    meta: AttentionMetadata,
    *,
    block_m: Optional[int] = None,
    block_n: Optional[int] = None,
) -> torch.Tensor:
    """Ragged causal attention: query ``[T, H, D]``; sequence i's rows attend to its cached
    context and to its own new tokens, causally. Only ``max(meta.query_lens_host)`` is read
    on the host (to size the grid)."""
    t, h, d = query.shape
    _, block_size, hkv, _ = layer.key_cache.shape
    _check_heads(query, layer)
    out = torch.empty_like(query)
    num_seqs = meta.cu_seqlens_q.shape[0] - 1
    max_q = max(meta.query_lens_host, default=0)
    if t == 0 or num_seqs == 0 or max_q == 0:
        return out
    query = _last_dim_contiguous(query)
    block_tables = meta.block_tables.contiguous()
    fp32 = _fp32_math(layer.key_cache)
    cfg = prefill_config(h, hkv, d, block_size, layer.window, layer.cap, fp32, block_m, block_n)
    grid = (triton.cdiv(max_q * cfg["G"], cfg["BLOCK_M"]), num_seqs, hkv)
    _prefill_kernel[grid](
        query,
        layer.key_cache,
        layer.value_cache,
        block_tables,
        meta.cu_seqlens_q.contiguous(),
        meta.seq_lens.contiguous(),
        out,
        *_scoring_and_strides(query, layer, block_tables, out),
        **cfg,
    )
    return out


def plan(meta: AttentionMetadata, key_cache: torch.Tensor, num_query_heads: int) -> AttentionPlan:
    """``AttentionOps.plan``: nothing to work out; the kernels skip slot -1 themselves."""
    return AttentionPlan(None, meta.slot_mapping)


def paged_attention(
    query: torch.Tensor, layer: AttentionLayer, meta: AttentionMetadata
) -> torch.Tensor:
    """Dispatch a ragged step: decode-only batches take the decode kernel (CUDA-graph safe),
    anything else (prefill, chunked prefill, mixed batches) the prefill kernel."""
    if meta.decode_only:
        return paged_decode_attention(query, layer, meta.block_tables, meta.seq_lens)
    return paged_prefill_attention(query, layer, meta)


def store_step_kv(
    key: torch.Tensor, value: torch.Tensor, layer: AttentionLayer, meta: AttentionMetadata
) -> None:
    """The kernel skips slot -1 itself: nothing to work out per step."""
    store_kv(key, value, layer, meta.slot_mapping)
