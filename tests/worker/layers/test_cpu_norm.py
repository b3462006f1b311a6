"""The compiled RMSNorm kernel computes the Llama-style norm, and ``prepare_norms`` routes
exactly the fp32 Llama-style norms of a model through it."""

import pytest
import torch

from slipstream.worker import kernels
from slipstream.worker.layers.norm import prepare_norms
from support import tiny_model_dir

pytestmark = pytest.mark.skipif(
    not kernels.load(), reason=f"no CPU kernel: {kernels.unavailable_reason()}"
)


def _reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return weight.double() * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 rows of 576 run on several threads
def test_rms_norm_kernel_computes_the_llama_norm(rows):
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(1, rows, 576, generator=gen) * 3, torch.rand(576, generator=gen) + 0.5
    got = torch.ops.slipstream_cpu.rms_norm(x, weight, 1e-5)
    assert got.shape == x.shape
    torch.testing.assert_close(got.double(), _reference(x, weight, 1e-5), rtol=1e-5, atol=1e-5)


def test_rms_norm_kernel_reads_a_strided_input():
    gen = torch.Generator().manual_seed(1)
    wide, weight = torch.randn(4, 128, generator=gen), torch.rand(64, generator=gen)
    x = wide[:, ::2]
    torch.testing.assert_close(
        torch.ops.slipstream_cpu.rms_norm(x, weight, 1e-6).double(),
        _reference(x, weight, 1e-6),
        rtol=1e-5,
        atol=1e-5,
    )


def _norm_calls(model: torch.nn.Module) -> int:
    with torch.profiler.profile() as prof, torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    return sum(e.count for e in prof.key_averages() if e.key == "slipstream_cpu::rms_norm")


def test_prepare_norms_routes_every_fp32_llama_norm_and_keeps_the_logits():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir("llama")))
    with torch.no_grad():
        before = model(torch.tensor([[1, 2, 3]])).logits
    layers = model.config.num_hidden_layers
    assert prepare_norms(model) == 2 * layers + 1  # two per layer and the final norm
    assert _norm_calls(model) == 2 * layers + 1
    with torch.no_grad():
        torch.testing.assert_close(
            model(torch.tensor([[1, 2, 3]])).logits, before, rtol=1e-4, atol=1e-5
        )


@pytest.mark.parametrize("arch, dtype", [("gemma2", torch.float32), ("llama", torch.bfloat16)])
def test_other_norms_and_dtypes_are_left_alone(arch, dtype):
    """Gemma's norm scales by (1 + weight); a bf16 model's norm is not the kernel's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir(arch)), torch_dtype=dtype)
    assert prepare_norms(model) == 0
    assert _norm_calls(model) == 0
