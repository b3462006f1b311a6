"""int8 weights and activations in blocks of 32 (``quantization=int8``): the packed weight
(``q8_weight``) and the compiled product (``kernels/csrc/cpu_q8_gemm.cpp``) on both of its paths,
against the same arithmetic in float64."""

import pytest
import torch

from slipstream.worker import kernels
from slipstream.worker.layers.quantization import int8 as q8_weight

pytestmark = pytest.mark.skipif(
    not kernels.load(), reason=f"no CPU kernel: {kernels.unavailable_reason()}"
)
op = torch.ops.slipstream_cpu


@pytest.fixture(params=["native", "portable"])
def kernel_path(request):
    """Each test on the path this CPU runs, and on the portable one (CPUs without VNNI)."""
    op.q8_gemm_force_portable(request.param == "portable")
    yield op.q8_gemm_path()
    op.q8_gemm_force_portable(False)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` quantized per block of 32 and dequantized, in float64 (the reference's input)."""
    b = x.double().view(*x.shape[:-1], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax.float().double(), torch.zeros_like(amax))
    q = torch.round((b.float() * inv.float()).double()).clamp(-127, 127)
    return (q * (amax.float() / 127).double()).view(x.shape)


def _reference(x: torch.Tensor, w: torch.Tensor, bias=None) -> torch.Tensor:
    y = _blocks(x) @ _blocks(w).t()
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 64, 200])  # row tiles and a second chunk
@pytest.mark.parametrize("n, k", [(32, 64), (40, 96), (96, 1536)])  # a ragged last panel
def test_q8_gemm_computes_the_blocked_product(kernel_path, rows, n, k):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen) * 0.1
    bias = torch.randn(n, generator=gen)
    packed = q8_weight.quantize(w)
    got = op.q8_gemm(x, packed.packed, packed.scales, n, bias)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _reference(x, w, bias), rtol=1e-5, atol=1e-4)


def test_q8_paths_agree_and_a_row_does_not_depend_on_its_batch():
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(50, 128, generator=gen) * 3, torch.randn(64, 128, generator=gen)
    packed = q8_weight.quantize(w)
    together = op.q8_gemm(x, packed.packed, packed.scales, 64, None)
    alone = torch.cat(
        [op.q8_gemm(x[i : i + 1], packed.packed, packed.scales, 64, None) for i in range(50)]
    )
    assert torch.equal(together, alone)
    op.q8_gemm_force_portable(True)
    try:
        portable = op.q8_gemm(x, packed.packed, packed.scales, 64, None)
    finally:
        op.q8_gemm_force_portable(False)
    # the block sums are exact integers on both paths; the folds round alike to ~1 ulp
    torch.testing.assert_close(portable, together, rtol=1e-6, atol=1e-5)


def test_zero_blocks_and_rows_give_zeros_not_nans(kernel_path):
    w = torch.randn(32, 64)
    w[:, :32] = 0  # a weight block of zeros
    x = torch.randn(3, 64)
    x[1] = 0  # a row of zeros
    x[2, 32:] = 0
    packed = q8_weight.quantize(w)
    got = op.q8_gemm(x, packed.packed, packed.scales, 32, None)
    assert torch.isfinite(got).all() and torch.equal(got[1], torch.zeros(32))
    torch.testing.assert_close(got.double(), _reference(x, w), rtol=1e-5, atol=1e-4)


def test_q8_gemm_reads_rows_at_their_stride():
    wide, w = torch.randn(3, 128), torch.randn(32, 64)
    packed = q8_weight.quantize(w)
    got = q8_weight.product(packed, wide[:, :64], None, kernel=True)
    torch.testing.assert_close(got.double(), _reference(wide[:, :64], w), rtol=1e-5, atol=1e-4)


def test_q8_gemm_refuses_what_it_cannot_compute():
    packed = q8_weight.quantize(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op.q8_gemm(torch.randn(1, 40), packed.packed, packed.scales, 32, None)
    with pytest.raises(RuntimeError, match="packed weight must be uint8"):
        op.q8_gemm(torch.randn(1, 64), packed.packed, packed.scales, 64, None)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        op.q8_gemm(torch.randn(1, 64), packed.packed, packed.scales, 32, torch.zeros(32).double())
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_weight.quantize(torch.randn(8, 40))


def test_quantize_is_symmetric_per_block_and_rows_read_it_back():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(40, 96, generator=gen)
    w[5, 32:64] *= 100  # one loud block: its neighbours keep their own scales
    packed = q8_weight.quantize(w)
    assert packed.packed.dtype == torch.uint8 and packed.packed.shape == (2, 24, 2, 16, 4)
    assert packed.scales.shape == (2, 3, 32) and packed.out_features == 40
    q, scales = packed.columns(torch.arange(40))
    assert q.abs().amax().item() == 127 and (q.view(40, 3, 32).abs().amax(-1) == 127).all()
    back = packed.dequantized()
    step = w.view(40, 3, 32).abs().amax(-1, keepdim=True) / 127
    assert ((back - w).view(40, 3, 32).abs() <= step / 2 + 1e-6).all()
    ids = torch.tensor([[5, 39], [0, 17]])
    torch.testing.assert_close(packed.rows(ids), back[ids])


def test_stacked_weights_give_each_ones_columns():
    a, b = q8_weight.quantize(torch.randn(64, 64)), q8_weight.quantize(torch.randn(32, 64))
    both = q8_weight.stack([a, b])
    assert both is not None and both.out_features == 96
    x = torch.randn(4, 64)
    got = q8_weight.product(both, x, None, kernel=True)
    torch.testing.assert_close(got[:, :64], q8_weight.product(a, x, None, kernel=True))
    torch.testing.assert_close(got[:, 64:], q8_weight.product(b, x, None, kernel=True))
    ragged = q8_weight.quantize(torch.randn(40, 64))
    assert q8_weight.stack([ragged, b]) is None  # 40 columns leave a padded panel


def test_the_torch_path_computes_what_the_kernel_does():
    """Without a compiled kernel the same arithmetic runs in torch."""
    gen = torch.Generator().manual_seed(11)
    x, w = torch.randn(9, 96, generator=gen), torch.randn(40, 96, generator=gen)
    bias = torch.randn(40, generator=gen)
    packed = q8_weight.quantize(w)
    torch.testing.assert_close(
        q8_weight.product(packed, x, bias, kernel=False),
        q8_weight.product(packed, x, bias, kernel=True),
        rtol=1e-5,
        atol=1e-5,
    )


def _reference_with_outliers(x, w, idx, bias=None):
    """Outlier channels exact in float64, the rest in blocks."""
    keep = torch.ones(x.shape[1], dtype=torch.bool)
    keep[idx] = False
    y = _blocks(x * keep) @ _blocks(w * keep).t() + x[:, idx].double() @ w[:, idx].double().t()
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("rows", [1, 7, 200])
def test_outlier_channels_are_multiplied_exactly_apart_from_the_blocks(kernel_path, rows):
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=gen), torch.randn(40, 96, generator=gen)
    idx = torch.tensor([3, 40, 95])
    x[:, idx] *= 50  # loud channels: in the blocks they would flatten their neighbours
    bias = torch.randn(40, generator=gen)
    packed = q8_weight.quantize(w, idx)
    assert packed.outlier_w is not None and packed.outlier_w.shape == (2, 3, 32)
    got = q8_weight.product(packed, x, bias, kernel=True)
    want = _reference_with_outliers(x, w, idx, bias)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-3)
    plain = _reference(x, w, bias)  # every channel in the blocks: visibly worse
    exact = x.double() @ w.double().t() + bias.double()
    assert (got.double() - exact).abs().max() < (plain - exact).abs().max() / 4


def test_outliers_read_back_through_rows_and_the_torch_path():
    gen = torch.Generator().manual_seed(2)
    w, x = torch.randn(64, 64, generator=gen), torch.randn(5, 64, generator=gen) * 3
    idx = torch.tensor([0, 33])
    packed = q8_weight.quantize(w, idx)
    rows = packed.rows(torch.tensor([7, 63]))
    torch.testing.assert_close(rows[:, idx], w[[7, 63]][:, idx])  # exact, not quantized
    torch.testing.assert_close(
        q8_weight.product(packed, x, None, kernel=False),
        q8_weight.product(packed, x, None, kernel=True),
        rtol=1e-5,
        atol=1e-5,
    )
    with pytest.raises(RuntimeError, match="outlier channel out of range"):
        op.q8_gemm(
            x, packed.packed, packed.scales, 64, None, torch.tensor([0, 64]), packed.outlier_w
        )


def test_only_weights_with_the_same_outliers_stack():
    w = torch.randn(64, 64)
    a, b = q8_weight.quantize(w, torch.tensor([1, 2])), q8_weight.quantize(w, torch.tensor([1, 2]))
    both = q8_weight.stack([a, b])
    assert both is not None and both.outlier_w is not None and both.outlier_w.shape == (4, 2, 32)
    x = torch.randn(3, 64)
    got = q8_weight.product(both, x, None, kernel=True)
    torch.testing.assert_close(got[:, 64:], q8_weight.product(b, x, None, kernel=True))
    assert q8_weight.stack([a, q8_weight.quantize(w, torch.tensor([1, 3]))]) is None
    assert q8_weight.stack([a, q8_weight.quantize(w)]) is None
