"""4-bit weights with int8 activations (``quantization=gguf / awq / gptq``): the layout
(``layers/quantization/int4``) and the compiled product (``kernels/csrc/cpu_q4_gemm.cpp``) on both
of its paths, against the same arithmetic in float64 on random blocks, odd shapes included."""

import pytest
import torch

from slipstream.worker import kernels
from slipstream.worker.layers.quantization import int4
from int4_support import activation_blocks as _activation_blocks

pytestmark = pytest.mark.skipif(
    not kernels.load(), reason=f"no CPU kernel: {kernels.unavailable_reason()}"
)
op = torch.ops.slipstream_cpu


@pytest.fixture(params=["native", "portable"])
def kernel_path(request):
    """Each test on the path this CPU runs, and on the portable one (CPUs without VNNI)."""
    op.q4_gemm_force_portable(request.param == "portable")
    yield op.q4_gemm_path()
    op.q4_gemm_force_portable(False)


def _random_weight(n: int, k: int, group: int, dtype: torch.dtype, seed: int):
    """Random codes, scales and offsets, and the weight they give in float64 ``[N, K]``."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    # every format's d is a float16 value, or one times a small integer (Q4_K's)
    d = (torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3).half().to(dtype)
    m = (torch.randn(n, k // group, generator=gen) * 0.1).to(dtype)
    w = q.double().view(n, -1, group) * d.double()[..., None] + m.double()[..., None]
    return q, d, m, w.view(n, k)


def _reference(x, w, bias=None, outliers=None) -> torch.Tensor:
    y = _activation_blocks(x, outliers) @ w.t()
    return y if bias is None else y + bias.double()


SHAPES = [  # (n, k, group): a ragged last panel, K of one block, groups of 1, 2 and 4 blocks
    (32, 32, 32),
    (40, 96, 32),
    (70, 128, 64),
    (96, 256, 128),
    (17, 384, 128),
]


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 13, 200])  # row tiles and a second chunk
@pytest.mark.parametrize("n, k, group", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_q4_gemm_computes_the_blocked_product(kernel_path, rows, n, k, group, dtype):
    q, d, m, w = _random_weight(n, k, group, dtype, seed=rows * 100 + n)
    packed = int4.pack(q, d, m, group)
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    got = op.q4_gemm(x, packed.packed, packed.scales, group, n, bias)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _reference(x, w, bias), rtol=1e-5, atol=1e-4)


def test_the_layout_holds_every_weight_exactly():
    for n, k, group in SHAPES:
        for dtype in (torch.float16, torch.float32):
            q, d, m, w = _random_weight(n, k, group, dtype, seed=n)
            packed = int4.pack(q, d, m, group)
            assert torch.equal(packed.codes(torch.arange(n)), q)
            # d * q + m in float32 from exact float16 / float32 operands: one rounding
            assert torch.equal(packed.dequantized(), w.float())
            assert packed.packed.nbytes == -(-n // 32) * 32 * k // 2


def test_outlier_channels_are_multiplied_apart(kernel_path):
    n, k, group = 64, 128, 64
    q, d, m, w = _random_weight(n, k, group, torch.float16, seed=3)
    channels = torch.tensor([5, 40, 41, 100])
    packed = int4.pack(q, d, m, group).with_outliers(channels)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(7, k, generator=gen)
    x[:, channels] *= 30  # what outlier channels look like
    got = op.q4_gemm(
        x, packed.packed, packed.scales, group, n, None, packed.outliers, packed.outlier_w
    )
    torch.testing.assert_close(got.double(), _reference(x, w, None, channels), rtol=1e-5, atol=1e-4)


def test_a_permuted_k_reads_the_activations_in_its_order(kernel_path):
    """GPTQ's act-order: the kernel's channel j reads input channel perm[j]."""
    n, k, group = 48, 128, 32
    q, d, m, _ = _random_weight(n, k, group, torch.float32, seed=5)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(6))
    packed = int4.pack(q, d, m, group, perm)
    w = packed.dequantized().double()  # input order
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(7))
    got = int4.product(packed, x, None, kernel=True)
    # the blocks are over the permuted channels
    expected = _activation_blocks(x[:, perm]) @ w[:, perm].t()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)
    channels = torch.tensor([3, 77])
    with_out = packed.with_outliers(channels)
    x[:, channels] *= 20
    got = int4.product(with_out, x, None, kernel=True)
    inverse = torch.argsort(perm)
    expected = _activation_blocks(x[:, perm], inverse[channels]) @ w[:, perm].t()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


def test_the_torch_path_is_the_kernels_arithmetic():
    n, k, group = 40, 256, 128
    q, d, m, _ = _random_weight(n, k, group, torch.float16, seed=8)
    packed = int4.pack(q, d, m, group).with_outliers(torch.tensor([9, 200]))
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(
        int4.product(packed, x, None, kernel=False),
        int4.product(packed, x, None, kernel=True),
        rtol=1e-5,
        atol=1e-4,
    )


def test_paths_agree_and_a_row_does_not_depend_on_its_batch():
    n, k, group = 64, 192, 64
    q, d, m, _ = _random_weight(n, k, group, torch.float16, seed=10)
    packed = int4.pack(q, d, m, group)
    x = torch.randn(30, k, generator=torch.Generator().manual_seed(11)) * 3
    together = op.q4_gemm(x, packed.packed, packed.scales, group, n, None)
    alone = torch.cat(
        [op.q4_gemm(x[i : i + 1], packed.packed, packed.scales, group, n, None) for i in range(30)]
    )
    assert torch.equal(together, alone)
    op.q4_gemm_force_portable(True)
    try:
        portable = op.q4_gemm(x, packed.packed, packed.scales, group, n, None)
    finally:
        op.q4_gemm_force_portable(False)
    torch.testing.assert_close(portable, together, rtol=1e-6, atol=1e-5)


def test_zero_rows_give_zeros_not_nans(kernel_path):
    n, k, group = 32, 64, 32
    q, d, m, w = _random_weight(n, k, group, torch.float32, seed=12)
    packed = int4.pack(q, d, m, group)
    x = torch.randn(3, k)
    x[1] = 0
    x[2, 32:] = 0
    got = op.q4_gemm(x, packed.packed, packed.scales, group, n, None)
    assert torch.isfinite(got).all() and torch.equal(got[1], torch.zeros(n))
    torch.testing.assert_close(got.double(), _reference(x, w), rtol=1e-5, atol=1e-4)


def test_stacked_weights_give_each_ones_columns():
    parts = [int4.pack(*_random_weight(n, 64, 32, torch.float16, seed=n)[:3], 32) for n in (64, 32)]
    both = int4.stack(parts)
    assert both is not None and both.out_features == 96
    x = torch.randn(2, 64)
    y = int4.product(both, x, None, kernel=True)
    torch.testing.assert_close(y[:, :64], int4.product(parts[0], x, None, kernel=True))
    torch.testing.assert_close(y[:, 64:], int4.product(parts[1], x, None, kernel=True))
    ragged = int4.pack(*_random_weight(40, 64, 32, torch.float16, seed=1)[:3], 32)
    assert int4.stack([ragged, parts[1]]) is None  # its columns do not fill their panel


def test_q4_gemm_refuses_what_it_cannot_compute():
    q, d, m, _ = _random_weight(32, 64, 32, torch.float16, seed=13)
    packed = int4.pack(q, d, m, 32)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="group must be a multiple of 32"):
        op.q4_gemm(x, packed.packed, packed.scales, 48, 32, None)
    with pytest.raises(RuntimeError, match="packed weight must be"):
        op.q4_gemm(x, packed.packed, packed.scales, 32, 64, None)
    with pytest.raises(RuntimeError, match="x must be float32"):
        op.q4_gemm(x.double(), packed.packed, packed.scales, 32, 32, None)
    with pytest.raises(RuntimeError, match="perm must be"):
        op.q4_gemm(x, packed.packed, packed.scales, 32, 32, None, None, None, torch.arange(3))
    with pytest.raises(ValueError, match="multiple of the group"):
        int4.pack(torch.zeros(32, 48, dtype=torch.uint8), d[:, :1], m[:, :1], 32)
