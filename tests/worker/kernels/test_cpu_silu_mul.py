"""The gated MLP's activation kernel (kernels/csrc/cpu_silu_mul.cpp): silu(gate) * up in one pass,
fp32
and bf16 (rounded once, to nearest even), and the lean forward using it only where the
products hand out bf16."""

import pytest
import torch
import torch.nn.functional as F

from slipstream.worker import kernels

pytestmark = pytest.mark.skipif(
    not kernels.load(), reason=f"no CPU kernel: {kernels.unavailable_reason()}"
)


def reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("inner", [1536, 40, 7])  # 16-wide, 16-wide with a tail, tail only
def test_fp32_matches_silu_times_up(inner):
    torch.manual_seed(0)
    x = torch.randn(33, 2 * inner) * 6
    got = torch.ops.slipstream_cpu.silu_mul(x)
    assert got.shape == (33, inner) and got.dtype == torch.float32
    torch.testing.assert_close(got, reference(x), rtol=3e-6, atol=1e-6)


def test_bf16_is_the_fp32_result_rounded_once():
    torch.manual_seed(1)
    x = (torch.randn(2, 17, 2 * 96) * 8).bfloat16()
    got = torch.ops.slipstream_cpu.silu_mul(x)
    assert got.shape == (2, 17, 96) and got.dtype == torch.bfloat16
    want = reference(x)
    # one rounding of a ~1-ulp fp32 result: at most one bf16 step away, almost always equal
    step = want.abs() * 2.0**-7 + 1e-30
    assert ((got.float() - want).abs() <= step).all()
    assert (got == want.bfloat16()).float().mean() > 0.99


def test_extreme_and_nan_inputs():
    gate = torch.tensor([-1000.0, -30.0, 0.0, 30.0, 1000.0, float("nan")] + [1.0] * 10)
    x = torch.cat([gate, torch.ones(16)])[None]
    got = torch.ops.slipstream_cpu.silu_mul(x)[0]
    assert abs(got[0]) < 1e-30 and got[2] == 0 and got[4] == 1000.0  # e^-87.3 at the floor
    torch.testing.assert_close(got[1:4], reference(x)[0, 1:4])
    assert torch.isnan(got[5]) and torch.isfinite(got[6:]).all()
    bf = torch.ops.slipstream_cpu.silu_mul(x.bfloat16())[0]
    assert torch.isnan(bf[5]) and bf[4] == 1000.0


def test_lean_forward_uses_it_only_for_reduced_products():
    from slipstream.worker.kernels.cpu_features import CpuFeatures
    from slipstream.worker.layers.preparation import prepare_cpu_model
    from slipstream.worker.model.lean_forward import FastForward
    from slipstream.worker.model.loader import load_model
    from support import tiny_model_dir

    fp32 = FastForward.for_model(load_model(tiny_model_dir("llama"), torch.float32, "cpu"))
    assert all(layer.activation is None for layer in fp32.layers)  # bit for bit HF's
    model = load_model(tiny_model_dir("llama"), torch.float32, "cpu")
    prepare_cpu_model(model, "bfloat16", "auto")
    bf16 = FastForward.for_model(model)
    # packed (AMX) and panel (AVX512-BF16) products hand out bf16; plain ones fp32
    features = CpuFeatures.detect()
    bf16_out = features.amx_bf16 or features.avx512_bf16
    assert all((layer.activation is not None) == bf16_out for layer in bf16.layers)
    model = load_model(tiny_model_dir("llama"), torch.float32, "cpu")
    prepare_cpu_model(model, "int8", "auto")
    int8 = FastForward.for_model(model)
    assert all(layer.activation is not None for layer in int8.layers)  # fp32 out of int8
