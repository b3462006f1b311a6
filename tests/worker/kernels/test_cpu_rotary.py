"""The compiled rotary kernel gives modeling_llama's ``x * cos + rotate_half(x) * sin``
bit for bit, and the lean forward runs it."""

import pytest
import torch

from slipstream.worker import kernels
from slipstream.worker.model import lean_forward

pytestmark = pytest.mark.skipif(
    not kernels.load(), reason=f"no CPU kernel: {kernels.unavailable_reason()}"
)


def _llama_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on [T, H, D] with cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos[:, None, :]) + (rotated * sin[:, None, :])


def _cos_sin(tokens: int, head_dim: int, gen: torch.Generator):
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 40
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("tokens", [1, 5, 700])  # 700 rows run on several threads
def test_rotary_kernel_equals_the_llama_formula_bit_for_bit(tokens):
    gen = torch.Generator().manual_seed(tokens)
    heads, head_dim = 9, 64
    x = torch.randn(tokens, heads * head_dim, generator=gen) * 5
    cos, sin = _cos_sin(tokens, head_dim, gen)
    got = torch.ops.slipstream_cpu.rotary(x, cos, sin, head_dim)
    want = _llama_rotary(x.view(tokens, heads, head_dim), cos, sin)
    assert torch.equal(got.view(tokens, heads, head_dim), want)


def test_rotary_kernel_reads_a_column_slice_of_a_fused_projection():
    """q and k are column slices of the fused qkv GEMM's output: strided rows."""
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(6, 576 + 2 * 192, generator=gen)
    q, k, _ = qkv.split([576, 192, 192], dim=-1)
    cos, sin = _cos_sin(6, 64, gen)
    for part, heads in ((q, 9), (k, 3)):
        got = torch.ops.slipstream_cpu.rotary(part, cos, sin, 64)
        assert torch.equal(
            got.view(6, heads, 64), _llama_rotary(part.reshape(6, heads, 64), cos, sin)
        )


def test_rotary_kernel_refuses_an_odd_head_dim_with_a_clear_error():
    with pytest.raises(RuntimeError, match="even head_dim"):
        torch.ops.slipstream_cpu.rotary(torch.zeros(2, 15), torch.zeros(2, 5), torch.zeros(2, 5), 5)


def test_the_lean_forward_of_an_fp32_model_uses_the_kernel_and_a_bf16_one_torch():
    # the activations' dtype is the final norm's (reduced weights keep fp32 activations)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.norm = torch.nn.LayerNorm(2)
    assert lean_forward._rotary_for(model) is lean_forward._kernel_rotary
    assert lean_forward._rotary_for(model.to(torch.bfloat16)) is lean_forward._torch_rotary
