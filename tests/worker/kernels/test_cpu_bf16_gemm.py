"""bf16 weights in panels (``dtype=bfloat16`` on AVX512-BF16 without AMX): the packed weight
(``bf16_weight``, ``panel_layout``) and the compiled product (``kernels/csrc/cpu_bf16_gemm.cpp``) on
both of its paths, against float64 on the bf16-rounded operands."""

import pytest
import torch

from slipstream.worker import kernels
from slipstream.worker.layers.quantization import bf16 as bf16_weight, panel_layout

pytestmark = pytest.mark.skipif(
    not kernels.load(), reason=f"no CPU kernel: {kernels.unavailable_reason()}"
)
op = torch.ops.slipstream_cpu


@pytest.fixture(params=["native", "portable"])
def kernel_path(request):
    """Each test on the path this CPU runs, and on the portable one (CPUs without BF16)."""
    op.bf16_gemm_force_portable(request.param == "portable")
    yield op.bf16_gemm_path()
    op.bf16_gemm_force_portable(False)


def _reference(x: torch.Tensor, w: torch.Tensor, bias=None) -> torch.Tensor:
    y = x.bfloat16().double() @ w.bfloat16().double().t()
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("rows", [1, 5, 12, 13, 64, 200])  # row tiles and a second chunk
@pytest.mark.parametrize("n, k", [(32, 64), (40, 96), (96, 1536)])  # a ragged last panel
def test_bf16_gemm_computes_the_product_in_fp32_sums(kernel_path, rows, n, k):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen) * 0.1
    bias = torch.randn(n, generator=gen)
    got = bf16_weight.product(bf16_weight.pack(w), x, bias, bf16_out=False)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _reference(x, w, bias), rtol=1e-5, atol=1e-4)


def test_bf16_out_is_the_fp32_result_rounded_once(kernel_path):
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(9, 128, generator=gen), torch.randn(64, 128, generator=gen)
    packed = bf16_weight.pack(w)
    wide = bf16_weight.product(packed, x.bfloat16(), None, bf16_out=False)
    narrow = bf16_weight.product(packed, x.bfloat16(), None, bf16_out=True)
    assert narrow.dtype == torch.bfloat16 and torch.equal(narrow, wide.bfloat16())


def test_bf16_out_rounds_infinities_nans_and_ties_as_torch_does(kernel_path):
    """Whole panels are stored as vectors: their rounding must stay torch's, lane by lane."""
    gen = torch.Generator().manual_seed(6)
    x, w = torch.randn(6, 64, generator=gen), torch.randn(64, 64, generator=gen)
    x[0, 3], x[1, 5] = float("nan"), float("inf")
    x[2] = 0.0
    x[2, 0] = 1.0
    bias = torch.zeros(64)
    bias[:8] = torch.tensor(
        [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1e38, 3.4e38, -3e38, 1.5, 2**-133]
    )
    w[:, 0] = 0.0  # row 2's sums are the bias: ties, overflow to inf, a subnormal
    packed = bf16_weight.pack(w)
    wide = bf16_weight.product(packed, x, bias, bf16_out=False)
    narrow = bf16_weight.product(packed, x, bias, bf16_out=True)
    torch.testing.assert_close(narrow, wide.bfloat16(), rtol=0, atol=0, equal_nan=True)


def test_a_row_does_not_depend_on_its_batch():
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(30, 64, generator=gen), torch.randn(64, 64, generator=gen)
    packed = bf16_weight.pack(w)
    together = bf16_weight.product(packed, x, None, bf16_out=False)
    alone = [bf16_weight.product(packed, x[i : i + 1], None, bf16_out=False) for i in range(30)]
    assert torch.equal(together, torch.cat(alone))


def test_bf16_gemm_reads_rows_at_their_stride(kernel_path):
    wide, w = torch.randn(3, 128), torch.randn(32, 64)
    got = bf16_weight.product(bf16_weight.pack(w), wide[:, :64], None, bf16_out=False)
    torch.testing.assert_close(got.double(), _reference(wide[:, :64], w), rtol=1e-5, atol=1e-4)


def test_bf16_gemm_refuses_what_it_cannot_compute():
    packed = bf16_weight.pack(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="packed weight must be bfloat16"):
        op.bf16_gemm(torch.randn(1, 64), packed.packed, 64, None, False)
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16"):
        op.bf16_gemm(torch.randn(1, 64).double(), packed.packed, 32, None, False)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        op.bf16_gemm(torch.randn(1, 64), packed.packed, 32, torch.zeros(31), False)
    with pytest.raises(ValueError, match="even K"):
        bf16_weight.pack(torch.randn(8, 33))


def test_rows_are_the_weights_rows_in_bf16():
    w = torch.randn(40, 96)
    packed = bf16_weight.pack(w)
    assert packed.packed.shape == (2, 48, 2, 16, 2)  # padded to two panels
    ids = torch.tensor([[39, 0], [17, 17]])
    assert torch.equal(packed.rows(ids), w.bfloat16().float()[ids])
    assert torch.equal(panel_layout.columns(packed.packed, torch.arange(40)), w.bfloat16())


def test_stacked_weights_give_each_ones_columns():
    a, b = bf16_weight.pack(torch.randn(64, 64)), bf16_weight.pack(torch.randn(32, 64))
    both = bf16_weight.stack([a, b])
    assert both is not None and both.out_features == 96
    x = torch.randn(4, 64)
    got = bf16_weight.product(both, x, None, bf16_out=False)
    assert torch.equal(got[:, :64], bf16_weight.product(a, x, None, bf16_out=False))
    assert torch.equal(got[:, 64:], bf16_weight.product(b, x, None, bf16_out=False))
    assert bf16_weight.stack([bf16_weight.pack(torch.randn(40, 64)), b]) is None
