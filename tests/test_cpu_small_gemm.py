"""The compiled small-GEMM kernel (few rows: decode steps at small batch) computes the linear
product, and ``cpu_linear=auto`` sends few-row products to it and the rest to oneDNN."""

import pytest
import torch
import torch.nn.functional as F

from slipstream.worker import cpu_linear
from slipstream.worker.ops import cpu_kernels

pytestmark = pytest.mark.skipif(
    not cpu_kernels.load(), reason=f"no CPU kernel: {cpu_kernels.unavailable_reason()}"
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


def test_auto_layout_sends_few_rows_to_the_kernel_and_many_to_onednn():
    if not cpu_linear.onednn_available():
        pytest.skip("torch built without oneDNN")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.Linear(80, 24, bias=False))
    assert cpu_linear.prepare_linears(model, "auto") is cpu_linear.CpuLinear.AUTO
    assert cpu_linear.applied_mode(model[0]) is cpu_linear.CpuLinear.AUTO
    few, many = cpu_linear.SMALL_GEMM_MAX_ROWS, cpu_linear.SMALL_GEMM_MAX_ROWS + 1
    assert _calls(model, torch.randn(1, few, 64)) == {"slipstream_cpu::small_gemm": 2}
    assert _calls(model, torch.randn(1, many, 64)) == {"mkldnn::_linear_pointwise": 2}
