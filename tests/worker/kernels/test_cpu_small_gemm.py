"""The compiled fp32 GEMM kernel computes the linear product at any row count (12 x 2 tiles
for decode rows, 8 x 3 tiles over row chunks from 32 rows on), and ``cpu_linear=auto`` runs
every product on it, over one packed copy that a tied embedding reads too."""

import pytest
import torch
import torch.nn.functional as F

from slipstream.worker import kernels
from slipstream.worker.layers import linear as cpu_linear

pytestmark = pytest.mark.skipif(
    not kernels.load(), reason=f"no CPU kernel: {kernels.unavailable_reason()}"
)
op = torch.ops.slipstream_cpu


@pytest.mark.parametrize("rows", [1, 2, 7, 12, 13, 25, 32])  # below, at and past the row tile
@pytest.mark.parametrize("n", [16, 40, 100])  # whole blocks, a pair and a half, a ragged tail
@pytest.mark.parametrize("bias", [False, True])
def test_small_gemm_computes_the_linear_product(rows, n, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    k = 72
    weight, x = torch.randn(n, k, generator=gen), torch.randn(rows, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    want = F.linear(x.double(), weight.double(), None if b is None else b.double())
    got = op.small_gemm(x, op.pack_small_gemm_weight(weight), n, b)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [32, 45, 200])  # whole wide tiles, a tail of them, chunks
@pytest.mark.parametrize("n", [48, 100, 150])  # one whole group, a ragged tail, a partial group
@pytest.mark.parametrize("k", [72, 2048])  # 2048: more rows than one chunk keeps in L2
def test_many_row_products_in_wide_tiles_and_chunks_compute_the_linear_product(rows, n, k):
    gen = torch.Generator().manual_seed(rows * 7 + n + k)
    weight, x = torch.randn(n, k, generator=gen), torch.randn(rows, k, generator=gen)
    b = torch.randn(n, generator=gen)
    want = F.linear(x.double(), weight.double(), b.double())
    got = op.small_gemm(x, op.pack_small_gemm_weight(weight), n, b)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-4)


def test_small_gemm_reads_rows_at_their_stride():
    """A view of every other column of a wider buffer: rows are not back to back."""
    gen = torch.Generator().manual_seed(3)
    wide, weight = torch.randn(5, 2 * 48, generator=gen), torch.randn(33, 48, generator=gen)
    x = wide[:, :48]
    assert x.stride(0) == 96
    torch.testing.assert_close(
        op.small_gemm(x, op.pack_small_gemm_weight(weight), 33, None),
        F.linear(x, weight),
        rtol=1e-5,
        atol=1e-5,
    )


def test_small_gemm_refuses_a_weight_packed_for_another_width():
    packed = op.pack_small_gemm_weight(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="not packed for this input"):
        op.small_gemm(torch.randn(2, 48), packed, 32, None)


def _calls(model: torch.nn.Module, x: torch.Tensor) -> dict:
    with torch.profiler.profile() as prof, torch.no_grad():
        model(x)
    return {
        e.key: e.count
        for e in prof.key_averages()
        if e.key in ("slipstream_cpu::small_gemm", "mkldnn::_linear_pointwise")
    }


def test_auto_layout_runs_every_row_count_on_the_kernel():
    if not cpu_linear.kernel_serves_fp32():
        pytest.skip("no AVX-512: auto is onednn here")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.Linear(80, 24, bias=False))
    assert cpu_linear.prepare_linears(model, "auto") is cpu_linear.CpuLinear.AUTO
    assert cpu_linear.applied_mode(model[0]) is cpu_linear.CpuLinear.AUTO
    for rows in (1, 64, 65, 700):
        assert _calls(model, torch.randn(1, rows, 64)) == {"slipstream_cpu::small_gemm": 2}


def test_a_tied_embedding_looks_its_rows_up_in_the_heads_packed_copy():
    if not cpu_linear.kernel_serves_fp32():
        pytest.skip("no AVX-512: auto is onednn here")
    from support import TiedLM

    torch.manual_seed(1)
    model = TiedLM()
    table = model.embed.weight.detach().clone()
    cpu_linear.prepare_linears(model, "auto")
    assert model.embed.weight.is_meta  # the table is no longer held for the lookups
    ids = torch.tensor([[0, 2, 15, 16, 17, 69, 33]])
    with torch.no_grad():
        assert torch.equal(model.embed(ids), table[ids])
        x = torch.randn(3, 64)
        torch.testing.assert_close(model.lm_head(x), x @ table.t(), rtol=1e-5, atol=1e-5)


def test_an_embedding_with_a_forward_of_its_own_keeps_it_and_its_table():
    """Gemma's embedding scales its rows: a lookup in the head's packed copy would drop that."""
    from support import ScaledEmbedding, TiedLM

    torch.manual_seed(2)
    model = TiedLM(ScaledEmbedding)
    ids = torch.tensor([0, 2, 15, 69])
    with torch.no_grad():
        want = model.embed(ids)
        cpu_linear.prepare_linears(model, "auto")
        assert not model.embed.weight.is_meta
        assert torch.equal(model.embed(ids), want)
